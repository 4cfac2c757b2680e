"""The ``--fp8`` option of the commands that run a model (``hf-openjev serve``, ``hf-openjev eval``): its help text
(what FP8 does and what it costs) and :func:`select_fp8_path`, which checks it against the path asked for.

FP8 is a fast-path option (:attr:`hf_openjev.fast_options.FastPathOptions.fp8`): asking for it selects the fast
path, and asking for it with the reference path is refused, before anything loads. The model is then loaded with
``load_export(..., fp8=MODE)``, which swaps the projections on the CPU so that the device never holds the bf16
weights. Pure Python (no torch): a command line checks its flags before importing the model code.
"""

from __future__ import annotations

from ..checkpoint.fp8_scheme import FP8_MODES
from ..errors import UsageError
from ..fast_options import check_choice

FP8_CHOICES = tuple(FP8_MODES)  # "off", "all", "no-gdn"

FP8_HELP = ("FP8 projections on the fast path, opt-in (default off): all (MLP, attention and Gated DeltaNet "
            "projections) or no-gdn (the Gated DeltaNet's stay bf16). Selects the fast path (on the CPU too); not "
            "with the reference path. The model is quantized on the CPU before it moves to its device, so the "
            "device never holds the bf16 weights (the host does, while loading). It about halves the weights and is "
            "faster than the bf16 fast path, but it does NOT pass the fidelity gate against the fp32 oracle (its "
            "decisions move far more than stock bf16's): figures in recipes/RESULTS.md")


def check_fp8_mode(fp8, name: str = "fp8") -> str:
    """``fp8`` if it is one of :data:`FP8_CHOICES`; else a one-line :class:`~hf_openjev.errors.UsageError` naming
    the option as the caller spells it (``fast_options.check_choice``'s message)."""
    try:
        return check_choice(name, fp8, FP8_CHOICES)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def select_fp8_path(fp8: str, fast: bool | None, *, fp8_flag: str = "fp8",
                    reference_flag: str = "fast=False") -> bool | None:
    """The ``fast`` to run with: True when ``fp8`` is ``"all"`` or ``"no-gdn"`` (FP8 is a fast-path option, so it
    selects the fast path, on the CPU too), else ``fast`` unchanged (None: the fast path on CUDA).

    ``fp8_flag`` and ``reference_flag`` name the two options in the error, as the caller spells them
    (``"--fp8"``, ``"--reference"``). A one-line :class:`~hf_openjev.errors.UsageError` for an unknown mode, or for
    FP8 with the reference path (``fast=False``)."""
    check_fp8_mode(fp8, fp8_flag)
    if fp8 == "off":
        return fast
    if fast is False:
        raise UsageError(f"{fp8_flag} {fp8} is a fast-path option but {reference_flag} asks for the reference path; "
                         f"drop {reference_flag} to run FP8 (it selects the fast path), or drop {fp8_flag} to run the "
                         "reference path in bf16")
    return True

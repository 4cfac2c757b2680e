"""The one call that prepares a model for an FP8 mode: :func:`prepare_model_for_fp8`.

The loader (``load_export(..., fp8=MODE)``), the pipeline (a model still on the CPU, before ``Pipeline`` moves it)
and ``apply_patches`` (``FastPathOptions.fp8``) all call it: the targeted projections are swapped for
:class:`~hf_openjev.fp8.linear.Fp8Linear` where the model is (on the CPU, each bf16 weight freed as its FP8 module
takes its place), and only then is the model moved, so its device never holds the bf16 weights.
"""

from __future__ import annotations

from ..devices import torch_device
from ..errors import UsageError
from .option import check_fp8_mode
from .swap import check_fp8_mode_fits, quantize_model_fp8


def check_fp8_target(fp8, device=None) -> str:
    """``fp8`` if it is a mode (``"off"``, ``"all"``, ``"no-gdn"``) that can be set up for ``device``; else a
    one-line :class:`UsageError` (a ``ValueError``). Reads no model: callers check before loading anything."""
    check_fp8_mode(fp8)
    if fp8 != "off" and isinstance(device, dict):
        raise UsageError(f"fp8={fp8!r} loads the model onto one device (built and quantized on the CPU, then moved); "
                         "pass device='cuda:N' instead of a device_map, or leave fp8 'off'")
    return fp8


def prepare_model_for_fp8(model, fp8: str, device=None) -> int:
    """Swap ``model``'s projections of mode ``fp8`` for ``Fp8Linear`` where ``model`` is, then move it to
    ``device`` (a device string, ``torch.device`` or GPU ordinal; None: it stays). Returns how many projections
    were swapped (0 for ``"off"``, or when they already are FP8).

    ``model``: a :class:`~hf_openjev.model.JevModel` or a Qwen3.5 text model. Refused before anything changes: an
    unknown mode or a ``device_map`` dict (:class:`UsageError`), and a mode that does not cover the model's FP8
    modules (``"off"`` on an FP8 model, say: a ValueError, the bf16 weights are gone). One way: see
    :mod:`hf_openjev.fp8.swap`."""
    check_fp8_target(fp8, device)
    targets = check_fp8_mode_fits(model, fp8)
    count = quantize_model_fp8(model, targets) if targets else 0
    if device is not None:
        model.to(torch_device(device))
    return count

"""Apply and revert the patches: one small record of what was replaced, kept on the patched backbone itself.

``apply_patches(model, options)`` is the one verb that sets a model up for the fast path: it swaps the class of
each stock Qwen3.5 module (text model, decoder layers, Gated DeltaNet, attention) to its packed subclass, stacks
the projections (``options.stacked_projections``) and, on a CUDA model with ``options.cuda_graphs``, creates the
record's graph cache. The modules, their parameters and buffers are untouched, and with no ``pack`` argument every
patched module behaves exactly as the stock one. ``revert_patches`` puts back the recorded classes. No
module-level state: a second import of this package cannot duplicate anything.

The one exception is ``options.fp8`` (opt-in): the targeted projections are swapped for ``Fp8Linear`` modules
(:func:`hf_openjev.fp8.prepare.prepare_model_for_fp8`), which is not revertible: the bf16 weights are gone,
``revert_patches`` keeps the FP8 modules, and asking an FP8 model for ``fp8="off"`` (or fewer FP8 modules) is
refused.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from hf_openjev.family import text_model_of
from hf_openjev.fast_options import FastPathOptions, options_for
from hf_openjev.packing.bucket_policy import BucketPolicy, bucket_policy_for

from .cuda_graphs import PackGraphs, first_use_layers
from .final_row_mlp import PackedDecoderLayer, PackedTextModel
from .packed_candidates import PackedAttention, PackedGatedDeltaNet
from .stacked_projections import stack_projections

SUPPORTED_TRANSFORMERS = ((5, 17), (5, 25))  # [min, max) major.minor
RECORD_ATTRIBUTE = "_hf_openjev_patches"


@dataclass
class PatchRecord:
    """What ``apply_patches`` did to a model, kept on its text model: the options it was set up with (what
    ``score_fast`` runs with unless a call passes others), the replaced classes, and the graph cache."""

    options: FastPathOptions
    replaced: list[tuple[nn.Module, type]] = field(default_factory=list)  # (module, its original class)
    # the CUDA graphs of packed forwards (cuda_graphs.PackGraphs): created by apply_patches, and only there, on a
    # CUDA model with options.cuda_graphs; None elsewhere (every pack then runs eagerly)
    graphs: PackGraphs | None = None
    # the graph buckets of padded packs (hf_openjev.packing.bucket_policy): the measured GEMM cost table of the
    # model's shape, set by apply_patches; None (an unknown shape, the tiny test models): the fixed token steps
    buckets: BucketPolicy | None = None


def _patch_classes() -> dict[type, type]:
    return {cls.__mro__[1]: cls for cls in (PackedTextModel, PackedDecoderLayer, PackedGatedDeltaNet, PackedAttention)}


def check_transformers_version(version: str | None = None) -> None:
    """Refuse Transformers releases whose Qwen3.5 modules these patches were not written against."""
    import transformers

    version = version or transformers.__version__
    major_minor = tuple(int(p) for p in version.split(".")[:2])
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= major_minor < high:
        raise RuntimeError(
            f"hf_openjev patches support transformers >={low[0]}.{low[1]},<{high[0]}.{high[1]}; found {version}. "
            "Install a supported release, or run the reference path (fast=False)."
        )


def patch_record(model) -> PatchRecord | None:
    """The model's record, or None when it is not patched."""
    return getattr(text_model_of(model), RECORD_ATTRIBUTE, None)


def read_options(model) -> FastPathOptions:
    """The options ``model`` is patched with, else its defaults (:func:`~hf_openjev.fast_options.options_for`: its
    family member's over the package's; with ``fp8`` the mode of its FP8 modules when
    :func:`~hf_openjev.fp8.swap.quantize_model_fp8` swapped them before any patch)."""
    record = patch_record(model)
    if record is not None:
        return record.options
    from hf_openjev.fp8.swap import fp8_mode_of  # not at the top: the swap imports the stacked layout's patch

    return options_for(text_model_of(model).config, fp8=fp8_mode_of(model) or "off")


def read_graph_stats(model) -> dict | None:
    """The ``stats()`` of the model's graph cache (captures, replays, ...), or None when it has none."""
    record = patch_record(model)
    return record.graphs.stats() if record is not None and record.graphs is not None else None


@contextmanager
def warming_up(model):
    """``with warming_up(model): ...``: the fast path's packs inside are scored for their captures and first uses
    only, not answered (:meth:`PackGraphs.warming`): what a warm-up that discards its scores runs. Every score
    the fast path returns inside is 0.0 (the rows it reads there are zeros, a graph's stale output or a probe's: no
    answer). Nothing changes for a model without a graph cache (the CPU, ``cuda_graphs=False``)."""
    record = patch_record(model)
    graphs = record.graphs if record is not None else None
    with graphs.warming() if graphs is not None else nullcontext():
        yield


@contextmanager
def compiling_ahead(model, threads: int):
    """``with compiling_ahead(model, 16) as report: <one pass over a warm-up's requests>``: a pass that answers and
    captures nothing. Its Triton kernels are compiled ``threads`` at a time and loaded instead of launched
    (:func:`hf_openjev.ops.parallel_compile.compiling_in_parallel`, whose report this yields, filled at the end), and
    each new graph bucket runs its probe (:meth:`PackGraphs.compiling`), so that a warm-up pass after it records those
    buckets' graphs without probes of their own. Where the pass left something to a first use (a kernel untuned, as
    no tuned configuration for this GPU exists and tuning takes timed runs; a compile or load that failed; an error
    that stopped the pass), the warm-up pass keeps every probe: first uses stay out of the graphs. Without a graph
    cache: the compiles only."""
    from hf_openjev.ops.parallel_compile import compiling_in_parallel

    record = patch_record(model)
    graphs = record.graphs if record is not None else None
    try:
        with graphs.compiling() if graphs is not None else nullcontext():
            with compiling_in_parallel(threads) as report:
                yield report
    except BaseException:
        if graphs is not None:
            graphs.probed_ahead.clear()
        raise
    if graphs is not None and (report["untuned"] or report["failures"]):
        graphs.probed_ahead.clear()


# The warm-ups' compile-ahead threads when a caller names none (warm_up, the bench's and warmup_breakdown's
# --compile-threads): 0, no compile-ahead pass, until a GPU has measured what it saves (recipes/RESULTS.md s34).
COMPILE_THREADS = 0


def check_compile_threads(compile_threads) -> int:
    """``compile_threads`` (None: :data:`COMPILE_THREADS`), or a ValueError unless it is a whole number >= 0 (0: no
    compile-ahead pass)."""
    if compile_threads is None:
        return COMPILE_THREADS
    if not isinstance(compile_threads, int) or isinstance(compile_threads, bool) or compile_threads < 0:
        raise ValueError(f"compile_threads must be a whole number >= 0 (0: off), got {compile_threads!r}")
    return compile_threads


def run_warm_up(model, one_pass, *, compile_threads: int | None = None) -> dict:
    """``one_pass("warm-up")`` (one pass of the fast path over a warm-up's requests) inside :func:`warming_up`; with
    ``compile_threads`` > 0 on a model with a graph cache, first ``one_pass("compile-ahead")`` inside
    :func:`compiling_ahead` (its Triton kernels compiled that many at a time; opt-in until a GPU measures it,
    recipes/RESULTS.md; None: :data:`COMPILE_THREADS`). Returns ``{"compile_ahead", "warm_up_s"}``:
    :func:`compiling_ahead`'s report with that pass's ``seconds``, or None without one; the warm-up pass's seconds
    (host time)."""
    compile_threads = check_compile_threads(compile_threads)
    record = patch_record(model)
    report, start = None, time.perf_counter()
    if compile_threads and record is not None and record.graphs is not None:
        with compiling_ahead(model, compile_threads) as report:
            one_pass("compile-ahead")
    ahead = time.perf_counter()
    with warming_up(model):
        one_pass("warm-up")
    return {"compile_ahead": None if report is None else {**report, "seconds": round(ahead - start, 3)},
            "warm_up_s": round(time.perf_counter() - ahead, 3)}


def require_patches(model) -> PatchRecord:
    """The model's record; a RuntimeError that names ``apply_patches`` when the model is not patched."""
    record = patch_record(model)
    if record is None:
        raise RuntimeError(
            "the fast path needs a patched model: call hf_openjev.patches.apply_patches(model, options) when the "
            "model is set up (the pipeline does it when constructed on CUDA or with fast=True; so do the server, "
            "warm_up and the evaluation command on the fast path)")
    return record


def apply_patches(model, options: FastPathOptions | None = None) -> PatchRecord:
    """Set ``model`` up for the fast path, in place, and return its record (idempotent: on a patched model only the
    options change, and a graph cache is created if the new options need one).

    ``options`` (default: the model's, :func:`read_options`) become the record's: ``score_fast`` runs with them
    unless a call passes others. ``stacked_projections`` re-points the projection weights at slices of one stacked
    weight per module (same Parameter objects, same values, no extra memory); that layout stays after
    ``revert_patches``. A model moved to CUDA after patching gets its graph cache from a second ``apply_patches``.

    ``fp8`` ("all", "no-gdn") swaps the targeted projections for FP8 modules, in place and for good (see
    :func:`~hf_openjev.fp8.swap.quantize_model_fp8`): an FP8 model cannot be asked for ``fp8="off"`` (a
    ValueError, before anything changes); load it again for bf16.
    """
    options = options if options is not None else read_options(model)
    if not isinstance(options, FastPathOptions):
        raise TypeError(f"apply_patches takes a FastPathOptions, got {type(options).__name__} "
                        "(build one with FastPathOptions(...) or FastPathOptions.from_mapping(...))")
    from hf_openjev.fp8.prepare import prepare_model_for_fp8  # not at the top: see read_options

    text_model = text_model_of(model)
    record = getattr(text_model, RECORD_ATTRIBUTE, None)
    if record is None:
        check_transformers_version()
    prepare_model_for_fp8(text_model, options.fp8)  # refused before anything changes; empties a stale graph cache
    if record is None:
        classes = _patch_classes()
        record = PatchRecord(options, buckets=bucket_policy_for(text_model.config))
        for module in text_model.modules():
            patched_class = classes.get(type(module))
            if patched_class is not None:
                record.replaced.append((module, type(module)))
                module.__class__ = patched_class
        setattr(text_model, RECORD_ATTRIBUTE, record)
    record.options = options
    if options.stacked_projections:
        stack_projections(text_model)
    if options.cuda_graphs and record.graphs is None and _device_of(text_model).type == "cuda":
        record.graphs = PackGraphs(text_model, probe_layers=first_use_layers(text_model))
    return record


def _device_of(module: nn.Module) -> torch.device:
    parameter = next(module.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def revert_patches(model) -> bool:
    """Restore every replaced class; returns False when the model was not patched."""
    text_model = text_model_of(model)
    record = getattr(text_model, RECORD_ATTRIBUTE, None)
    if record is None:
        return False
    for module, original in record.replaced:
        module.__class__ = original
    delattr(text_model, RECORD_ATTRIBUTE)
    return True


@contextmanager
def patched(model, options: FastPathOptions | None = None):
    """``with patched(model, options): ...``: on exit, reverts the patches if it applied them, or restores the
    options the model had if it was already patched."""
    previous = patch_record(model)
    previous_options = previous.options if previous is not None else None
    record = apply_patches(model, options)
    try:
        yield record
    finally:
        if previous is None:
            revert_patches(model)
        else:
            record.options = previous_options

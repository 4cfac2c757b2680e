"""Apply and revert the patches: one small record of what was replaced, kept on the patched backbone itself.

``apply_patches(model)`` swaps the class of each stock Qwen3.5 module (text model, decoder layers, Gated
DeltaNet, attention) to its packed subclass; the modules, their parameters and buffers are untouched, and with
no ``pack`` argument every patched module behaves exactly as the stock one. ``revert_patches`` puts back the
recorded classes. No module-level state: a second import of this package cannot duplicate anything.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import nn

from .final_row_mlp import PackedDecoderLayer, PackedTextModel
from .packed_candidates import PackedAttention, PackedGatedDeltaNet
from .stacked_projections import stack_projections

SUPPORTED_TRANSFORMERS = ((5, 17), (5, 25))  # [min, max) major.minor
RECORD_ATTRIBUTE = "_hf_openjev_patches"


@dataclass(frozen=True)
class PatchOptions:
    packed_candidates: bool = True  # pack several candidates into one varlen forward
    shared_prefix: bool = True  # compute shared prefixes once and hand their states on
    final_row_mlp: bool = True  # last layer: post-norm + MLP + final norm on the scored rows only
    stacked_projections: bool = True  # one GEMM for GDN qkv|z|b|a, attention q|k|v, MLP gate|up (no weight copies)
    cuda_graphs: bool = True  # on CUDA, replay packed forwards as CUDA graphs per shape bucket (cuda_graphs.py)
    # on CUDA, norms / SiLU-mul / gates / RoPE through torch.compile: 27B mean 109.5 -> 93.5 ms, but mid-shape parity
    # against stock 0.0095 -> 0.017 with 1 flip (H200, recipes/results/h200-2026-11-29-s3), so opt-in
    compile_elementwise: bool = False
    # on CUDA, the elementwise group as Triton kernels that round like the plain code (compiled_elementwise.py);
    # compile_elementwise wins when both are on
    fused_elementwise: bool = True
    gdn_fp32: bool = False  # feed the GDN kernel fp32 q/k/v, for parity with the stock fp32 fallback (not yet measured)


@dataclass
class PatchRecord:
    options: PatchOptions
    replaced: list[tuple[nn.Module, type]] = field(default_factory=list)  # (module, its original class)
    graphs: object | None = None  # a cuda_graphs.PackGraphs, created on the first graph-replayed pack


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


def text_model_of(model) -> nn.Module:
    """The Qwen3.5 text model inside a JevModel, a PEFT wrapper or a bare backbone."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    root = getattr(model, "backbone", model)
    for module in root.modules():
        if isinstance(module, Qwen3_5TextModel):
            return module
    raise TypeError(f"{type(model).__name__} holds no Qwen3_5TextModel to patch")


def patch_record(model) -> PatchRecord | None:
    return getattr(text_model_of(model), RECORD_ATTRIBUTE, None)


def apply_patches(model, *, packed_candidates: bool = True, shared_prefix: bool = True,
                  final_row_mlp: bool = True, stacked_projections: bool = True,
                  cuda_graphs: bool = True, compile_elementwise: bool = False,
                  fused_elementwise: bool = True, gdn_fp32: bool = False) -> PatchRecord:
    """Patch ``model`` in place (idempotent: a second call only updates the options) and return the record.

    ``stacked_projections`` re-points the projection weights at slices of one stacked weight per module (same
    Parameter objects, same values, no extra memory); that layout stays after ``revert_patches``.
    """
    options = PatchOptions(packed_candidates, shared_prefix, final_row_mlp, stacked_projections, cuda_graphs,
                           compile_elementwise, fused_elementwise, gdn_fp32)
    text_model = text_model_of(model)
    record = getattr(text_model, RECORD_ATTRIBUTE, None)
    if record is not None:
        record.options = options
        if stacked_projections:
            stack_projections(text_model)
        return record
    check_transformers_version()
    classes = _patch_classes()
    record = PatchRecord(options)
    for module in text_model.modules():
        patched = classes.get(type(module))
        if patched is not None:
            record.replaced.append((module, type(module)))
            module.__class__ = patched
    if stacked_projections:
        stack_projections(text_model)
    setattr(text_model, RECORD_ATTRIBUTE, record)
    return record


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
def patched(model, **options):
    """``with patched(model, **options): ...``: on exit, reverts the patches if it applied them, or restores the
    options the model had if it was already patched."""
    previous = patch_record(model)
    previous_options = previous.options if previous is not None else None
    record = apply_patches(model, **options)
    try:
        yield record
    finally:
        if previous is None:
            revert_patches(model)
        else:
            record.options = previous_options

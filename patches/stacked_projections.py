"""Stacked input projections: one GEMM where the stock modules launch several.

- Gated DeltaNet: ``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a``  (4 GEMMs -> 1)
- attention:      ``q_proj | k_proj | v_proj``                          (3 GEMMs -> 1)
- MLP:            ``gate_proj | up_proj``                                (2 GEMMs -> 1)

Prepared once (``stack_projections``): the rows of the projections are copied into one weight, and each original
``nn.Linear`` weight is re-pointed at its slice of it, so there is no second copy of any weight and the stock
forward (and ``revert_patches``) keep working on the same Parameter objects. Projections that are not plain
bias-free ``nn.Linear`` layers (a PEFT LoRA wrapper, say) are left alone and run one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

STACKED_ATTRIBUTE = "_hf_openjev_stacked"
GROUPS = {
    "Qwen3_5GatedDeltaNet": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "Qwen3_5Attention": ("q_proj", "k_proj", "v_proj"),
    "Qwen3_5MLP": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class StackedProjection:
    weight: torch.Tensor  # [sum(out_features), in_features]
    sizes: tuple[int, ...]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, in] -> one [T, out_i] view per projection."""
        return F.linear(x, self.weight).split(self.sizes, dim=-1)


def _stock_name(module: nn.Module) -> str | None:
    for cls in type(module).__mro__:
        if cls.__name__ in GROUPS:
            return cls.__name__
    return None


def _stack(module: nn.Module, names: tuple[str, ...]) -> StackedProjection | None:
    layers = [getattr(module, name) for name in names]
    if not all(type(layer) is nn.Linear and layer.bias is None for layer in layers):
        return None
    weights = [layer.weight for layer in layers]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return None
    stacked = torch.cat([w.detach() for w in weights])  # the one copy; the originals become views of it
    offset = 0
    for weight in weights:
        rows = weight.shape[0]
        weight.data = stacked[offset:offset + rows]
        offset += rows
    return StackedProjection(stacked, tuple(w.shape[0] for w in weights))


@torch.no_grad()
def stack_projections(root: nn.Module) -> int:
    """Stack the projections of every GDN, attention and MLP module under ``root`` (idempotent); returns the count."""
    count = 0
    for module in root.modules():
        name = _stock_name(module)
        if name is None or getattr(module, STACKED_ATTRIBUTE, None) is not None:
            continue
        stacked = _stack(module, GROUPS[name])
        if stacked is not None:
            setattr(module, STACKED_ATTRIBUTE, stacked)
            count += 1
    return count


def projections(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The module's input projections of ``x``, stacked when prepared, else one layer at a time."""
    stacked = getattr(module, STACKED_ATTRIBUTE, None)
    names = GROUPS[_stock_name(module)]
    if (stacked is not None and not torch.compiler.is_compiling()
            and getattr(module, names[0]).weight.data_ptr() != stacked.weight.data_ptr()):
        # the model was moved or cast since stacking (.to() moves each Parameter on its own): stack again. Only
        # eagerly (Dynamo cannot trace a data pointer comparison): a compiled forward reads the stack as it is, so
        # a model moved or cast after it was compiled needs one eager forward first
        with torch.no_grad():
            stacked = _stack(module, names)
        setattr(module, STACKED_ATTRIBUTE, stacked)
    if stacked is not None:
        return stacked(x)
    return tuple(getattr(module, name)(x) for name in names)

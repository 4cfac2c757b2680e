"""Stacked input projections: one GEMM where the stock modules launch several.

- Gated DeltaNet: ``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a``  (4 GEMMs -> 1)
- attention:      ``q_proj | k_proj | v_proj``                          (3 GEMMs -> 1)
- MLP:            ``gate_proj | up_proj``                                (2 GEMMs -> 1)

Prepared once (``stack_projections``): the rows of the projections are copied into one weight, and each original
``nn.Linear`` weight is re-pointed at its slice of it, so there is no second copy of any weight and the stock
forward (and ``revert_patches``) keep working on the same Parameter objects. Projections that are not plain
bias-free ``nn.Linear`` layers (a PEFT LoRA wrapper, say) are left alone and run one by one.

FP8 (:class:`~hf_openjev.fp8.linear.Fp8Linear`, the fast path's ``fp8`` option): the FP8 projections of a
module are stacked apart from its bf16 ones, one GEMM per kind (e4m3 rows and their per-channel scales
concatenated: exact, the rows are independent). The GDN with FP8 projections runs ``qkv | z`` in FP8 and
``b | a`` (never quantized) in bf16: 2 GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hf_openjev.fp8.linear import Fp8Linear

STACKED_ATTRIBUTE = "_hf_openjev_stacked"
GROUPS = {
    "Qwen3_5GatedDeltaNet": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "Qwen3_5Attention": ("q_proj", "k_proj", "v_proj"),
    "Qwen3_5MLP": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class StackedPart:
    """Projections of one kind run as one GEMM: bf16 (``scale`` None) or FP8 (e4m3 ``weight``, fp32 ``scale``)."""

    names: tuple[str, ...]
    weight: torch.Tensor  # [sum(out_features), in_features]
    scale: torch.Tensor | None  # [sum(out_features), 1] fp32 for FP8, else None
    sizes: tuple[int, ...]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, in] -> one [T, out_i] view per projection."""
        if self.scale is None:
            y = F.linear(x, self.weight)
        else:
            y = torch.ops.hf_openjev.fp8_linear(x, self.weight, self.scale, None)
        return y.split(self.sizes, dim=-1)


@dataclass(frozen=True)
class StackedProjection:
    """One module's projections as one GEMM per kind; ``order[i]`` = (part, index in it) of projection ``i``."""

    parts: tuple[StackedPart, ...]
    order: tuple[tuple[int, int], ...]

    def release(self, module: nn.Module, replaced: tuple[str, ...]) -> None:
        """Drop ``module``'s stack (this one) when a projection in ``replaced`` is in it (``stack_projections``
        stacks again later), giving its other projections a storage of their own. The replaced ones keep viewing
        the old stack, whose memory is freed once they are gone."""
        name = _stock_name(module)
        if name is None or not set(replaced) & set(GROUPS[name]):
            return
        with torch.no_grad():
            for member in GROUPS[name]:
                layer = getattr(module, member)
                if member in replaced:
                    continue
                if type(layer) is nn.Linear:
                    layer.weight.data = layer.weight.data.clone()
                elif type(layer) is Fp8Linear:
                    layer.weight, layer.weight_scale = layer.weight.clone(), layer.weight_scale.clone()
        setattr(module, STACKED_ATTRIBUTE, None)

    @property
    def weight(self) -> torch.Tensor:
        """The first part's stacked weight (the only one for a module in one dtype)."""
        return self.parts[0].weight

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.parts[p].sizes[i] for p, i in self.order)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, in] -> one [T, out_i] view per projection, in the group's order."""
        outputs = [part(x) for part in self.parts]
        return tuple(outputs[p][i] for p, i in self.order)

    def is_current(self, module: nn.Module) -> bool:
        """Whether the module's projections still read this stack (``.to()`` moves each weight on its own)."""
        return all(getattr(module, part.names[0]).weight.data_ptr() == part.weight.data_ptr() for part in self.parts)


def _stock_name(module: nn.Module) -> str | None:
    for cls in type(module).__mro__:
        if cls.__name__ in GROUPS:
            return cls.__name__
    return None


def _kind(layer: nn.Module) -> str | None:
    """``"linear"`` or ``"fp8"`` for a bias-free projection that can be stacked, else None."""
    if type(layer) is nn.Linear and layer.bias is None:
        return "linear"
    if type(layer) is Fp8Linear and layer.bias is None:
        return "fp8"
    return None


def _stack_part(layers: list[nn.Module], names: tuple[str, ...]) -> StackedPart | None:
    """Copy the layers' rows into one weight (and scale) and re-point each layer at its slice; one layer: as is."""
    weights = [layer.weight for layer in layers]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return None
    fp8 = type(layers[0]) is Fp8Linear
    sizes = tuple(w.shape[0] for w in weights)
    if len(layers) == 1:
        return StackedPart(names, weights[0], layers[0].weight_scale if fp8 else None, sizes)
    stacked = torch.cat([w.detach() for w in weights])  # the one copy; the originals become views of it
    scale = torch.cat([layer.weight_scale for layer in layers]) if fp8 else None  # [sum N, 1]
    offset = 0
    for layer, rows in zip(layers, sizes):
        if fp8:  # buffers: re-assigned (an Fp8Linear's weight is no Parameter)
            layer.weight = stacked[offset:offset + rows]
            layer.weight_scale = scale[offset:offset + rows]
        else:  # the same Parameter object, now a view
            layer.weight.data = stacked[offset:offset + rows]
        offset += rows
    return StackedPart(names, stacked, scale, sizes)


# outside inference mode even when called inside it (score_fast restacks a cast model there): the weights become
# views of the stack, and an inference tensor could not be written in place later (load_state_dict, say)
@torch.inference_mode(False)
def _stack(module: nn.Module, names: tuple[str, ...]) -> StackedProjection | None:
    layers = [getattr(module, name) for name in names]
    kinds = [_kind(layer) for layer in layers]
    if None in kinds:
        return None
    parts, order = [], []
    for kind in dict.fromkeys(kinds):  # in order of first appearance
        members = [i for i, k in enumerate(kinds) if k == kind]
        part = _stack_part([layers[i] for i in members], tuple(names[i] for i in members))
        if part is None:
            return None
        parts.append((members, part))
    for i in range(len(names)):
        order.append(next((p, members.index(i)) for p, (members, _) in enumerate(parts) if i in members))
    return StackedProjection(tuple(part for _, part in parts), tuple(order))


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
    if stacked is not None and not torch.compiler.is_compiling() and not stacked.is_current(module):
        # the model was moved or cast since stacking (.to() moves each Parameter on its own): stack again. Only
        # eagerly (Dynamo cannot trace a data pointer comparison): a compiled forward reads the stack as it is, so
        # a model moved or cast after it was compiled needs one eager forward first
        with torch.no_grad():
            stacked = _stack(module, names)
        setattr(module, STACKED_ATTRIBUTE, stacked)
    if stacked is not None:
        return stacked(x)
    return tuple(getattr(module, name)(x) for name in names)


def unstack_projections(module: nn.Module, replaced: tuple[str, ...]) -> None:
    """Before the projections named in ``replaced`` are swapped for other modules: drop ``module``'s stack when
    one of them is in it (:meth:`StackedProjection.release`; the FP8 swap calls that method on the stack it finds,
    as it never imports the patches)."""
    stacked = getattr(module, STACKED_ATTRIBUTE, None)
    if stacked is not None:
        stacked.release(module, replaced)

"""FP8 projections in a loaded model: ``quantize_model_fp8(model, targets)`` swaps the targeted ``nn.Linear``
modules for :class:`~hf_openjev.fp8.linear.Fp8Linear`, in place (the step of
:func:`~hf_openjev.fp8.prepare.prepare_model_for_fp8`, the one call the loader, the pipeline and ``apply_patches``
make; the benchmark calls it on its random bf16 model).

Where each FP8 weight comes from:

- a model loaded from an FP8 export (``load_export`` dequantizes it for the reference path and records the export
  with :func:`attach_fp8_source`): the export's own e4m3 weights and scales, read from disk one tensor at a time
  (checked: they dequantize to exactly the weight the model holds);
- otherwise, the module's weight quantized per channel (``quantize_linear``: the same bits ``quantize_export``
  writes for the same bf16 weight).

Each module's bf16 weight is released as soon as its ``Fp8Linear`` is in place (a stacked module is unstacked
first, and its projections that stay bf16 get their own storage), so the model never holds two copies of its
weights. One way: the bf16 weights are gone, so an FP8 model cannot go back to bf16 (``revert_patches`` keeps
the ``Fp8Linear`` modules, as it keeps the stacked layout); load the model again for that.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.fp8_scheme import ALL_TARGETS, FP8_MODES, QUANTIZABLE, resolve_fp8_targets, target_of
from ..family import text_model_of
from .linear import Fp8Linear, quantize_linear

FP8_ATTRIBUTE = "_hf_openjev_fp8"  # on the text model: the module suffixes that are Fp8Linear
SOURCE_ATTRIBUTE = "_hf_openjev_fp8_source"  # on the text model: the Fp8Source it was loaded from
_RECORD_ATTRIBUTE = "_hf_openjev_patches"  # patches.record.RECORD_ATTRIBUTE (fp8 never imports the patches)
_STACKED_ATTRIBUTE = "_hf_openjev_stacked"  # patches.stacked_projections.STACKED_ATTRIBUTE (the same rule)


@dataclass(frozen=True)
class Fp8Source:
    """An FP8 export's e4m3 weights: backbone name (``layers.0.mlp.up_proj``) -> (shard, stored tensor name)."""

    export_dir: Path
    modules: tuple[str, ...]  # the export's quantized module suffixes
    weights: dict[str, tuple[Path, str]]

    def read(self, name: str, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [N, K] e4m3, weight_scale [N, 1] fp32) of module ``name``, on ``device``."""
        from safetensors import safe_open

        path, key = self.weights[name]
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(key).to(device), handle.get_tensor(key + "_scale").to(device)


def attach_fp8_source(model, export_dir: str | Path, modules: Iterable[str]) -> Fp8Source:
    """Record on ``model``'s text model that its targeted weights are the FP8 export ``export_dir``'s, dequantized
    (reads the shard headers only); ``quantize_model_fp8`` then takes the export's e4m3 bits instead of
    re-quantizing."""
    from hf_openjev.checkpoint.files import base_weight_files, read_safetensors_headers, text_key

    weights = {}
    for path in base_weight_files(Path(export_dir)):
        for key, (_, dtype) in read_safetensors_headers(path).items():
            name = text_key(key)
            if dtype == "F8_E4M3" and name is not None and name.endswith(".weight"):
                weights[name[: -len(".weight")]] = (path, key)
    source = Fp8Source(Path(export_dir), tuple(modules), weights)
    setattr(text_model_of(model), SOURCE_ATTRIBUTE, source)
    return source


def fp8_modules(model) -> tuple[str, ...]:
    """The module suffixes (``mlp.gate_proj``, ...) that are FP8 in ``model``; () for a bf16 model."""
    return getattr(text_model_of(model), FP8_ATTRIBUTE, ())


def fp8_mode_of(model) -> str | None:
    """The ``fp8`` mode (``"off"``, ``"all"``, ``"no-gdn"``) whose modules are exactly ``model``'s FP8 ones, else
    None (targets given module by module)."""
    have = fp8_modules(model)
    return next((mode for mode in FP8_MODES if resolve_fp8_targets(mode) == have), None)


def _from_source(source: Fp8Source, name: str, linear: nn.Linear) -> Fp8Linear:
    """The export's FP8 weight of module ``name``, after checking that it is what ``linear`` holds."""
    from hf_openjev.ops.fp8_linear import dequantize_weight

    weight, scale = source.read(name, linear.weight.device)  # [N, K] e4m3, [N, 1] fp32
    stored = dequantize_weight(weight, scale)  # [N, K] fp32
    # what loading gave, up to a later cast of the model (bf16 rounds by 2^-9 relative at most)
    bound = stored.abs() * 2.0**-7 + scale * 2.0**-9
    if not ((linear.weight.detach().float() - stored).abs() <= bound).all():
        raise RuntimeError(f"{name}: the model's weight is not the dequantized e4m3 weight of {source.export_dir} "
                           "(changed since loading?); load the FP8 export again")
    bias = linear.bias.detach().clone() if linear.bias is not None else None
    return Fp8Linear(weight, scale, bias)


def _swap(parent: nn.Module, prefix: str, modules: tuple[str, ...], source: Fp8Source | None) -> list[str]:
    """Swap ``parent``'s targeted nn.Linear children for Fp8Linear; returns the swapped children's names."""
    targets = [name for name, child in parent.named_children()
               if target_of(f"{prefix}{name}.weight", modules) is not None and not isinstance(child, Fp8Linear)]
    if not targets:
        return []
    for name in targets:
        kind = type(getattr(parent, name))
        if kind is not nn.Linear:
            raise TypeError(f"{prefix}{name} is a {kind.__name__}, not an nn.Linear: FP8 needs a merged model "
                            "(load_export), not a PEFT-wrapped one")
    stacked = getattr(parent, _STACKED_ATTRIBUTE, None)  # a patched module's stack: it releases itself
    if stacked is not None:
        stacked.release(parent, tuple(targets))
    for name in targets:
        linear, full = getattr(parent, name), f"{prefix}{name}"
        if source is not None and full in source.weights:
            setattr(parent, name, _from_source(source, full, linear))
        else:
            setattr(parent, name, quantize_linear(linear))
        del linear  # the bf16 weight goes with the module (its stack, if any, once all its views are gone)
    return targets


@torch.no_grad()
def quantize_model_fp8(model, targets: Iterable[str] | str = ALL_TARGETS) -> int:
    """Swap the targeted projections of ``model`` (a JevModel or a Qwen3.5 text model) for Fp8Linear, in place;
    returns how many were swapped (0 when they already are: idempotent).

    ``targets``: a mode (``"all"``, ``"no-gdn"``), groups (``mlp``, ``attention``, ``gdn``) or module suffixes
    (``hf_openjev.checkpoint.fp8_scheme``); the head, embeddings, norms, conv and the GDN's ``in_proj_a``/``in_proj_b`` are
    never quantized. A graph cache of a patched model is emptied (its graphs read the freed weights). One way:
    see the module docstring."""
    modules = resolve_fp8_targets(targets)
    text_model = text_model_of(model)
    source = getattr(text_model, SOURCE_ATTRIBUTE, None)
    count = 0
    for prefix in [name for name, _ in text_model.named_modules()]:  # names only: no reference to an old weight
        parent = text_model.get_submodule(prefix)
        count += len(_swap(parent, f"{prefix}." if prefix else "", modules, source))
    done = set(getattr(text_model, FP8_ATTRIBUTE, ())) | set(modules)
    setattr(text_model, FP8_ATTRIBUTE, tuple(s for s in QUANTIZABLE if s in done))
    record = getattr(text_model, _RECORD_ATTRIBUTE, None)
    if count and record is not None and record.graphs is not None:
        record.graphs = type(record.graphs)(text_model, capacity=record.graphs.capacity)
    return count


def check_fp8_mode_fits(model, mode: str) -> tuple[str, ...]:
    """The module suffixes the fast path's ``fp8`` ``mode`` quantizes; a ValueError when ``model`` already has
    FP8 modules that ``mode`` does not cover (``"off"`` on an FP8 model, say): that cannot be undone."""
    wanted = resolve_fp8_targets(mode)
    extra = [s for s in fp8_modules(model) if s not in wanted]
    if extra:
        raise ValueError(f"fp8={mode!r}: this model's {', '.join(extra)} are already FP8 (Fp8Linear) and their bf16 "
                         "weights are gone, so FP8 cannot be turned off or narrowed on it; keep the fp8 option it "
                         "was set up with, or load the model again")
    return wanted

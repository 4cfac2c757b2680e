"""An FP8 export's weights dequantized to a plain state dict: how the reference path loads an FP8 export.

Every ``<m>.weight`` (e4m3) with its ``<m>.weight_scale`` ([N, 1] or [N] fp32) becomes ``<m>.weight`` =
``(weight.float() * weight_scale).to(dtype)``, bit for bit what compressed-tensors (through Transformers,
``CompressedTensorsConfig(dequantize=True)``) produces; every other tensor is returned as stored (or cast to
``dtype`` by :func:`load_fp8_state_dict`). The result loads into a stock ``Qwen3_5TextModel`` whose config has no
``quantization_config``, so every bf16/fp32 comparison of the project runs unchanged on the FP8 weights (the
activations are then not quantized: that is the op's business, ``hf_openjev.ops.fp8_linear``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from ..errors import CheckpointError

_SCALE = ".weight_scale"


def dequantize_fp8_state(state: Mapping[str, Tensor], *, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    """``state`` with each (e4m3 ``<m>.weight``, fp32 ``<m>.weight_scale``) pair replaced by ``<m>.weight`` in
    ``dtype``; other tensors unchanged (same objects). Raises :class:`CheckpointError` on a scale without its
    weight, an e4m3 weight without its scale, or shapes/dtypes that do not pair."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(_SCALE):
            weight_name = name[: -len("_scale")]
            if weight_name not in state:
                raise CheckpointError(f"{name} has no {weight_name} beside it; the FP8 checkpoint is incomplete")
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            out[name] = _dequantize_one(name, tensor, state.get(name + "_scale"), dtype)
        elif tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1:
            raise CheckpointError(f"{name} is {tensor.dtype}; FP8 exports store float8_e4m3fn weights only")
        else:
            out[name] = tensor
    return out


def _dequantize_one(name: str, weight: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    from hf_openjev.ops.fp8_linear import dequantize_weight

    if scale is None:
        raise CheckpointError(f"{name} is float8_e4m3fn but has no {name}_scale; the FP8 checkpoint is incomplete")
    if weight.dim() != 2 or tuple(scale.shape) not in ((weight.shape[0], 1), (weight.shape[0],)):
        raise CheckpointError(f"{name} is {list(weight.shape)} with a scale of shape {list(scale.shape)}; FP8 exports "
                              f"store [N, K] weights with one scale per output channel ([N, 1])")
    if scale.dtype != torch.float32:
        raise CheckpointError(f"{name}_scale is {scale.dtype}; FP8 exports store fp32 scales")
    return dequantize_weight(weight, scale, dtype)  # [N, K]


def load_fp8_state_dict(export_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Every backbone tensor of the FP8 export ``export_dir``, dequantized, in ``dtype`` on ``device``.

    Reads one shard and one tensor at a time (the result, one model in ``dtype``, is the only large thing held).
    Checks the export's two quantization blocks first (:func:`hf_openjev.checkpoint.fp8_scheme.read_fp8_quantization`) and
    that exactly the declared number of weights is e4m3. Tensor names are as stored (prefixes not stripped)."""
    from safetensors import safe_open

    from ..checkpoint.files import base_weight_files
    from ..checkpoint.fp8_scheme import read_fp8_quantization

    export_dir = Path(export_dir)
    info = read_fp8_quantization(export_dir)
    out: dict[str, Tensor] = {}
    quantized = 0
    for path in base_weight_files(export_dir):
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
            for name in names:
                if name.endswith(_SCALE):
                    continue
                tensor = handle.get_tensor(name)
                if tensor.dtype == torch.float8_e4m3fn:
                    if name + "_scale" not in names:
                        raise CheckpointError(f"{path}: {name} is e4m3 but its scale is not in the same shard")
                    pair = {name: tensor, name + "_scale": handle.get_tensor(name + "_scale")}
                    tensor = dequantize_fp8_state(pair, dtype=dtype)[name]
                    quantized += 1
                elif tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                out[name] = tensor.to(device)
            orphans = [n for n in names if n.endswith(_SCALE) and n[: -len("_scale")] not in names]
            if orphans:
                raise CheckpointError(f"{path}: scales without their weight: {orphans[:3]}")
    if quantized != info.quantized_weights:
        raise CheckpointError(f"{export_dir}: {quantized} weights are e4m3 but the manifest says "
                              f"{info.quantized_weights}; the export is incomplete or was edited")
    return out

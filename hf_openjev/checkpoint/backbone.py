"""A checkpoint directory's backbone and head as modules: the steps both loaders (``hf_openjev.model``) share.

:func:`load_backbone` reads a bf16 export or base model (every weight required, shapes checked against
``config.json`` first), :func:`read_export_config` an export's text config, :func:`make_head` the fp32 head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError
from ..log_filter import quiet_kernel_install_advice
from .files import base_weight_files, expected_backbone_shapes, read_safetensors_headers, text_key
from .package import check_text_config


def load_backbone(weights_dir: Path, text_config, *, dtype: torch.dtype, device) -> nn.Module:
    """``Qwen3_5TextModel.from_pretrained`` with every backbone weight required (no silent random init)."""
    from transformers import Qwen3_5TextModel

    quiet_kernel_install_advice()
    check_weight_shapes(weights_dir, text_config)
    kwargs = {"config": text_config, "dtype": dtype, "output_loading_info": True}
    if device is not None:
        kwargs["device_map"] = str(torch.device(device)) if not isinstance(device, dict) else device
    try:
        backbone, info = Qwen3_5TextModel.from_pretrained(str(weights_dir), **kwargs)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{weights_dir}: cannot load the backbone weights: {exc}") from exc
    missing = [k for k in info.get("missing_keys", []) if not k.endswith("inv_freq")]
    if missing:
        raise CheckpointError(
            f"{weights_dir}: {len(missing)} backbone weights are missing (e.g. {sorted(missing)[:3]}); "
            "the checkpoint is incomplete or not a Qwen3.5 text model"
        )
    return backbone.eval()


def check_weight_shapes(weights_dir: Path, text_config) -> None:
    """Compare the safetensors headers with the shapes ``config.json`` implies (names say which tensor is off)."""

    expected = expected_backbone_shapes(text_config)
    for path in base_weight_files(weights_dir):
        for key, (shape, _) in read_safetensors_headers(path).items():
            name = text_key(key)
            if name in expected and shape != expected[name]:
                raise CheckpointError(
                    f"{path}: tensor {key} has shape {shape} but config.json implies {expected[name]}; "
                    "the weights and config.json do not match"
                )


def make_head(weight, bias, device) -> nn.Linear:
    weight = torch.as_tensor(weight, dtype=torch.float32).reshape(1, -1)
    head = nn.Linear(weight.shape[1], 1, bias=True, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(torch.as_tensor(bias, dtype=torch.float32).reshape(1))
    if device is not None and not isinstance(device, dict):
        head = head.to(device)
    return head.requires_grad_(False)


def read_export_config(export_dir: Path, *, fp8: bool = False):
    """The export's text config; an FP8 export's without its ``quantization_config`` (its weights are dequantized
    here: Transformers must not hand them to compressed-tensors)."""
    from transformers import Qwen3_5TextConfig

    path = export_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; the export is incomplete")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if data.get("model_type") != "qwen3_5_text":
        raise CheckpointError(
            f"{path}: unsupported config model_type {data.get('model_type')!r}; a merged export holds a "
            "qwen3_5_text config"
        )
    try:
        config = Qwen3_5TextConfig.from_pretrained(str(export_dir))
    except Exception as exc:
        raise CheckpointError(f"{path} is not a valid Qwen3.5 text config: {exc}") from exc
    check_text_config(config, where=str(path))
    if getattr(config, "quantization_config", None) is not None:
        if not fp8:
            raise CheckpointError(f"{path} has a quantization_config but the manifest's format is a bf16 export's; "
                                  "the export is inconsistent, re-run `hf-openjev export`")
        del config.quantization_config
    return config

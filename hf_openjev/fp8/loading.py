"""An FP8 export's backbone, dequantized: what ``load_export`` builds for an ``open-jev-text-merged-fp8/1`` export."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..checkpoint.backbone import check_weight_shapes
from ..checkpoint.fp8_scheme import read_fp8_quantization
from ..errors import CheckpointError
from ..log_filter import quiet_kernel_install_advice
from .state import load_fp8_state_dict
from .swap import attach_fp8_source


def load_fp8_backbone(export_dir: Path, text_config, *, dtype: torch.dtype, device) -> nn.Module:
    """An FP8 export's backbone with every e4m3 weight dequantized to ``dtype`` (``load_fp8_state_dict``, one
    tensor at a time, straight to ``device``), assigned without a copy by ``from_pretrained(state_dict=...)``. The
    model remembers the export (``attach_fp8_source``) so that the fast path's ``fp8`` option reads its e4m3 bits."""
    from transformers import Qwen3_5TextModel

    quiet_kernel_install_advice()
    check_weight_shapes(export_dir, text_config)
    target = device if device is not None and not isinstance(device, dict) else "cpu"
    state = load_fp8_state_dict(export_dir, dtype=dtype, device=torch.device(target))
    kwargs = {"config": text_config, "dtype": dtype, "output_loading_info": True, "state_dict": state}
    if isinstance(device, dict):
        kwargs["device_map"] = device
    try:
        backbone, info = Qwen3_5TextModel.from_pretrained(None, **kwargs)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{export_dir}: cannot load the FP8 backbone weights: {exc}") from exc
    missing = [k for k in info.get("missing_keys", []) if not k.endswith("inv_freq")]
    unexpected = list(info.get("unexpected_keys", []))
    if missing or unexpected:
        raise CheckpointError(f"{export_dir}: the FP8 weights do not fit the model: {len(missing)} missing (e.g. "
                              f"{sorted(missing)[:3]}), {len(unexpected)} unexpected (e.g. {sorted(unexpected)[:3]})")
    attach_fp8_source(backbone, export_dir, read_fp8_quantization(export_dir).modules)
    return backbone.eval()

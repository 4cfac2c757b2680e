"""Reading an export's stored tensors in tests: every weight shard's tensors by name, and a tensor's raw bytes
(e4m3 compared bit for bit: ``torch.equal`` on float8 would compare values, and NaN never equals itself)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from hf_openjev.checkpoint.files import base_weight_files


def stored_tensors(export_dir) -> dict[str, torch.Tensor]:
    """Every tensor of the export's weight shards, by stored name."""
    out = {}
    for path in base_weight_files(export_dir):
        out.update(load_file(str(path)))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as uint8, for bit-for-bit comparisons."""
    return t.contiguous().view(torch.uint8)

"""The backbone dtype a caller asks for, as a ``torch.dtype``."""

from __future__ import annotations

import torch

from .errors import UsageError

DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")  # what a caller may name


def resolve_dtype(dtype) -> torch.dtype:
    """``"auto"``/None -> bfloat16 (the checkpoint dtype); one of :data:`DTYPE_NAMES` -> its torch dtype; any other
    name (``"bf16"``) -> a one-line UsageError naming them."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if dtype not in DTYPE_NAMES or not isinstance(resolved, torch.dtype):
            raise UsageError(f"unknown dtype {dtype!r}; use 'bfloat16', 'float16', 'float32' or 'auto'")
        return resolved
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"dtype must be a torch.dtype or its name, got {dtype!r}")
    return dtype

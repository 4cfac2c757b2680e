"""Lazy access to fla-core (the ``[cuda]`` extra). Only CUDA kernels call this, never module import.

Importing ``fla`` on a CPU-only machine makes stock Transformers bind it and crash, so nothing in
``hf_openjev.ops`` imports fla or triton at module level.
"""

from __future__ import annotations

import os

_READY = False


def fla_ready() -> None:
    """Import fla once and switch off its identity-keyed tensor cache.

    fla memoises helpers such as ``prepare_chunk_offsets`` by the *identity* of their tensor arguments. With
    static CUDA-graph buffers whose contents change between replays, a cache hit would return metadata of an
    earlier batch, so we disable the cache (``fla.utils.FLA_DISABLE_TENSOR_CACHE``, read at every call).
    This is process-wide for fla.
    """
    global _READY
    if _READY:
        return
    os.environ.setdefault("FLA_DISABLE_TENSOR_CACHE", "1")
    import fla.utils

    fla.utils.FLA_DISABLE_TENSOR_CACHE = True
    _READY = True


def versions() -> dict[str, str | None]:
    """torch / triton / fla versions (for benchmark records); imports triton and fla, so CUDA machines only."""
    import torch

    out: dict[str, str | None] = {"torch": torch.__version__, "triton": None, "fla": None}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import fla

        out["fla"] = fla.__version__
    except ImportError:
        pass
    return out

"""Lazy access to fla-core (the ``[cuda]`` extra). Only CUDA kernels call this, never module import.

Importing ``fla`` on a CPU-only machine makes stock Transformers bind it and crash, so nothing in
``hf_openjev.ops`` imports fla or triton at module level.
"""

from __future__ import annotations

import os
from pathlib import Path

_READY = False
# fla's tuned kernel configurations for the family's shapes, per GPU (fla's sanitized device name), in fla's own
# config-file format (<kernel>.json); recipes/warmup_breakdown.py --dump-fla-configs writes them on the GPU
CARRIED_CONFIGS = Path(__file__).parent / "fla_configs"


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
    use_carried_configs()
    _READY = True


def use_carried_configs() -> Path | None:
    """Let fla's autotuners take the configurations carried for this GPU instead of tuning on first use.

    On a machine with an empty kernel cache, fla benchmarks every configuration of each kernel the first time it
    sees a key (head counts, dims, chunk size, dtypes: once per model shape), compiling each: about a minute of a
    cold warm-up. fla 0.6 reads tuned configurations from ``FLA_CONFIG_DIR``/<kernel>.json when ``FLA_CACHE_MODE``
    allows (``fla.ops.utils.cache``). Here: the folder of :data:`CARRIED_CONFIGS` named after this GPU, in strict
    mode (an exact key only: another shape, dtype or kernel version tunes as before). Nothing is changed when the
    user set ``FLA_CACHE_MODE`` or ``FLA_CONFIG_DIR`` or when no folder matches the GPU. Returns the folder used."""
    if "FLA_CACHE_MODE" in os.environ or "FLA_CONFIG_DIR" in os.environ:
        return None  # the user's own choice
    from fla.ops.utils import cache

    folder = CARRIED_CONFIGS / cache.get_gpu_info()
    if not folder.is_dir():
        return None
    os.environ["FLA_CONFIG_DIR"] = str(folder)  # read at each lookup (fla.ops.utils.cache.get_fla_config_dir)
    cache.FLA_CACHE_MODE = cache.FlaCacheMode.STRICT  # read at each call; the env var only at fla's import
    return folder


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

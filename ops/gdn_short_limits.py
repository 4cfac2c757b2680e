"""The short-sequence GDN kernels' limits, checked before Triton loads (``gdn_prefill_short.py`` and the two Triton
modules, ``gdn_wy_triton.py`` and ``gdn_short_triton.py``, import them from here, so neither imports the other)."""

from __future__ import annotations

from torch import Tensor

# tl.dot input precisions of the products with an fp32 operand (Triton's NVIDIA backend): fp32 FMA, three tf32
# MMAs, one tf32 MMA, three or six bf16 MMAs on the split operands
PRECISIONS = ("ieee", "tf32x3", "tf32", "bf16x3", "bf16x6")


def check_short_shapes(q: Tensor, v: Tensor, block_v: int, chunk: int, precision: str, num_warps: int = 4) -> None:
    """The kernel's limits for q [T, Hk, Dk] and v [T, Hv, Dv]: :func:`check_short_dims` of their head dims."""
    check_short_dims(q.shape[-1], v.shape[-1], block_v, chunk, precision, num_warps)


def check_short_dims(dk: int, dv: int, block_v: int, chunk: int, precision: str, num_warps: int = 4) -> None:
    """The kernel's limits: head dims powers of two >= 16 (Triton tiles); block_v a power of two >= 16 dividing
    Dv and >= 4 * num_warps; chunk 16, 32 or 64; precision one of ``PRECISIONS``. A ValueError says which fails.

    block_v < 4 * num_warps (e.g. 16 with 8 warps) splits the [64, block_v] products over two Hopper warp groups
    into 8-column wgmma tiles, and that build faulted on an H200 ("illegal memory access"; Triton issue 10629
    reports the same for N=8 tf32 MMAs), so it is refused rather than run."""
    for name, d in (("Dk", dk), ("Dv", dv)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"gdn_prefill_short: {name}={d} must be a power of two >= 16; use gdn_prefill")
    if block_v < 16 or block_v & (block_v - 1) or dv % block_v:
        raise ValueError(f"gdn_prefill_short: block_v={block_v} must be a power of two >= 16 dividing Dv={dv}")
    if block_v < 4 * num_warps:
        raise ValueError(f"gdn_prefill_short: block_v={block_v} with num_warps={num_warps} faults on Hopper; "
                         f"use block_v >= {4 * num_warps} or num_warps <= {max(block_v // 4, 1)}")
    if chunk not in (16, 32, 64):
        raise ValueError(f"gdn_prefill_short: chunk={chunk} must be 16, 32 or 64")
    if precision not in PRECISIONS:
        raise ValueError(f"gdn_prefill_short: precision={precision!r} must be one of {PRECISIONS}")


def dot_precision(precision: str, on_cuda: bool) -> str:
    """The ``input_precision`` the kernels pass to ``tl.dot``: Triton's interpreter (off CUDA) lacks the bf16
    splits, so there "bf16x3" and "bf16x6" run as "ieee"."""
    return precision if on_cuda or not precision.startswith("bf16") else "ieee"

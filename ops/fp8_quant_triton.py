"""Triton per-row e4m3 quantization for ``fp8_linear``'s CUDA path (imported lazily by ``fp8_linear.py``).

One program per row, two passes over it (the second mostly from L2): the row maximum, then the quantized row.
The plain code (``fp8_linear._quantize_rows``) takes six ATen kernels and as many round trips of an fp32 copy
through memory, which cost more than the FP8 GEMM saves at the 27B shapes (recipes/RESULTS.md, "FP8"). It rounds as the plain code does, so it equals it bit for bit:

- the maximum of |x| is exact in any order; it is clamped from below by ``MIN_AMAX`` in fp32;
- both divisions are IEEE round-to-nearest (``div_rn``), as nvcc compiles ATen's ``/``;
- the clamp to +-448 comes before the conversion, which rounds to nearest even (``cvt.rn.satfinite`` on Hopper,
  the same result as ATen's conversion for values within range).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_x, min_amax, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    q_row = Q + row * K
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), min_amax), FP8_MAX)
    tl.store(S + row, scale)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_row + cols, q.to(Q.dtype.element_ty), mask=cols < K)


def quantize_rows(x: Tensor, min_amax: float, fp8_max: float) -> tuple[Tensor, Tensor]:
    """x [M, K] (rows may be strided; the last dimension contiguous) -> (q [M, K] e4m3, scale [M, 1] fp32)."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), min_amax, FP8_MAX=fp8_max, BLOCK=_BLOCK,
                                    num_warps=4, enable_fp_fusion=False)
    return q, scale

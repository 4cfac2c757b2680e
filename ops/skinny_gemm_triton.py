"""The skinny GEMM: y [M, N] = x [M, K] @ w [N, K]^T for M <= 256, streaming each weight tile once (CUDA only;
imported lazily by ``skinny_linear.py``'s CUDA kernel, and by ``recipes/skinny_gemm_check.py`` and the tests under
Triton's interpreter).

With few rows the GEMM reads its weights and little else (48.7 GB per 27B forward): the kernel's one job is to
stream them at the memory's rate. Design:

- grid (N / BLOCK_N, SPLIT_K): program (j, s) owns rows [j * BLOCK_N, (j + 1) * BLOCK_N) of w and the K range
  [s * K / SPLIT_K, (s + 1) * K / SPLIT_K); it reads that [BLOCK_N, K / SPLIT_K] slice of w exactly once, in
  [BLOCK_N, BLOCK_K] tiles, with all M rows of x (a [BLOCK_M, BLOCK_K] tile a step, from L2: x is small);
- swapped operands: each step is ``acc [BLOCK_N, BLOCK_M] += w_tile @ x_tile^T``, so the MMA's M side is the
  weight tile (64 rows a Hopper warp group) and the few tokens are its N side (any multiple of 8 up to 256):
  tensor-core shapes at every M, with no padding of the token side beyond BLOCK_M;
- BLOCK_M (16..256, the next power of two >= M) is a constexpr, so each M bucket is one build; the rows past M are
  masked (loaded as zeros, never stored);
- SPLIT_K == 1: the fp32 accumulator is rounded once to y's dtype and stored. SPLIT_K > 1: each program writes its
  fp32 partial sums to a workspace [SPLIT_K, M, N], and a second launch (``_sum_splits_kernel``) adds the splits in
  the order 0, 1, ..., SPLIT_K - 1 and rounds once: no atomics, the same bits on every run;
- the launch configuration comes from ``skinny_gemm_configs.choose_config`` (tables, no autotuning).

Accumulation is fp32 (``tl.dot`` on the 16-bit tiles, fp32 accumulator). Triton's interpreter (no CUDA, for the
CPU checks) computes 16-bit ``tl.dot`` wrongly, so there the tiles are upcast to fp32 first (``UPCAST``): the same
products, exact in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hf_openjev.ops.skinny_gemm_configs import SkinnyConfig, block_m_for, check_config, choose_config

SUM_BLOCK = 1024  # elements of y a program of the split sum handles


@triton.jit
def _skinny_gemm_kernel(X, W, Y, M, N, stride_xm, stride_wn, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """Program (j, s): Y[s] (or Y when the grid has one split) [M, N] rows j * BLOCK_N.. = the K slice s of
    x @ w^T; the K slice is K_SPLIT long (a multiple of BLOCK_K)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of w, columns of y
    rows_m = tl.arange(0, BLOCK_M)  # rows of x and y
    cols = tl.arange(0, BLOCK_K)
    k0 = pid_k * K_SPLIT
    w_ptrs = W + rows_n.to(tl.int64)[:, None] * stride_wn + (k0 + cols)[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = X + rows_m[:, None] * stride_xm + (k0 + cols)[None, :]  # [BLOCK_M, BLOCK_K]
    w_mask = rows_n[:, None] < N
    x_mask = rows_m[:, None] < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if UPCAST:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc)  # [BLOCK_N, BLOCK_M], fp32
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = Y + pid_k * M * N + rows_m[None, :] * N + rows_n[:, None]  # y^T tile: [BLOCK_N, BLOCK_M]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=(rows_n[:, None] < N) & (rows_m[None, :] < M))


@triton.jit
def _sum_splits_kernel(WS, Y, NUMEL, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """Y[i] = sum over s = 0..SPLIT_K-1, in that order, of WS[s, i] (fp32), rounded once to Y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    total = tl.load(WS + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        total += tl.load(WS + s * NUMEL + offs, mask=mask, other=0.0)
    tl.store(Y + offs, total.to(Y.dtype.element_ty), mask=mask)


def skinny_gemm(x: Tensor, weight: Tensor, config: SkinnyConfig | None = None) -> Tensor:
    """x [M, K] (16-bit, rows may be strided, the last dimension contiguous); weight [N, K] same dtype ->
    y [M, N] in x.dtype. ``config`` None: ``choose_config(M, N, K)``. No host syncs (graph-capturable); M = 0
    launches nothing. The op (``skinny_linear.py``) checks the limits before calling."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    config = config or choose_config(M, N, K)
    block_m = block_m_for(M)
    check_config(config, block_m, K)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    split = config.split_k
    out = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, config.block_n), split)
    _skinny_gemm_kernel[grid](x, weight, out, M, N, x.stride(0), weight.stride(0), K_SPLIT=K // split,
                              BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                              UPCAST=not x.is_cuda, num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, SUM_BLOCK),)](out, y, M * N, SPLIT_K=split, BLOCK=SUM_BLOCK,
                                                             num_warps=4)
    return y

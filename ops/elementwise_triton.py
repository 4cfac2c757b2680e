"""Triton kernels of the elementwise group (CUDA only; imported lazily by ``elementwise.py``'s CUDA kernels).

Each kernel does in one pass what the plain code (``<op>_reference`` in ``elementwise.py``) does in several
ATen kernels, and rounds where the plain code rounds:

- every intermediate the plain code stores in the model dtype is rounded to it here too (``.to(dtype)``);
- ``exp``/``log1p``/``rsqrt`` come from libdevice, the CUDA math library ATen's kernels call, and divisions are
  IEEE round-to-nearest (``div_rn``), as nvcc compiles ATen's ``/``;
- FMA contraction is off (``enable_fp_fusion=False``): the plain code rounds every product on its own.

- the norms sum the squares of a row in the order of ATen's mean (``torch.mean`` over the plain code's fp32
  ``[rows, D]`` tensor of squares), so that their means are the plain code's to the last bit. A sum in another
  order moved a few bf16 outputs by a unit, and that alone measurably worsened mid-shape parity against stock on
  random-weight models (recipes/RESULTS.md). The order is the one of
  ``reduce_kernel`` in aten/src/ATen/native/cuda/Reduce.cuh for rows >= 16 (one warp per row; see
  ``_sum_squares_aten``); ``row_order`` checks it against ATen on the device once per width before any kernel
  relies on it. Where it does not apply (fewer than 16 rows, widths not a multiple of 128 or past 8,064, or a
  device where the check fails), a norm takes ATen's mean of squares a Triton kernel writes: three kernels.

So every kernel here is expected to equal the plain code bit for bit; tests/test_op_elementwise.py (``-m gpu``)
checks that on the forward's own layouts at the 27B shape.

Inputs may be row-strided views (the column slices of a stacked projection, the query half of ``q|gate``): the
kernels read them in place instead of copying them first. Layout arguments: ``[T, H, D]`` tensors are addressed
as ``t * stride_t + h * stride_h + d`` (last dimension contiguous); outputs are contiguous.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

_LAUNCH = dict(enable_fp_fusion=False)


@triton.jit
def _row_tile(n_rows, H, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's rows of a [T * H, D] layout: (rows, cols, in-bounds mask, t = rows // H, h = rows % H)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    return rows, cols, mask, rows // H, rows % H


@triton.jit
def _load_f32(P, stride_t, stride_h, t, h, cols, mask):
    """[R, D] tile of a [T, H, D] tensor at ``t * stride_t + h * stride_h + d``, in fp32 (zeros out of bounds)."""
    return tl.load(P + (t * stride_t + h * stride_h)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _residual_sum(X, x_offsets, RES, res_offsets, mask, HAS_RESIDUAL: tl.constexpr):
    """x in fp32, or residual + x rounded to the residual's dtype (the decoder layer's add: the model dtype, or fp32
    with the fast path's ``residual_fp32``) when HAS_RESIDUAL."""
    x = tl.load(X + x_offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = (tl.load(RES + res_offsets, mask=mask, other=0.0).to(tl.float32) + x).to(RES.dtype.element_ty)
        x = x.to(tl.float32)
    return x


@triton.jit
def _squares_kernel(X, stride_xt, stride_xh, RES, stride_rt, SQUARES, n_rows, H, D, HAS_RESIDUAL: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """SQUARES [n_rows, D] fp32 = x^2, x = X or (RES + X rounded to the model dtype) when HAS_RESIDUAL."""
    rows, cols, mask, t, h = _row_tile(n_rows, H, D, BLOCK_R, BLOCK_D)
    x = _residual_sum(X, (t * stride_xt + h * stride_xh)[:, None] + cols[None, :], RES,
                      (t * stride_rt)[:, None] + cols[None, :], mask, HAS_RESIDUAL)
    tl.store(SQUARES + rows[:, None] * D + cols[None, :], x * x, mask=mask)


# Where ATen's mean keeps the squares of a contiguous fp32 [rows, D] row (rows >= 16; D = 128 * J; D / 32 < 256):
# block 32 x 16, one warp per row, no split across warps or blocks. Lane l keeps 4 accumulators; accumulator i
# adds, in order of j, element 128 j + 4 l + i (vectorized loads) or 128 j + 32 i + l (one element per load);
# then a0 + a1 + a2 + a3 left to right; then warp shuffles, a pairwise tree over the lanes: offsets 16, 8, 4, 2, 1
# ("halving": lane l first adds lane l + 16) in torch's current source, 1, 2, 4, 8, 16 in older ones; the mean is
# that sum times float(rows) / float(rows * D). Which loads and which tree a torch build uses, ``row_order`` finds
# out on the device; the kernels take them as constexprs (IN_KERNEL_SUM False: read ATen's mean from MEAN_SQUARES).


@triton.jit
def _sum_squares_aten(X, stride_xt, stride_xh, RES, stride_rt, rows, t, h, n_rows, HAS_RESIDUAL: tl.constexpr,
                      VECTORIZED: tl.constexpr, HALVING_LANES: tl.constexpr, J: tl.constexpr, BLOCK_R: tl.constexpr):
    """[R]: the sum of x^2 over each row, added in ATen's order (above)."""
    lane = tl.arange(0, 32)[:, None]
    slot = tl.arange(0, 4)[None, :]
    if VECTORIZED:
        inner = lane * 4 + slot  # [32, 4]
    else:
        inner = slot * 32 + lane
    mask = (rows < n_rows)[:, None, None]
    x_base = (t * stride_xt + h * stride_xh)[:, None, None]
    res_base = (t * stride_rt)[:, None, None]
    acc = tl.zeros((BLOCK_R, 32, 4), dtype=tl.float32)
    for j in tl.static_range(J):
        offsets = j * 128 + inner[None, :, :]
        x = _residual_sum(X, x_base + offsets, RES, res_base + offsets, mask, HAS_RESIDUAL)
        acc += x * x  # the first add is 0 + x^2: exact, as ATen's start from its identity
    slot3 = tl.arange(0, 4)[None, None, :]  # pick accumulator i exactly (its value plus three zeros)
    total = tl.sum(tl.where(slot3 == 0, acc, 0.0), axis=2)
    total = total + tl.sum(tl.where(slot3 == 1, acc, 0.0), axis=2)
    total = total + tl.sum(tl.where(slot3 == 2, acc, 0.0), axis=2)
    total = total + tl.sum(tl.where(slot3 == 3, acc, 0.0), axis=2)  # [R, 32]
    if HALVING_LANES:  # lane l + lane l + 16, then l + l + 8, ...
        total = tl.sum(tl.reshape(total, (BLOCK_R, 2, 16)), axis=1)
        total = tl.sum(tl.reshape(total, (BLOCK_R, 2, 8)), axis=1)
        total = tl.sum(tl.reshape(total, (BLOCK_R, 2, 4)), axis=1)
        total = tl.sum(tl.reshape(total, (BLOCK_R, 2, 2)), axis=1)
    else:  # lanes 2k + 2k + 1, then pairs of pairs, ...
        total = tl.sum(tl.reshape(total, (BLOCK_R, 16, 2)), axis=2)
        total = tl.sum(tl.reshape(total, (BLOCK_R, 8, 2)), axis=2)
        total = tl.sum(tl.reshape(total, (BLOCK_R, 4, 2)), axis=2)
        total = tl.sum(tl.reshape(total, (BLOCK_R, 2, 2)), axis=2)
    return tl.sum(total, axis=1)  # the last pair


@triton.jit
def _inv_rms(X, stride_xt, stride_xh, RES, stride_rt, MEAN_SQUARES, rows, t, h, n_rows, factor, eps,
             HAS_RESIDUAL: tl.constexpr, IN_KERNEL_SUM: tl.constexpr, VECTORIZED: tl.constexpr,
             HALVING_LANES: tl.constexpr, J: tl.constexpr, BLOCK_R: tl.constexpr):
    """[R, 1]: 1 / sqrt(mean(x^2) + eps) of each row; the mean summed here or read from ATen's."""
    if IN_KERNEL_SUM:
        mean = _sum_squares_aten(X, stride_xt, stride_xh, RES, stride_rt, rows, t, h, n_rows, HAS_RESIDUAL,
                                 VECTORIZED, HALVING_LANES, J, BLOCK_R) * factor
    else:
        mean = tl.load(MEAN_SQUARES + rows, mask=rows < n_rows, other=1.0)
    return libdevice.rsqrt(mean + eps)[:, None]


@triton.jit
def _mean_squares_kernel(X, stride_xt, stride_xh, OUT, n_rows, H, factor, VECTORIZED: tl.constexpr,
                         HALVING_LANES: tl.constexpr, J: tl.constexpr, BLOCK_R: tl.constexpr):
    """OUT [n_rows] fp32 = mean(x^2) per row in ATen's order (``row_order``'s check and the tests)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mean = _sum_squares_aten(X, stride_xt, stride_xh, X, 0, rows, rows // H, rows % H, n_rows, False, VECTORIZED,
                             HALVING_LANES, J, BLOCK_R) * factor
    tl.store(OUT + rows, mean, mask=rows < n_rows)


@triton.jit
def _rms_norm_kernel(X, stride_xt, stride_xh, RES, stride_rt, NEW_RES, MEAN_SQUARES, W, OUT, n_rows, H, D, factor, eps,
                     HAS_RESIDUAL: tl.constexpr, IN_KERNEL_SUM: tl.constexpr, VECTORIZED: tl.constexpr,
                     HALVING_LANES: tl.constexpr, J: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """OUT = RMSNorm(x), x = X or (RES + X in the model dtype, stored to NEW_RES when HAS_RESIDUAL)."""
    rows, cols, mask, t, h = _row_tile(n_rows, H, D, BLOCK_R, BLOCK_D)
    inv = _inv_rms(X, stride_xt, stride_xh, RES, stride_rt, MEAN_SQUARES, rows, t, h, n_rows, factor, eps,
                   HAS_RESIDUAL, IN_KERNEL_SUM, VECTORIZED, HALVING_LANES, J, BLOCK_R)
    offsets = rows[:, None] * D + cols[None, :]
    x = _residual_sum(X, (t * stride_xt + h * stride_xh)[:, None] + cols[None, :], RES,
                      (t * stride_rt)[:, None] + cols[None, :], mask, HAS_RESIDUAL)
    if HAS_RESIDUAL:
        tl.store(NEW_RES + offsets, x.to(NEW_RES.dtype.element_ty), mask=mask)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = (x * inv) * (1.0 + w)[None, :]
    tl.store(OUT + offsets, y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(X, stride_xt, stride_xh, G, stride_gt, stride_gh, MEAN_SQUARES, W, OUT, n_rows, H, D, factor,
                           eps, IN_KERNEL_SUM: tl.constexpr, VECTORIZED: tl.constexpr, HALVING_LANES: tl.constexpr,
                           J: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, cols, mask, t, h = _row_tile(n_rows, H, D, BLOCK_R, BLOCK_D)
    inv = _inv_rms(X, stride_xt, stride_xh, X, 0, MEAN_SQUARES, rows, t, h, n_rows, factor, eps, False, IN_KERNEL_SUM,
                   VECTORIZED, HALVING_LANES, J, BLOCK_R)
    x = _load_f32(X, stride_xt, stride_xh, t, h, cols, mask)
    g = _load_f32(G, stride_gt, stride_gh, t, h, cols, mask)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    dtype = OUT.dtype.element_ty
    normed = (x * inv).to(dtype).to(tl.float32)
    weighted = (w[None, :] * normed).to(dtype).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    tl.store(OUT + rows[:, None] * D + cols[None, :], (weighted * silu).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(X, stride_xt, stride_xh, MEAN_SQUARES, W, COS, SIN, stride_ct, OUT, n_rows, H, D, R, factor,
                         eps, IN_KERNEL_SUM: tl.constexpr, VECTORIZED: tl.constexpr, HALVING_LANES: tl.constexpr,
                         J: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per head row: n = RMSNorm(x) in the model dtype; the first R dims get n*cos + rotate_half(n)*sin."""
    rows, cols, mask, t, h = _row_tile(n_rows, H, D, BLOCK_R, BLOCK_D)
    inv = _inv_rms(X, stride_xt, stride_xh, X, 0, MEAN_SQUARES, rows, t, h, n_rows, factor, eps, False, IN_KERNEL_SUM,
                   VECTORIZED, HALVING_LANES, J, BLOCK_R)
    x = _load_f32(X, stride_xt, stride_xh, t, h, cols, mask)
    dtype = OUT.dtype.element_ty
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    normed = ((x * inv) * (1.0 + w)[None, :]).to(dtype).to(tl.float32)
    # rotate_half over the first R dims: [-n[R/2:R], n[:R/2]]; the partner column of each rotated column
    half = R // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    rotated = cols < R
    pmask = (rows < n_rows)[:, None] & rotated[None, :]
    xp = tl.load(X + (t * stride_xt + h * stride_xh)[:, None] + partner[None, :], mask=pmask, other=0.0).to(tl.float32)
    wp = tl.load(W + partner, mask=rotated, other=0.0).to(tl.float32)
    normed_p = ((xp * inv) * (1.0 + wp)[None, :]).to(dtype).to(tl.float32)
    normed_p = tl.where((cols < half)[None, :], -normed_p, normed_p)
    cs_offsets = (t * stride_ct)[:, None] + cols[None, :]
    cos = tl.load(COS + cs_offsets, mask=pmask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + cs_offsets, mask=pmask, other=0.0).to(tl.float32)
    embedded = (normed * cos).to(dtype).to(tl.float32) + (normed_p * sin).to(dtype).to(tl.float32)
    y = tl.where(rotated[None, :], embedded, normed)
    tl.store(OUT + rows[:, None] * D + cols[None, :], y.to(dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(G, stride_g, U, stride_u, OUT, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = OUT.dtype.element_ty
    silu = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)).to(dtype).to(tl.float32)
    tl.store(OUT + row * N + cols, (silu * u).to(dtype), mask=mask)


@triton.jit
def _silu_qkv_kernel(X, stride_x, Q, K, V, KD, VD, BLOCK: tl.constexpr):
    """Row of X [T, 2 KD + VD] -> SiLU in the model dtype, written to Q [T, KD], K [T, KD], V [T, VD]."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    width = 2 * KD + VD
    x = tl.load(X + row * stride_x + cols, mask=cols < width, other=0.0).to(tl.float32)
    y = tl.math.div_rn(x, 1.0 + libdevice.exp(-x)).to(Q.dtype.element_ty)
    tl.store(Q + row * KD + cols, y, mask=cols < KD)
    tl.store(K + row * KD + (cols - KD), y, mask=(cols >= KD) & (cols < 2 * KD))
    tl.store(V + row * VD + (cols - 2 * KD), y, mask=(cols >= 2 * KD) & (cols < width))


@triton.jit
def _sigmoid_gate_kernel(X, stride_xt, stride_xh, G, stride_gt, stride_gh, OUT, n_rows, H, D,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, cols, mask, t, h = _row_tile(n_rows, H, D, BLOCK_R, BLOCK_D)
    x = _load_f32(X, stride_xt, stride_xh, t, h, cols, mask)
    g = _load_f32(G, stride_gt, stride_gh, t, h, cols, mask)
    dtype = OUT.dtype.element_ty
    sigmoid = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-g)).to(dtype).to(tl.float32)
    tl.store(OUT + rows[:, None] * D + cols[None, :], (x * sigmoid).to(dtype), mask=mask)


@triton.jit
def _gdn_gates_kernel(A, stride_a, B, stride_b, A_LOG, DT_BIAS, G_OUT, BETA_OUT, T, H,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """g = -exp(A_log) * softplus(a + dt_bias) in fp32; beta = sigmoid(b) in b's dtype."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    mask = (rows < T)[:, None] & (heads < H)[None, :]
    a = tl.load(A + rows[:, None] * stride_a + heads[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + rows[:, None] * stride_b + heads[None, :], mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(A_LOG + heads, mask=heads < H, other=0.0).to(tl.float32)
    dt_bias = tl.load(DT_BIAS + heads, mask=heads < H, other=0.0).to(tl.float32)
    x = a + dt_bias[None, :]
    softplus = tl.where(x > 20.0, x, libdevice.log1p(libdevice.exp(x)))  # torch's threshold 20, beta 1
    g = -libdevice.exp(a_log)[None, :] * softplus
    beta = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-b))
    offsets = rows[:, None] * H + heads[None, :]
    tl.store(G_OUT + offsets, g, mask=mask)
    tl.store(BETA_OUT + offsets, beta.to(BETA_OUT.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------ launchers


def _row_blocks(d: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for rows of d elements: ~2-8k elements per program."""
    block_d = triton.next_power_of_2(d)
    block_r = max(1, 2048 // block_d)
    return block_r, block_d, 8 if block_r * block_d >= 4096 else 4


def _heads_view(x: Tensor) -> tuple[int, int, int, int]:
    """x [T, D] or [T, H, D] with a contiguous last dim -> (T, H, stride_t, stride_h)."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


MIN_ATEN_ORDER_ROWS = 16  # fewer rows: ATen widens its warps along the row, another order (Reduce.cuh)


@functools.cache
def _mean_factor(rows: int, d: int) -> float:
    """ATen's factor of a mean over [rows, d]: float(rows) / float(rows * d), in fp32."""
    return (torch.tensor(float(rows), dtype=torch.float32) / torch.tensor(float(rows * d), dtype=torch.float32)).item()


ROW_ORDERS = tuple(dict(VECTORIZED=v, HALVING_LANES=h) for v in (True, False) for h in (True, False))


def _mean_squares_in_order(x: Tensor, order: dict) -> Tensor:
    """x [rows, D] contiguous (D a multiple of 128) -> mean(x^2) per row [rows] fp32, summed in ``order``."""
    rows, d = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    _mean_squares_kernel[(triton.cdiv(rows, 4),)](x, d, 0, out, rows, 1, _mean_factor(rows, d), J=d // 128, BLOCK_R=4,
                                                 num_warps=4, **order, **_LAUNCH)
    return out


@functools.cache
def row_order(d: int, device: torch.device) -> dict | None:
    """How ATen's mean sums rows of width ``d`` on this device (one of ``ROW_ORDERS``), found by comparing each
    candidate bit for bit with ``torch.mean`` on 256 random fp32 rows; None where the kernels' orders do not apply
    or no single one matches (the norms then take ATen's mean). Runs once per width and device, at the first norm
    (never inside a capture: a graph's warm-up run comes first)."""
    if d % 128 or -(-d // 32) >= 256:  # a tail, or ATen splits a row across warps
        return None
    x = torch.randn((256, d), generator=torch.Generator(device=device).manual_seed(d), device=device) * 3
    want = x.pow(2).mean(-1)  # the plain code's reduction
    matches = [order for order in ROW_ORDERS if torch.equal(_mean_squares_in_order(x, order), want)]
    return matches[0] if len(matches) == 1 else None


def _norm_order(x: Tensor, residual: Tensor | None = None) -> tuple[dict, Tensor]:
    """(the norm kernels' order constexprs for x's rows, ATen's mean of the squares per row [T * H] fp32 when the
    kernels cannot sum in its order, else x: a pointer the kernel never reads)."""
    T, H, stride_t, stride_h = _heads_view(x)
    D = x.shape[-1]
    order = row_order(D, x.device) if T * H >= MIN_ATEN_ORDER_ROWS else None
    if order is not None:
        return dict(IN_KERNEL_SUM=True, **order), x
    squares = torch.empty((T * H, D), dtype=torch.float32, device=x.device)
    block_r, block_d, warps = _row_blocks(D)
    _squares_kernel[(triton.cdiv(T * H, block_r),)](
        x, stride_t, stride_h, residual if residual is not None else x,
        residual.stride(0) if residual is not None else 0, squares, T * H, H, D, HAS_RESIDUAL=residual is not None,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps, **_LAUNCH)
    return dict(IN_KERNEL_SUM=False, VECTORIZED=False, HALVING_LANES=False), squares.mean(-1)  # ATen's reduction


def _norm_args(x: Tensor, residual: Tensor | None = None) -> dict:
    """The launch arguments every norm kernel shares: grid, mean source, factor, order and tiles."""
    T, H, _, _ = _heads_view(x)
    D = x.shape[-1]
    order, mean_squares = _norm_order(x, residual)
    block_r, block_d, warps = _row_blocks(D)
    return dict(grid=(triton.cdiv(T * H, block_r),), mean_squares=mean_squares, factor=_mean_factor(T * H, D),
                meta=dict(J=D // 128, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps, **order, **_LAUNCH))


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """x [T, D] or [T, H, D] -> (RMSNorm(x) contiguous, None); with ``residual`` [T, D] (x's dtype or fp32): (the
    norm of residual + x in x's dtype, residual + x in the residual's)."""
    T, H, stride_t, stride_h = _heads_view(x)
    D = x.shape[-1]
    a = _norm_args(x, residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=residual.dtype, device=x.device) if residual is not None else None
    _rms_norm_kernel[a["grid"]](
        x, stride_t, stride_h, residual if residual is not None else x,
        residual.stride(0) if residual is not None else 0, new_residual if residual is not None else out,
        a["mean_squares"], weight, out, T * H, H, D, a["factor"], eps, HAS_RESIDUAL=residual is not None, **a["meta"])
    return out, new_residual


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x, gate [T, H, D] (or [T, D]) -> [T, H, D]."""
    T, H, sxt, sxh = _heads_view(x)
    _, _, sgt, sgh = _heads_view(gate)
    a = _norm_args(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _gated_rms_norm_kernel[a["grid"]](
        x, sxt, sxh, gate, sgt, sgh, a["mean_squares"], weight, out, T * H, H, x.shape[-1], a["factor"], eps,
        **a["meta"])
    return out


def norm_rope(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D], cos/sin [T, R] -> [T, H, D]."""
    T, H, sxt, sxh = _heads_view(x)
    a = _norm_args(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _qk_norm_rope_kernel[a["grid"]](
        x, sxt, sxh, a["mean_squares"], weight, cos, sin, cos.stride(0), out, T * H, H, x.shape[-1], cos.shape[-1],
        a["factor"], eps, **a["meta"])
    return out


_ELEMENTWISE_BLOCK = 2048


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """gate, up [T, N] (row-strided views allowed) -> [T, N]."""
    T, N = gate.shape
    out = torch.empty((T, N), dtype=gate.dtype, device=gate.device)
    _silu_mul_kernel[(T, triton.cdiv(N, _ELEMENTWISE_BLOCK))](
        gate, gate.stride(0), up, up.stride(0), out, N, BLOCK=_ELEMENTWISE_BLOCK, num_warps=8, **_LAUNCH)
    return out


def silu_qkv(mixed: Tensor, key_dim: int, value_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """mixed [T, 2 * key_dim + value_dim] (row-strided allowed) -> SiLU'd contiguous q, k [T, key_dim] and
    v [T, value_dim]."""
    T, width = mixed.shape
    q, k = (torch.empty((T, key_dim), dtype=mixed.dtype, device=mixed.device) for _ in range(2))
    v = torch.empty((T, value_dim), dtype=mixed.dtype, device=mixed.device)
    _silu_qkv_kernel[(T, triton.cdiv(width, _ELEMENTWISE_BLOCK))](
        mixed, mixed.stride(0), q, k, v, key_dim, value_dim, BLOCK=_ELEMENTWISE_BLOCK, num_warps=8, **_LAUNCH)
    return q, k, v


def sigmoid_gate(x: Tensor, gate: Tensor) -> Tensor:
    """x, gate [T, H, D] (or [T, D]; the gate half of q|gate in place) -> [T, H, D]."""
    T, H, sxt, sxh = _heads_view(x)
    _, _, sgt, sgh = _heads_view(gate)
    D = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_r, block_d, warps = _row_blocks(D)
    _sigmoid_gate_kernel[(triton.cdiv(T * H, block_r),)](
        x, sxt, sxh, gate, sgt, sgh, out, T * H, H, D, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps, **_LAUNCH)
    return out


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """a, b [T, H] (row-strided views allowed) -> (g [T, H] fp32, beta [T, H] in b.dtype)."""
    T, H = a.shape
    g = torch.empty((T, H), dtype=torch.float32, device=a.device)
    beta = torch.empty((T, H), dtype=b.dtype, device=b.device)
    block_h = triton.next_power_of_2(H)
    block_t = max(1, 2048 // block_h)
    _gdn_gates_kernel[(triton.cdiv(T, block_t),)](
        a, a.stride(0), b, b.stride(0), A_log, dt_bias, g, beta, T, H, BLOCK_T=block_t, BLOCK_H=block_h,
        num_warps=4, **_LAUNCH)
    return g, beta

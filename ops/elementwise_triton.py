"""Triton kernels of the elementwise group (CUDA only; imported lazily by ``elementwise.py``'s CUDA kernels).

Each kernel does in one pass what the plain code (``<op>_reference`` in ``elementwise.py``) does in several
ATen kernels, and rounds where the plain code rounds:

- every intermediate the plain code stores in the model dtype is rounded to it here too (``.to(dtype)``);
- ``exp``/``log1p``/``rsqrt`` come from libdevice, the CUDA math library ATen's kernels call, and divisions are
  IEEE round-to-nearest (``div_rn``), as nvcc compiles ATen's ``/``;
- FMA contraction is off (``enable_fp_fusion=False``): the plain code rounds every product on its own.

- the norms take the mean of the squares from ATen (``torch.mean`` over an fp32 ``[rows, D]`` tensor of squares a
  Triton kernel writes), which sums in the plain code's order: a sum in the kernel's own order moved one bf16
  output in ~1e5 by a unit, and that alone took mid-shape parity against stock from 0.0095 to 0.020 on these
  random-weight models (recipes/results/h200-2026-11-29-s5). A norm is therefore three kernels (squares, mean,
  finish) instead of the plain code's ten.

So every kernel here is expected to equal the plain code bit for bit; tests/test_op_elementwise.py (``-m gpu``)
checks that on the forward's own layouts at the 27B shape.

Inputs may be row-strided views (the column slices of a stacked projection, the query half of ``q|gate``): the
kernels read them in place instead of copying them first. Layout arguments: ``[T, H, D]`` tensors are addressed
as ``t * stride_t + h * stride_h + d`` (last dimension contiguous); outputs are contiguous.
"""

from __future__ import annotations

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
def _squares_kernel(X, stride_xt, stride_xh, RES, stride_rt, SQUARES, NEW_RES, n_rows, H, D,
                    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """SQUARES [n_rows, D] fp32 = x^2, x = (residual + x rounded to the model dtype, stored to NEW_RES) or x."""
    rows, cols, mask, t, h = _row_tile(n_rows, H, D, BLOCK_R, BLOCK_D)
    x = _load_f32(X, stride_xt, stride_xh, t, h, cols, mask)
    offsets = rows[:, None] * D + cols[None, :]
    if HAS_RESIDUAL:  # new_residual = residual + x, rounded to the model dtype (the decoder layer's add)
        x = (_load_f32(RES, stride_rt, 0, t, h, cols, mask) + x).to(NEW_RES.dtype.element_ty)
        tl.store(NEW_RES + offsets, x, mask=mask)
    xf = x.to(tl.float32)
    tl.store(SQUARES + offsets, xf * xf, mask=mask)


@triton.jit
def _inv_rms(MEAN_SQUARES, rows, n_rows, eps):
    """[R, 1]: 1 / sqrt(mean(x^2) + eps) of each row, from ATen's mean."""
    return libdevice.rsqrt(tl.load(MEAN_SQUARES + rows, mask=rows < n_rows, other=1.0) + eps)[:, None]


@triton.jit
def _rms_norm_kernel(X, stride_xt, stride_xh, MEAN_SQUARES, W, OUT, n_rows, H, D, eps,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, cols, mask, t, h = _row_tile(n_rows, H, D, BLOCK_R, BLOCK_D)
    x = _load_f32(X, stride_xt, stride_xh, t, h, cols, mask)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = (x * _inv_rms(MEAN_SQUARES, rows, n_rows, eps)) * (1.0 + w)[None, :]
    tl.store(OUT + rows[:, None] * D + cols[None, :], y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(X, stride_xt, stride_xh, G, stride_gt, stride_gh, MEAN_SQUARES, W, OUT, n_rows, H, D, eps,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, cols, mask, t, h = _row_tile(n_rows, H, D, BLOCK_R, BLOCK_D)
    x = _load_f32(X, stride_xt, stride_xh, t, h, cols, mask)
    g = _load_f32(G, stride_gt, stride_gh, t, h, cols, mask)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    dtype = OUT.dtype.element_ty
    normed = (x * _inv_rms(MEAN_SQUARES, rows, n_rows, eps)).to(dtype).to(tl.float32)
    weighted = (w[None, :] * normed).to(dtype).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
    tl.store(OUT + rows[:, None] * D + cols[None, :], (weighted * silu).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(X, stride_xt, stride_xh, MEAN_SQUARES, W, COS, SIN, stride_ct, OUT, n_rows, H, D, R, eps,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per head row: n = RMSNorm(x) in the model dtype; the first R dims get n*cos + rotate_half(n)*sin."""
    rows, cols, mask, t, h = _row_tile(n_rows, H, D, BLOCK_R, BLOCK_D)
    x = _load_f32(X, stride_xt, stride_xh, t, h, cols, mask)
    inv = _inv_rms(MEAN_SQUARES, rows, n_rows, eps)
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


def _mean_squares(x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """x [T, D] or [T, H, D] -> (mean of the squares per row [T * H] fp32, residual + x or None)."""
    T, H, stride_t, stride_h = _heads_view(x)
    D = x.shape[-1]
    squares = torch.empty((T * H, D), dtype=torch.float32, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    block_r, block_d, warps = _row_blocks(D)
    _squares_kernel[(triton.cdiv(T * H, block_r),)](
        x, stride_t, stride_h, residual if residual is not None else x,
        residual.stride(0) if residual is not None else 0, squares,
        new_residual if new_residual is not None else squares, T * H, H, D,
        HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps, **_LAUNCH)
    return squares.mean(-1), new_residual  # ATen's reduction: the plain code's summation order


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """x [T, D] or [T, H, D] -> (RMSNorm(x) contiguous, None); with ``residual`` [T, D]: (the norm of residual + x,
    residual + x)."""
    mean_squares, new_residual = _mean_squares(x, residual)
    source = new_residual if new_residual is not None else x
    T, H, stride_t, stride_h = _heads_view(source)
    D = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_r, block_d, warps = _row_blocks(D)
    _rms_norm_kernel[(triton.cdiv(T * H, block_r),)](
        source, stride_t, stride_h, mean_squares, weight, out, T * H, H, D, eps,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps, **_LAUNCH)
    return out, new_residual


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x, gate [T, H, D] (or [T, D]) -> [T, H, D]."""
    T, H, sxt, sxh = _heads_view(x)
    _, _, sgt, sgh = _heads_view(gate)
    D = x.shape[-1]
    mean_squares, _ = _mean_squares(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_r, block_d, warps = _row_blocks(D)
    _gated_rms_norm_kernel[(triton.cdiv(T * H, block_r),)](
        x, sxt, sxh, gate, sgt, sgh, mean_squares, weight, out, T * H, H, D, eps,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps, **_LAUNCH)
    return out


def norm_rope(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D], cos/sin [T, R] -> [T, H, D]."""
    T, H, sxt, sxh = _heads_view(x)
    D, R = x.shape[-1], cos.shape[-1]
    mean_squares, _ = _mean_squares(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_r, block_d, warps = _row_blocks(D)
    _qk_norm_rope_kernel[(triton.cdiv(T * H, block_r),)](
        x, sxt, sxh, mean_squares, weight, cos, sin, cos.stride(0), out, T * H, H, D, R, eps,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps, **_LAUNCH)
    return out


_ELEMENTWISE_BLOCK = 2048


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """gate, up [T, N] (row-strided views allowed) -> [T, N]."""
    T, N = gate.shape
    out = torch.empty((T, N), dtype=gate.dtype, device=gate.device)
    _silu_mul_kernel[(T, triton.cdiv(N, _ELEMENTWISE_BLOCK))](
        gate, gate.stride(0), up, up.stride(0), out, N, BLOCK=_ELEMENTWISE_BLOCK, num_warps=8, **_LAUNCH)
    return out


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

"""Short-sequence Gated DeltaNet prefill in two Triton launches: the chunk-parallel WY prep, then the state walk
(CUDA only; imported lazily by ``gdn_prefill_short.py``'s CUDA kernel, and by ``recipes/gdn_short_check.py``
under Triton's interpreter).

Chunks of 64 tokens, aligned to each sequence's start (as ``gdn_prefill_reference``), in four 16-row blocks.
With q, k L2-normalised (eps 1e-6), q scaled by Dk ** -0.5 and gc the inclusive cumsum of g inside the chunk:

(A) ``_gdn_wy_prep_kernel``, one program per (chunk, value head), every chunk of every sequence at once:
    A = strict_lower(beta_i (k_i . k_j) exp(gc_i - gc_j)), T = (I + A)^-1 blocked: the four 16 x 16 diagonal
    blocks by forward substitution (in one loop), the off-diagonal blocks by
    T_ij = -T_ii sum_{j <= m < i} A_im T_mj; then w = T (beta exp(gc) k) and u = T (beta v), written in fp32 at
    their tokens' rows ([T, Hv, Dk] and [T, Hv, Dv]; fp32, not bf16, because they meet the fp32 state in
    v' = u - w S, and a bf16 w would add the rounding the chunked op has). The program finds its (sequence, chunk) from
    ``cu_seqlens`` on the device; the grid, cdiv(T, 64) + N chunks, bounds the real count, and the extra
    programs return at once.
(B) ``_gdn_wy_state_kernel``, one program per (Dv block, value head, sequence), the fp32 [Dk, BV] state on chip:
    per chunk, with S the state entering it,
        v' = u - w S;   o = (exp(gc) q) S + lower(q_i . k_j exp(gc_i - gc_j)) v';
        S <- exp(gc_last) S + (exp(gc_last - gc) k)^T v'
    three 64-row products on the serial chain.

The Gram matrices k k^T and q k^T run on the raw inputs (``NATIVE``: bf16/fp16 tiles, fp32 accumulate, exact
products on tensor cores) with the norms applied afterwards as row and column scales; without ``NATIVE`` (fp32
inputs, or Triton's interpreter, which miscomputes bf16 ``tl.dot``) they are fp32 dots at ``precision``. Every
other product is a ``tl.dot`` of fp32 tiles at ``precision`` (``gdn_short_limits.PRECISIONS``), accumulating in
fp32; the state never leaves fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK = 64  # tokens per chunk (four 16-row blocks)


@triton.jit
def _gram(a, b, PREC: tl.constexpr, NATIVE: tl.constexpr):
    """a b^T for [R, D] tiles in fp32: on the raw (16-bit) tiles with ``NATIVE``, else fp32 at ``PREC``."""
    if NATIVE:
        return tl.dot(a, tl.trans(b))
    return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision=PREC)


@triton.jit
def _inverse4(A0, A1, A2, A3, BS: tl.constexpr):
    """(I + A)^-1 of four strictly lower [BS, BS] fp32 tiles at once, by forward substitution: row i of an inverse
    is e_i - sum_{j < i} A_ij T_j (rows j < i are final when row i is formed)."""
    rows = tl.arange(0, BS)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    T0, T1, T2, T3 = eye, eye, eye, eye
    for i in range(1, BS):
        pick = rows[:, None] == i
        e_i = tl.where(rows == i, 1.0, 0.0)
        T0 = tl.where(pick, (e_i - tl.sum(tl.sum(tl.where(pick, A0, 0.0), 0)[:, None] * T0, 0))[None, :], T0)
        T1 = tl.where(pick, (e_i - tl.sum(tl.sum(tl.where(pick, A1, 0.0), 0)[:, None] * T1, 0))[None, :], T1)
        T2 = tl.where(pick, (e_i - tl.sum(tl.sum(tl.where(pick, A2, 0.0), 0)[:, None] * T2, 0))[None, :], T2)
        T3 = tl.where(pick, (e_i - tl.sum(tl.sum(tl.where(pick, A3, 0.0), 0)[:, None] * T3, 0))[None, :], T3)
    return T0, T1, T2, T3


@triton.jit
def _chunk_of_program(CU, i, N, BT: tl.constexpr, BN: tl.constexpr):
    """(sequence n, chunk c of it) for the i-th chunk of the batch; n >= N when i is past the last chunk."""
    idx = tl.arange(0, BN)
    live = idx < N
    starts = tl.load(CU + idx, mask=live, other=0)
    ends = tl.load(CU + idx + 1, mask=live, other=0)
    chunks = (ends - starts + BT - 1) // BT
    n = tl.sum((tl.cumsum(chunks, 0) <= i).to(tl.int32), 0)
    return n, i - tl.sum(tl.where(idx < n, chunks, 0), 0)


@triton.jit
def _block_rows(K, G, BETA, t, eos, stride_k, col_k, h, Hv, DK: tl.constexpr):
    """One 16-row block: raw k [BS, DK], its row scale rsqrt(|k|^2 + eps), g and beta (zeros past ``eos``)."""
    live = t < eos
    k = tl.load(K + t[:, None] * stride_k + col_k + tl.arange(0, DK)[None, :], mask=live[:, None], other=0.0)
    kf = k.to(tl.float32)
    g = tl.load(G + t * Hv + h, mask=live, other=0.0).to(tl.float32)
    beta = tl.load(BETA + t * Hv + h, mask=live, other=0.0).to(tl.float32)
    return k, tl.rsqrt(tl.sum(kf * kf, 1) + 1e-6), g, beta


@triton.jit
def _a_block(ki, kj, ri, rj, gi, gj, bi, PREC: tl.constexpr, NATIVE: tl.constexpr):
    """Off-diagonal block of A: beta_i (k_i . k_j) r_i r_j exp(gc_i - gc_j) (every entry below the diagonal)."""
    return _gram(ki, kj, PREC, NATIVE) * (bi * ri)[:, None] * rj[None, :] * tl.exp(gi[:, None] - gj[None, :])


@triton.jit
def _merge_blocks(A10, A20, A21, A30, A31, A32, T0, T1, T2, T3, PREC: tl.constexpr):
    """The off-diagonal blocks of T = (I + A)^-1 from the diagonal ones: T_ij = -T_ii sum_{j<=m<i} A_im T_mj."""
    T10 = -tl.dot(T1, tl.dot(A10, T0, input_precision=PREC), input_precision=PREC)
    T21 = -tl.dot(T2, tl.dot(A21, T1, input_precision=PREC), input_precision=PREC)
    T32 = -tl.dot(T3, tl.dot(A32, T2, input_precision=PREC), input_precision=PREC)
    T20 = -tl.dot(T2, tl.dot(A20, T0, input_precision=PREC) + tl.dot(A21, T10, input_precision=PREC),
                  input_precision=PREC)
    T31 = -tl.dot(T3, tl.dot(A31, T1, input_precision=PREC) + tl.dot(A32, T21, input_precision=PREC),
                  input_precision=PREC)
    T30 = -tl.dot(T3, tl.dot(A30, T0, input_precision=PREC) + tl.dot(A31, T10, input_precision=PREC)
                  + tl.dot(A32, T20, input_precision=PREC), input_precision=PREC)
    return T10, T20, T21, T30, T31, T32


@triton.jit
def _apply_store(P, stride, col0, X0, X1, X2, X3, T0, T1, T2, T3, T10, T20, T21, T30, T31, T32, t0, eos,
                 D: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr):
    """Stores Y = T X, block row by block row, at rows t0 + r of P ([T, ., D] fp32, row stride ``stride``)."""
    rows, cols = tl.arange(0, BS), col0 + tl.arange(0, D)[None, :]
    Y0 = tl.dot(T0, X0, input_precision=PREC)
    Y1 = tl.dot(T10, X0, input_precision=PREC) + tl.dot(T1, X1, input_precision=PREC)
    Y2 = (tl.dot(T20, X0, input_precision=PREC) + tl.dot(T21, X1, input_precision=PREC)
          + tl.dot(T2, X2, input_precision=PREC))
    Y3 = (tl.dot(T30, X0, input_precision=PREC) + tl.dot(T31, X1, input_precision=PREC)
          + tl.dot(T32, X2, input_precision=PREC) + tl.dot(T3, X3, input_precision=PREC))
    t = t0 + rows
    tl.store(P + t[:, None] * stride + cols, Y0, mask=(t < eos)[:, None])
    t = t + BS
    tl.store(P + t[:, None] * stride + cols, Y1, mask=(t < eos)[:, None])
    t = t + BS
    tl.store(P + t[:, None] * stride + cols, Y2, mask=(t < eos)[:, None])
    t = t + BS
    tl.store(P + t[:, None] * stride + cols, Y3, mask=(t < eos)[:, None])


@triton.jit
def _a_diag(k, r, gc, beta, PREC: tl.constexpr, NATIVE: tl.constexpr, BS: tl.constexpr):
    """Diagonal block of A: strictly lower beta_i (k_i . k_j) r_i r_j exp(gc_i - gc_j)."""
    rows = tl.arange(0, BS)
    strict = rows[:, None] > rows[None, :]
    decay = tl.exp(tl.where(strict, gc[:, None] - gc[None, :], 0.0))
    return tl.where(strict, _gram(k, k, PREC, NATIVE) * (beta * r)[:, None] * r[None, :] * decay, 0.0)


@triton.jit
def _gdn_wy_prep_kernel(K, V, G, BETA, CU, W, U, N, Hk, Hv, GROUP, DK: tl.constexpr, DV: tl.constexpr,
                        BN: tl.constexpr, PREC: tl.constexpr, NATIVE: tl.constexpr):
    BS: tl.constexpr = 16
    n, c = _chunk_of_program(CU, tl.program_id(0), N, 4 * BS, BN)
    if n >= N:
        return
    h = tl.program_id(1)
    sk, ck = Hk * DK, (h // GROUP) * DK
    eos = tl.load(CU + n + 1).to(tl.int64)
    t0 = tl.load(CU + n).to(tl.int64) + c * (4 * BS)
    rows = tl.arange(0, BS)
    k0, r0, g0, b0 = _block_rows(K, G, BETA, t0 + rows, eos, sk, ck, h, Hv, DK)
    k1, r1, g1, b1 = _block_rows(K, G, BETA, t0 + BS + rows, eos, sk, ck, h, Hv, DK)
    k2, r2, g2, b2 = _block_rows(K, G, BETA, t0 + 2 * BS + rows, eos, sk, ck, h, Hv, DK)
    k3, r3, g3, b3 = _block_rows(K, G, BETA, t0 + 3 * BS + rows, eos, sk, ck, h, Hv, DK)
    c0 = tl.cumsum(g0, 0)
    c1 = tl.cumsum(g1, 0) + tl.sum(g0, 0)
    c2 = tl.cumsum(g2, 0) + tl.sum(g0, 0) + tl.sum(g1, 0)
    c3 = tl.cumsum(g3, 0) + tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0)
    T0, T1, T2, T3 = _inverse4(_a_diag(k0, r0, c0, b0, PREC, NATIVE, BS), _a_diag(k1, r1, c1, b1, PREC, NATIVE, BS),
                               _a_diag(k2, r2, c2, b2, PREC, NATIVE, BS), _a_diag(k3, r3, c3, b3, PREC, NATIVE, BS),
                               BS)
    T10, T20, T21, T30, T31, T32 = _merge_blocks(
        _a_block(k1, k0, r1, r0, c1, c0, b1, PREC, NATIVE), _a_block(k2, k0, r2, r0, c2, c0, b2, PREC, NATIVE),
        _a_block(k2, k1, r2, r1, c2, c1, b2, PREC, NATIVE), _a_block(k3, k0, r3, r0, c3, c0, b3, PREC, NATIVE),
        _a_block(k3, k1, r3, r1, c3, c1, b3, PREC, NATIVE), _a_block(k3, k2, r3, r2, c3, c2, b3, PREC, NATIVE),
        T0, T1, T2, T3, PREC)
    # w = T (beta exp(gc) k), k normalised: the row scale folds into the right-hand side
    _apply_store(W, Hv * DK, h * DK, k0.to(tl.float32) * (b0 * tl.exp(c0) * r0)[:, None],
                 k1.to(tl.float32) * (b1 * tl.exp(c1) * r1)[:, None], k2.to(tl.float32) * (b2 * tl.exp(c2) * r2)[:, None],
                 k3.to(tl.float32) * (b3 * tl.exp(c3) * r3)[:, None],
                 T0, T1, T2, T3, T10, T20, T21, T30, T31, T32, t0, eos, DK, BS, PREC)
    dv, sv = tl.arange(0, DV), Hv * DV
    v0 = _load_v(V, t0 + rows, eos, sv, h * DV, dv) * b0[:, None]
    v1 = _load_v(V, t0 + BS + rows, eos, sv, h * DV, dv) * b1[:, None]
    v2 = _load_v(V, t0 + 2 * BS + rows, eos, sv, h * DV, dv) * b2[:, None]
    v3 = _load_v(V, t0 + 3 * BS + rows, eos, sv, h * DV, dv) * b3[:, None]
    _apply_store(U, sv, h * DV, v0, v1, v2, v3, T0, T1, T2, T3, T10, T20, T21, T30, T31, T32, t0, eos, DV, BS, PREC)


@triton.jit
def _load_v(P, t, eos, stride, col0, cols):
    """[R, D] fp32 rows ``t`` of a [T, ., D] tensor at ``t * stride + col0 + cols`` (zeros from ``eos`` on)."""
    return tl.load(P + t[:, None] * stride + col0 + cols[None, :], mask=(t < eos)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _gdn_wy_state_kernel(Q, K, G, W, U, CU, H0, OUT, HT, scale, Hk, Hv, GROUP, DK: tl.constexpr,
                         DV: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                         PREC: tl.constexpr, NATIVE: tl.constexpr):
    BT: tl.constexpr = 64
    i_v, h, n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(CU + n).to(tl.int64)
    eos = tl.load(CU + n + 1).to(tl.int64)
    rows, dk, dv = tl.arange(0, BT), tl.arange(0, DK), i_v * BV + tl.arange(0, BV)
    causal = rows[:, None] >= rows[None, :]
    state_offsets = ((n * Hv + h) * DK + dk[:, None]).to(tl.int64) * DV + dv[None, :]
    if HAS_H0:
        S = tl.load(H0 + state_offsets).to(tl.float32)
    else:
        S = tl.zeros([DK, BV], dtype=tl.float32)
    ck = (h // GROUP) * DK
    for c in range(0, tl.cdiv(eos - bos, BT)):
        t = bos + c * BT + rows
        live = t < eos
        q = tl.load(Q + t[:, None] * (Hk * DK) + ck + dk[None, :], mask=live[:, None], other=0.0)
        k = tl.load(K + t[:, None] * (Hk * DK) + ck + dk[None, :], mask=live[:, None], other=0.0)
        w = _load_v(W, t, eos, Hv * DK, h * DK, dk)
        u = _load_v(U, t, eos, Hv * DV, h * DV, dv)
        g = tl.load(G + t * Hv + h, mask=live, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)
        g_last = tl.sum(g, 0)
        qf, kf = q.to(tl.float32), k.to(tl.float32)
        rq = tl.rsqrt(tl.sum(qf * qf, 1) + 1e-6) * scale
        rk = tl.rsqrt(tl.sum(kf * kf, 1) + 1e-6)
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0))
        attn = tl.where(causal, _gram(q, k, PREC, NATIVE) * rq[:, None] * rk[None, :] * decay, 0.0)
        v_new = u - tl.dot(w, S, input_precision=PREC)
        o = tl.dot(qf * (rq * tl.exp(gc))[:, None], S, input_precision=PREC)
        o += tl.dot(attn, v_new, input_precision=PREC)
        k_out = kf * (rk * tl.exp(g_last - gc))[:, None]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(k_out), v_new, input_precision=PREC)
        tl.store(OUT + t[:, None] * (Hv * DV) + h * DV + dv[None, :], o.to(OUT.dtype.element_ty), mask=live[:, None])
    if STORE_FINAL:
        tl.store(HT + state_offsets, S)


@triton.jit
def _unit_lower_inverse_kernel(A, T, PREC: tl.constexpr):
    """T = (I + A)^-1 for one strictly lower [64, 64] fp32 A (row-major), by the prep kernel's blocked solve."""
    BS: tl.constexpr = 16
    r, c = tl.arange(0, BS)[:, None], tl.arange(0, BS)[None, :]
    A00, A11 = tl.load(A + r * 64 + c), tl.load(A + (BS + r) * 64 + BS + c)
    A22, A33 = tl.load(A + (2 * BS + r) * 64 + 2 * BS + c), tl.load(A + (3 * BS + r) * 64 + 3 * BS + c)
    A10, A20 = tl.load(A + (BS + r) * 64 + c), tl.load(A + (2 * BS + r) * 64 + c)
    A21, A30 = tl.load(A + (2 * BS + r) * 64 + BS + c), tl.load(A + (3 * BS + r) * 64 + c)
    A31, A32 = tl.load(A + (3 * BS + r) * 64 + BS + c), tl.load(A + (3 * BS + r) * 64 + 2 * BS + c)
    T0, T1, T2, T3 = _inverse4(A00, A11, A22, A33, BS)
    T10, T20, T21, T30, T31, T32 = _merge_blocks(A10, A20, A21, A30, A31, A32, T0, T1, T2, T3, PREC)
    _store_block(T, 0, 0, T0, BS)
    _store_block(T, 1, 1, T1, BS)
    _store_block(T, 2, 2, T2, BS)
    _store_block(T, 3, 3, T3, BS)
    _store_block(T, 1, 0, T10, BS)
    _store_block(T, 2, 0, T20, BS)
    _store_block(T, 2, 1, T21, BS)
    _store_block(T, 3, 0, T30, BS)
    _store_block(T, 3, 1, T31, BS)
    _store_block(T, 3, 2, T32, BS)


@triton.jit
def _store_block(T, i: tl.constexpr, j: tl.constexpr, B, BS: tl.constexpr):
    r, c = tl.arange(0, BS)[:, None], tl.arange(0, BS)[None, :]
    tl.store(T + (i * BS + r) * 64 + j * BS + c, B)


def invert_unit_lower(a: Tensor, precision: str = "ieee") -> Tensor:
    """(I + a)^-1 for a strictly lower [64, 64] fp32 ``a``, by the prep kernel's blocked solve (a check of it:
    the blocks above the diagonal of the result are zeros from ``torch.zeros``)."""
    if a.shape != (CHUNK, CHUNK):
        raise ValueError(f"invert_unit_lower: a must be [{CHUNK}, {CHUNK}], got {tuple(a.shape)}")
    a = a.float().tril(-1).contiguous()
    out = torch.zeros_like(a)
    _unit_lower_inverse_kernel[(1,)](a, out, PREC=precision)
    return out


def gdn_wy_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                   initial_state: Tensor | None, output_final_state: bool = True, *, block_v: int = 32,
                   num_warps: int = 8, precision: str = "tf32x3", prep_warps: int = 8, num_stages: int = 1,
                   native_gram: bool | None = None) -> tuple[Tensor, Tensor]:
    """Two launches. q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv] (log decay); beta [T, Hv]; cu_seqlens [N+1] on
    the device; initial_state [N, Hv, Dk, Dv] fp32 or None (zeros). Returns (o [T, Hv, Dv] in q.dtype, final
    state [N, Hv, Dk, Dv] fp32, or [0, Hv, Dk, Dv] without ``output_final_state``). ``native_gram`` None: on for
    16-bit inputs on CUDA. ``num_stages``: Triton's software pipelining of the state walk's chunk loop (more
    stages prefetch the next chunk, at the cost of registers). Grids: prep (cdiv(T, 64) + N, Hv), state walk
    (Dv / block_v, Hv, N)."""
    from hf_openjev.ops.gdn_short_limits import check_short_shapes, dot_precision

    check_short_shapes(q, v, block_v, CHUNK, precision, num_warps)
    precision = dot_precision(precision, q.is_cuda)
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    N = cu_seqlens.shape[0] - 1
    if native_gram is None:
        native_gram = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
    q, k, v, g, beta, cu_seqlens = (x.contiguous() for x in (q, k, v, g.float(), beta, cu_seqlens))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    final = q.new_empty((N if output_final_state else 0, Hv, Dk, Dv), dtype=torch.float32)
    if T == 0 or N == 0:  # no token: nothing to launch (shapes only, so graph-safe)
        if output_final_state:
            final.copy_(h0 if h0 is not None else torch.zeros_like(final))
        return o, final
    w = q.new_empty((T, Hv, Dk), dtype=torch.float32)
    u = q.new_empty((T, Hv, Dv), dtype=torch.float32)
    _gdn_wy_prep_kernel[(triton.cdiv(T, CHUNK) + N, Hv)](
        k, v, g, beta, cu_seqlens, w, u, N, Hk, Hv, Hv // Hk, DK=Dk, DV=Dv, BN=max(16, triton.next_power_of_2(N)),
        PREC=precision, NATIVE=native_gram, num_warps=prep_warps)
    _gdn_wy_state_kernel[(Dv // block_v, Hv, N)](
        q, k, g, w, u, cu_seqlens, o if h0 is None else h0, o, final if output_final_state else o,
        Dk ** -0.5, Hk, Hv, Hv // Hk, DK=Dk, DV=Dv, BV=block_v, HAS_H0=h0 is not None,
        STORE_FINAL=output_final_state, PREC=precision, NATIVE=native_gram, num_warps=num_warps,
        num_stages=num_stages,
    )  # (o stands in for the pointers the constexpr flags leave unread)
    return o, final

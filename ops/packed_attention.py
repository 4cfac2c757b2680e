"""Packed causal attention and shared-prefix attention: ``torch.ops.hf_openjev.{packed,prefix}_attention``.

GQA everywhere: query head h reads kv head h // (H // Hkv). Softmax in fp32, outputs in q.dtype.

packed_attention: sequence i's queries are the LAST len_q(i) positions of its len_k(i) keys (bottom-right
causal: query t of len_q sees keys 0 .. t + len_k - len_q).
prefix_attention: sequence i's queries see ALL keys of its prefix block, rows prefix_starts[i] ..
prefix_starts[i] + prefix_lengths[i] of prefix_k / prefix_v (read in place: sequences that share a prefix point
at the same rows, never copied per sequence; length 0 = no prefix), and their own keys causally.

CUDA, bf16/fp16: flash attention 2 inside torch. packed_attention calls
``torch.nn.attention.varlen.varlen_attn(window_size=(-1, 0), enable_gqa=True)`` when this torch has that API
(2.13 does), else ``aten._flash_attention_forward(is_causal=True)`` (what varlen_attn wraps; FA2 aligns the
causal mask bottom-right and handles GQA natively). prefix_attention makes two FA2 calls, own keys (causal,
cu_seqlens) and prefix keys (non-causal; ``prefix_starts`` and ``prefix_lengths`` are FA2's own cu_seqlens_k and
seqused_k: it reads sequence i's keys from cu_seqlens_k[i], seqused_k[i] of them, so the caller's host-built
metadata goes in as it is, without index arithmetic on the device), and merges them by log-sum-exp in one Triton
kernel (``lse_merge_triton.py``, bit for bit ``merge_by_lse_reference``). No host sync, no data-dependent shapes.
causal_attention: one sequence, causal (``packed_attention`` with a single sequence). CUDA, bf16/fp16: cuDNN's
fused attention through SDPA (dense ``[1, H, T, D]`` views, ``enable_gqa``), FA2 where cuDNN does not take the
inputs. At the 27B attention shape cuDNN beats FA2 on long single sequences and loses on short ones
(recipes/RESULTS.md): the caller uses it for long single sequences only (``fast_options.DENSE_ATTENTION_TOKENS``).
CUDA, fp32 (FA2 has no fp32): ``*_masked``: one SDPA over all packed tokens with a device-built boolean mask
(O(Tq * Tk) memory; for checks, not speed).
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

# ---------------------------------------------------------------------------------------------- references


def _attend(q, k, v, allowed, scale):
    """q [Lq, H, D]; k, v [Lk, Hkv, D]; allowed [Lq, Lk] bool -> [Lq, H, D] fp32 (explicit softmax)."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(group, 1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def packed_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=0, max_seqlen_k=0, scale=1.0):
    """Loop over sequences. q [Tq, H, D]; k, v [Tk, Hkv, D]; cu_seqlens_* [N+1] -> o [Tq, H, D] in q.dtype."""
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if lq > lk:
            raise ValueError(f"packed_attention: sequence {i} has {lq} queries but only {lk} keys")
        t = torch.arange(lq, device=q.device)[:, None]
        allowed = torch.arange(lk, device=q.device)[None, :] <= t + (lk - lq)
        o[cq[i] : cq[i + 1]] = _attend(q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]], allowed, scale)
    return o.to(q.dtype)


def prefix_attention_reference(
    q, k, v, cu_seqlens, prefix_k, prefix_v, prefix_starts, prefix_lengths, scale=1.0, max_seqlen_q=0,
    max_seqlen_prefix=0
):
    """Loop over sequences; keys of sequence i = [its prefix block ; its own keys]. -> o [Tq, H, D] q.dtype."""
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu, starts, lengths = cu_seqlens.tolist(), prefix_starts.tolist(), prefix_lengths.tolist()
    for i in range(len(cu) - 1):
        s, e, ps, pe = cu[i], cu[i + 1], starts[i], starts[i] + lengths[i]
        t = torch.arange(e - s, device=q.device)
        own = t[None, :] <= t[:, None]
        allowed = torch.cat([own.new_ones(e - s, pe - ps), own], 1)
        keys, values = torch.cat([prefix_k[ps:pe], k[s:e]]), torch.cat([prefix_v[ps:pe], v[s:e]])
        o[s:e] = _attend(q[s:e], keys, values, allowed, scale)
    return o.to(q.dtype)


def _check_causal(q, k, v) -> None:
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] \
            or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"causal_attention: q [T, H, D] and k, v [T, Hkv, D] with H a multiple of Hkv; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def causal_attention_reference(q, k, v, scale=1.0):
    """One sequence: q [T, H, D]; k, v [T, Hkv, D] -> o [T, H, D] in q.dtype, query t sees keys 0..t."""
    _check_causal(q, k, v)
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    return packed_attention_reference(q, k, v, cu, cu, q.shape[0], q.shape[0], scale)


# ------------------------------------------------------------------- sync-free torch (CUDA fp32, tests on CPU)


def _seq_ids(cu: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """(sequence id [n], position in sequence [n]) of packed rows 0..n-1; device ops only."""
    cu = cu.long()
    rows = torch.arange(n, device=cu.device)
    seq = torch.searchsorted(cu[1:].contiguous(), rows, right=True)
    return seq, rows - cu[seq]


def _sdpa(q, k, v, allowed, scale):
    """q [Tq, H, D]; k, v [Tk, Hkv, D]; allowed [Tq, Tk] -> [Tq, H, D] in q.dtype."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, 1).transpose(0, 1) for x in (k, v))
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=allowed, scale=scale)
    return o.transpose(0, 1).contiguous()


def packed_attention_masked(q, k, v, cu_seqlens_q, cu_seqlens_k, scale):
    seq_q, pos_q = _seq_ids(cu_seqlens_q, q.shape[0])
    seq_k, pos_k = _seq_ids(cu_seqlens_k, k.shape[0])
    shift = (cu_seqlens_k.diff() - cu_seqlens_q.diff()).long()[seq_q]  # len_k - len_q of each query's sequence
    allowed = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= (pos_q + shift)[:, None])
    return _sdpa(q, k, v, allowed, scale)


def prefix_attention_masked(q, k, v, cu_seqlens, prefix_k, prefix_v, prefix_starts, prefix_lengths, scale):
    """One SDPA over [all prefix keys ; all own keys] (one concatenation of the pools, not per sequence)."""
    seq, pos = _seq_ids(cu_seqlens, q.shape[0])
    first = prefix_starts[:-1].long()[seq, None]  # [Tq, 1] the first prefix row each query reads
    rows = torch.arange(prefix_k.shape[0], device=q.device)[None, :]  # [1, P]
    in_block = (rows >= first) & (rows < first + prefix_lengths.long()[seq, None])  # [Tq, P]
    own = (seq[None, :] == seq[:, None]) & (pos[None, :] <= pos[:, None])  # [Tq, Tq] causal within a sequence
    allowed = torch.cat([in_block, own], 1)  # [Tq, P + Tq]
    return _sdpa(q, torch.cat([prefix_k, k]), torch.cat([prefix_v, v]), allowed, scale)


# ---------------------------------------------------------------------------------------------- flash (CUDA)


def _flash(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, seqused_k=None):
    """FA2 varlen forward -> (o [Tq, H, D], lse [H, Tq] fp32; +inf on rows without keys)."""
    # max_q >= 2: FA2 swaps heads into the query axis when max_q == 1 and drops cu_seqlens_q (breaks N != Tq)
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q.int(), cu_k.int(), max(max_q, 2), max_k, 0.0, causal, False, scale=scale,
        seqused_k=None if seqused_k is None else seqused_k.int()
    )
    if out[1].shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"flash attention returned lse {tuple(out[1].shape)}, expected [H, Tq] (torch version?)")
    return out[0], out[1]


_VARLEN_ATTN_FAILED: list[str] = []  # set once varlen_attn refused a call; later calls go straight to aten


@functools.cache
def _varlen_attn_new_api() -> bool:
    """torch >= 2.13-style varlen_attn (window_size, enable_gqa keywords)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return {"enable_gqa", "window_size", "scale"} <= set(inspect.signature(varlen_attn).parameters)


def _varlen_causal(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    if _varlen_attn_new_api() and not _VARLEN_ATTN_FAILED:
        from torch.nn.attention.varlen import varlen_attn

        try:
            return varlen_attn(
                q, k, v, cu_q.int(), cu_k.int(), max_q, max_k, scale=scale, window_size=(-1, 0), enable_gqa=True
            )
        except (RuntimeError, ValueError) as exc:  # e.g. a backend without GQA: same FA2 kernel through aten
            warnings.warn(f"varlen_attn failed ({exc}); using aten._flash_attention_forward from now on")
            _VARLEN_ATTN_FAILED.append(str(exc))
    return _flash(q, k, v, cu_q, cu_k, max_q, max_k, True, scale)[0]


def merge_by_lse_reference(o_own, lse_own, o_pre, lse_pre):
    """Attention over two disjoint key sets from each set's attention and log-sum-exp (fp32 math).
    o_* [Tq, H, D]; lse_* [H, Tq] fp32, not finite where a part had no keys (FA2: +inf): that part counts zero.
    -> [Tq, H, D] in o_own.dtype."""
    lse_own, lse_pre = lse_own.t().unsqueeze(-1), lse_pre.t().unsqueeze(-1)  # [Tq, H, 1]
    empty = ~lse_pre.isfinite()
    lse_pre = lse_pre.masked_fill(empty, float("-inf"))
    o_pre = o_pre.masked_fill(empty, 0)
    top = torch.maximum(lse_own, lse_pre)
    w_own, w_pre = (lse_own - top).exp(), (lse_pre - top).exp()
    o = (w_own * o_own.float() + w_pre * o_pre.float()) / (w_own + w_pre)
    return o.to(o_own.dtype)


def merge_by_lse(o_own, lse_own, o_pre, lse_pre):
    """``merge_by_lse_reference`` in one Triton kernel on CUDA (bit for bit; ``lse_merge_triton.py``) where the
    layouts are FA2's own: contiguous outputs, [H, Tq] lse with a contiguous last dim."""
    if (o_own.is_cuda and o_own.is_contiguous() and o_pre.is_contiguous() and o_own.shape == o_pre.shape
            and o_own.dtype == o_pre.dtype and lse_own.dtype == lse_pre.dtype == torch.float32
            and lse_own.stride() == lse_pre.stride() and lse_own.stride(1) == 1):
        from hf_openjev.ops.lse_merge_triton import merge_by_lse as merge_in_triton

        return merge_in_triton(o_own, lse_own, o_pre, lse_pre)
    return merge_by_lse_reference(o_own, lse_own, o_pre, lse_pre)


def prefix_attention_flash(
    q, k, v, cu_seqlens, prefix_k, prefix_v, prefix_starts, prefix_lengths, scale, max_q, max_p, flash=_flash
):
    """Own part + prefix part, merged by log-sum-exp (fp32). ``flash`` is swappable for CPU tests."""
    o_own, lse_own = flash(q, k, v, cu_seqlens, cu_seqlens, max_q, max_q, True, scale)
    o_pre, lse_pre = flash(q, prefix_k, prefix_v, cu_seqlens, prefix_starts, max_q, max_p, False, scale,
                           seqused_k=prefix_lengths)
    return merge_by_lse(o_own, lse_own, o_pre, lse_pre)  # an empty block: FA2's lse is +inf there


# ------------------------------------------------------------------------------------------------- the ops


def _efficient_varlen_causal(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """The memory-efficient kernel's varlen causal attention (top-left causal: equal query and key lengths);
    kv heads repeated for GQA."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = torch.ops.aten._efficient_attention_forward(q[None], k[None], v[None], None, cu_q.int(), cu_k.int(), max_q,
                                                      max_k, 0.0, 1, False, scale=scale)  # 1: causal from top left
    return out[0][0]


# the kernels of a packed level's attention on CUDA, bf16/fp16 (FastPathOptions.packed_attention). No cuDNN: its
# ragged path (aten._cudnn_attention_forward with cumulative lengths) answers eagerly but invalidates a CUDA-graph
# capture (torch 2.11, H100; recipes/RESULTS.md s22), and the fast path captures by default
PACKED_KERNELS = {"flash": _varlen_causal, "efficient": _efficient_varlen_causal}


@torch.library.custom_op("hf_openjev::packed_attention", mutates_args=())
def packed_attention(
    q: Tensor,  # [Tq, H, D]
    k: Tensor,  # [Tk, Hkv, D]
    v: Tensor,  # [Tk, Hkv, D]
    cu_seqlens_q: Tensor,  # [N+1]
    cu_seqlens_k: Tensor,  # [N+1]
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    kernel_name: str = "flash",  # on CUDA: a name of PACKED_KERNELS ("efficient": equal q and k lengths)
) -> Tensor:
    """-> o [Tq, H, D] in q.dtype (bottom-right causal per sequence, GQA). (``kernel_name``, not ``kernel``:
    inductor's fallback for a custom op passes its own ``kernel`` argument beside the op's.)"""
    _check_kernel(kernel_name, q, k, max_seqlen_q, max_seqlen_k)
    return packed_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)


def _check_kernel(kernel: str, q: Tensor, k: Tensor, max_seqlen_q: int, max_seqlen_k: int) -> None:
    """A known kernel; the top-left causal one ("efficient") only where queries and keys have the same
    lengths (the packed forward's own levels), checked as far as the host can without reading the device."""
    if kernel not in PACKED_KERNELS:
        raise ValueError(f"packed_attention: kernel must be one of {', '.join(map(repr, PACKED_KERNELS))}, "
                         f"got {kernel!r}")
    if kernel != "flash" and (q.shape[0] != k.shape[0] or max_seqlen_q != max_seqlen_k):
        raise ValueError(f"packed_attention: the {kernel!r} kernel takes queries and keys of the same lengths")


@packed_attention.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, kernel_name="flash"):
    _check_kernel(kernel_name, q, k, max_seqlen_q, max_seqlen_k)
    return q.new_empty(q.shape)


@packed_attention.register_kernel("cuda")
def _packed_attention_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                           kernel_name="flash"):
    _check_kernel(kernel_name, q, k, max_seqlen_q, max_seqlen_k)
    if q.dtype == torch.float32:
        return packed_attention_masked(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    return PACKED_KERNELS[kernel_name](q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)


def causal_attention_sdpa(q, k, v, scale):
    """One causal sequence through SDPA on ``[1, H, T, D]`` views of the packed rows: cuDNN's fused attention
    first, FA2 where cuDNN refuses the inputs (bf16/fp16); SDPA's own choice for fp32. -> [T, H, D] contiguous."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] if q.dtype != torch.float32 else \
        [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D] views
    with sdpa_kernel(backends, set_priority=True):
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).contiguous()  # no copy when SDPA wrote [T, H, D] rows (cuDNN follows q's layout)


@torch.library.custom_op("hf_openjev::causal_attention", mutates_args=())
def causal_attention(
    q: Tensor,  # [T, H, D] one sequence
    k: Tensor,  # [T, Hkv, D]
    v: Tensor,  # [T, Hkv, D]
    scale: float,
) -> Tensor:
    """-> o [T, H, D] in q.dtype (causal, GQA)."""
    return causal_attention_reference(q, k, v, scale)


@causal_attention.register_fake
def _(q, k, v, scale):
    _check_causal(q, k, v)
    return q.new_empty(q.shape)


@causal_attention.register_kernel("cuda")
def _causal_attention_cuda(q, k, v, scale):
    _check_causal(q, k, v)
    return causal_attention_sdpa(q, k, v, scale)


@torch.library.custom_op("hf_openjev::prefix_attention", mutates_args=())
def prefix_attention(
    q: Tensor,  # [Tq, H, D]
    k: Tensor,  # [Tq, Hkv, D] own keys
    v: Tensor,  # [Tq, Hkv, D]
    cu_seqlens: Tensor,  # [N+1]
    prefix_k: Tensor,  # [P, Hkv, D] all prefix blocks, packed
    prefix_v: Tensor,  # [P, Hkv, D]
    prefix_starts: Tensor,  # [N+1] int32: first prefix row of sequence i (entry N: not read)
    prefix_lengths: Tensor,  # [N] int32: prefix rows of sequence i (0: none)
    scale: float,
    max_seqlen_q: int = 0,  # optional host bounds for FA2's grid; 0 = use Tq / P (still correct, more blocks)
    max_seqlen_prefix: int = 0,
) -> Tensor:
    """-> o [Tq, H, D] in q.dtype."""
    return prefix_attention_reference(q, k, v, cu_seqlens, prefix_k, prefix_v, prefix_starts, prefix_lengths, scale)


@prefix_attention.register_fake
def _(q, k, v, cu_seqlens, prefix_k, prefix_v, prefix_starts, prefix_lengths, scale, max_seqlen_q=0,
      max_seqlen_prefix=0):
    return q.new_empty(q.shape)


@prefix_attention.register_kernel("cuda")
def _prefix_attention_cuda(
    q, k, v, cu_seqlens, prefix_k, prefix_v, prefix_starts, prefix_lengths, scale, max_seqlen_q=0,
    max_seqlen_prefix=0
):
    if q.dtype == torch.float32:
        return prefix_attention_masked(q, k, v, cu_seqlens, prefix_k, prefix_v, prefix_starts, prefix_lengths, scale)
    max_q = max_seqlen_q or q.shape[0]
    max_p = max_seqlen_prefix or max(prefix_k.shape[0], 1)
    return prefix_attention_flash(q, k, v, cu_seqlens, prefix_k, prefix_v, prefix_starts, prefix_lengths, scale, max_q,
                                  max_p)

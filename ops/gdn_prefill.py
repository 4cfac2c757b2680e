"""Gated DeltaNet prefill over packed sequences: ``torch.ops.hf_openjev.gdn_prefill``.

Per value head h (key head h // (Hv // Hk), transformers' repeat_interleave convention) and token t:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
    with q, k L2-normalised (eps 1e-6) and q scaled by Dk ** -0.5; S [Dk, Dv] in fp32.

CPU: the plain-torch chunked reference (chunks of 64, fp32). CUDA: fla-core 0.6's ``chunk_gated_delta_rule``
forward, kernel for kernel (``fla_chunk_forward``: native GVA for Hv > Hk, state layout [N, Hv, Dk, Dv], l2norm
in kernel, varlen ``cu_seqlens``) with the caller's precomputed ``chunk_indices`` and ``chunk_offsets`` (from
``ops.varlen.prepare_varlen_metadata``): no host sync, no per-call metadata kernels, graph-capturable once
autotuned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_SIZE = 64


def check_gdn_inputs(q, k, v, g, beta, cu_seqlens, initial_state) -> None:
    """Refuse inputs whose shapes do not fit (q, k [T, Hk, Dk]; v [T, Hv, Dv], Hv a multiple of Hk; g, beta
    [T, Hv]; initial_state [N, Hv, Dk, Dv] or None), with a ValueError naming the argument."""
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    if k.shape != q.shape or v.shape[0] != T or Hv % Hk != 0:
        raise ValueError(f"gdn_prefill: bad q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"gdn_prefill: g/beta must be [{T}, {Hv}], got {tuple(g.shape)}, {tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (cu_seqlens.shape[0] - 1, Hv, Dk, Dv):
        raise ValueError(f"gdn_prefill: initial_state {tuple(initial_state.shape)} is not [N, {Hv}, {Dk}, {Dv}]")


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """fp32; q/k normalised (q also scaled) and expanded to the value heads. Returns [T, Hv, .] / [T, Hv]."""
    group = v.shape[1] // k.shape[1]
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k = _l2norm(k.float())
    return q.repeat_interleave(group, 1), k.repeat_interleave(group, 1), v.float(), g.float(), beta.float()


def _chunked_one(q, k, v, g, beta, state, chunk_size=CHUNK_SIZE):
    """One sequence. q, k [L, H, Dk]; v [L, H, Dv]; g, beta [L, H]; state [H, Dk, Dv] (all fp32)."""
    L, H, C = q.shape[0], q.shape[1], chunk_size
    if L == 0:
        return v.clone(), state.clone()
    pad = (-L) % C
    # [H, n, C, D] / [H, n, C]; zero padding at the end changes neither outputs nor the state (k = 0, g = 0)
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)).reshape(H, -1, C, x.shape[-1]) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)).reshape(H, -1, C) for x in (g, beta))
    gc = g.cumsum(-1)  # log decay from the chunk start, inclusive
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [H, n, C, C]
    k_beta = k * beta.unsqueeze(-1)
    # WY form: (I + strict_lower(beta K K^T * decay)) u = beta V, ... w = beta K exp(gc)
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # intra-chunk, diagonal included
    q_in = q * gc.exp().unsqueeze(-1)  # reads the state entering the chunk
    k_out = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)  # writes into the state leaving the chunk
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        v_new = u[:, c] - w[:, c] @ state  # [H, C, Dv]
        out[:, c] = q_in[:, c] @ state + attn[:, c] @ v_new
        state = state * chunk_decay[:, c] + k_out[:, c].transpose(-1, -2) @ v_new
    return out.reshape(H, -1, v.shape[-1])[:, :L].transpose(0, 1), state


def _final_states_shape(q, v, cu_seqlens, output_final_state: bool) -> tuple[int, ...]:
    """[N, Hv, Dk, Dv], or [0, Hv, Dk, Dv] (an empty result) when the caller does not want final states."""
    return (cu_seqlens.shape[0] - 1 if output_final_state else 0, v.shape[1], q.shape[2], v.shape[2])


def _per_sequence(one, q, k, v, g, beta, cu_seqlens, initial_state, output_final_state=True):
    check_gdn_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    if initial_state is None:
        initial_state = q.new_zeros(_final_states_shape(q, v, cu_seqlens, True), dtype=torch.float32)
    q32, k32, v32, g32, b32 = _prepare(q, k, v, g, beta)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    states = []
    cu = cu_seqlens.tolist()  # reference only: host loop over sequences
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        o[s:e], state = one(q32[s:e], k32[s:e], v32[s:e], g32[s:e], b32[s:e], initial_state[i].float())
        states.append(state)
    final = torch.stack(states).contiguous()
    return o.to(q.dtype), final if output_final_state else final.new_empty((0, *final.shape[1:]))


def gdn_prefill_reference(q, k, v, g, beta, cu_seqlens, initial_state, chunk_indices=None, output_final_state=True):
    """Chunked fp32 reference. q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; cu_seqlens [N+1];
    initial_state [N, Hv, Dk, Dv] or None (zeros). Returns (o [T, Hv, Dv] in q.dtype, final_state [N, Hv, Dk, Dv]
    fp32; [0, Hv, Dk, Dv] without ``output_final_state``). ``chunk_indices`` is accepted for signature parity
    and ignored."""
    return _per_sequence(_chunked_one, q, k, v, g, beta, cu_seqlens, initial_state, output_final_state)


@torch.library.custom_op("hf_openjev::gdn_prefill", mutates_args=())
def gdn_prefill(
    q: Tensor,  # [T, Hk, Dk]
    k: Tensor,  # [T, Hk, Dk]
    v: Tensor,  # [T, Hv, Dv]
    g: Tensor,  # [T, Hv] fp32 log decay (<= 0)
    beta: Tensor,  # [T, Hv]
    cu_seqlens: Tensor,  # [N+1] int32/int64
    initial_state: Tensor | None,  # [N, Hv, Dk, Dv] fp32; None = zeros (no sequence continues a state)
    chunk_indices: Tensor,  # [C, 2] from ops.varlen.prepare_varlen_metadata (CUDA only)
    output_final_state: bool = True,  # False: no final states are written (an empty [0, Hv, Dk, Dv] result)
    chunk_offsets: Tensor | None = None,  # [N+1] from prepare_varlen_metadata (CUDA only; None: fla derives them)
) -> tuple[Tensor, Tensor]:
    """-> (o [T, Hv, Dv] in q.dtype, final_state [N, Hv, Dk, Dv] fp32). Non-CUDA devices run the reference."""
    return gdn_prefill_reference(q, k, v, g, beta, cu_seqlens, initial_state, None, output_final_state)


@gdn_prefill.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, chunk_indices, output_final_state=True, chunk_offsets=None):
    """``gdn_prefill``'s fake (meta) kernel: the inputs checked, then empty (o [T, Hv, Dv] in q.dtype, final_state
    [N, Hv, Dk, Dv] fp32, or [0, Hv, Dk, Dv] without ``output_final_state``)."""
    check_gdn_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    return q.new_empty(v.shape), q.new_empty(_final_states_shape(q, v, cu_seqlens, output_final_state),
                                             dtype=torch.float32)


def fla_chunk_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices,
                      chunk_offsets=None):
    """fla-core 0.6's ``chunk_gated_delta_rule`` forward (``use_qk_l2norm_in_kernel=True``, varlen, 64-token
    chunks) as its autograd function runs it, kernel for kernel, with one difference: ``chunk_offsets`` (the first
    chunk of each sequence) can come precomputed, fla's own graph-mode argument of ``chunk_gated_delta_rule_fwd_h``.
    Otherwise fla derives them from ``cu_seqlens`` on the device at every call: ~5 small kernels (lengths,
    ceil-divide, pad, cumsum) per layer, though they depend only on the batch.

    q, k [1, T, Hk, Dk]; v [1, T, Hv, Dv]; g [1, T, Hv] fp32; beta [1, T, Hv] -> (o [1, T, Hv, Dv], final or None).
    """
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))  # what fla's input_guard does
    q, _ = l2norm_fwd(q)
    k, _ = l2norm_fwd(k)
    g = chunk_local_cumsum(g, chunk_size=CHUNK_SIZE, scale=RCP_LN2, cu_seqlens=cu_seqlens,
                           chunk_indices=chunk_indices)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens,
                                               chunk_indices=chunk_indices, chunk_size=CHUNK_SIZE)
    h, v_new, final_state = chunk_gated_delta_rule_fwd_h(
        k=k, w=w, u=u, g=g, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, chunk_size=CHUNK_SIZE)
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
                    chunk_size=CHUNK_SIZE)
    return o.to(q.dtype), final_state


@gdn_prefill.register_kernel("cuda")
def _gdn_prefill_cuda(q, k, v, g, beta, cu_seqlens, initial_state, chunk_indices, output_final_state=True,
                      chunk_offsets=None):
    check_gdn_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    from hf_openjev.ops._fla import fla_ready

    fla_ready()
    o, final_state = fla_chunk_forward(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0).float(), beta.unsqueeze(0),
        q.shape[-1] ** -0.5, None if initial_state is None else initial_state.float().contiguous(),
        output_final_state, cu_seqlens, chunk_indices, chunk_offsets)
    if not output_final_state:
        final_state = q.new_empty(_final_states_shape(q, v, cu_seqlens, False), dtype=torch.float32)
    return o[0], final_state

"""Packed causal depthwise conv + SiLU with per-sequence states: ``torch.ops.hf_openjev.causal_conv1d_packed``.

For sequence i with inputs x_i [L, C] and state s_i [C, K] (the last K inputs before the sequence; zeros if
none, transformers' conv-cache layout), with xs = s_i^T ++ x_i:

    c[t] = sum_j weight[:, j] * xs[t + 1 + j]               (j = 0..K-1; fp32 math, rounded to x.dtype)
    y[t] = SiLU(c[t])                                       (in x.dtype)
    final_state_i = xs[-K:]^T                               [C, K] in x.dtype

The conv is rounded to the model dtype before the SiLU, as the stock module does (a bf16 ``F.conv1d``, then
the activation): a fused fp32 conv + SiLU rounds once instead, and on random bf16 models that one difference
moved probabilities 3x further from stock Transformers (recipes/RESULTS.md, cpu-2026-11-29). For fp32 inputs the
rounding is a no-op.

No bias (the Qwen3.5 conv has none). ``activation=False`` returns the rounded conv without the SiLU (the Gated
DeltaNet applies it with its q/k/v split, ``ops.elementwise.silu_qkv``); ``output_final_state=False`` skips the
final states (an empty ``[0, C, K]``), as a pack's last level without exports needs none.

CUDA: with ``chunk_indices`` (the [C, 2] rows from ``ops.varlen.prepare_varlen_metadata``; fla's conv uses
the same 64-token chunking as GDN) it runs fla-core's Triton varlen ``causal_conv1d`` without activation
(per-sequence initial states, final states from its ``causal_conv1d_update_states`` kernel), then the SiLU.
Without ``chunk_indices`` fla would compute them with a host sync, so the CUDA path then uses
``causal_conv1d_packed_torch``: a gather-based torch implementation without host sync (K gathers of [T, C];
slower, but capture-safe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _check(x, weight, cu_seqlens, initial_state) -> None:
    T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"causal_conv1d_packed: weight must be [{C}, K], got {tuple(weight.shape)}")
    if initial_state is not None and initial_state.shape != (cu_seqlens.shape[0] - 1, C, weight.shape[1]):
        raise ValueError(
            f"causal_conv1d_packed: initial_state {tuple(initial_state.shape)} is not [N, {C}, {weight.shape[1]}]"
        )


def _zero_states(x, weight, cu_seqlens) -> Tensor:
    return x.new_zeros(cu_seqlens.shape[0] - 1, x.shape[1], weight.shape[1])


def _outputs(conv, final_state, activation: bool, output_final_state: bool) -> tuple[Tensor, Tensor]:
    """(SiLU(conv) or conv, final_state or an empty [0, C, K]): the op's optional activation and states."""
    y = F.silu(conv) if activation else conv
    return y, final_state if output_final_state else final_state.new_empty((0, *final_state.shape[1:]))


def causal_conv1d_packed_reference(x, weight, cu_seqlens, initial_state, chunk_indices=None, activation=True,
                                   output_final_state=True):
    """Loop over sequences. x [T, C]; weight [C, K]; cu_seqlens [N+1]; initial_state [N, C, K] or None (zeros).
    Returns (y [T, C] in x.dtype, final_state [N, C, K] in x.dtype); y without the SiLU when ``activation`` is
    False, final_state empty ([0, C, K]) when ``output_final_state`` is False."""
    _check(x, weight, cu_seqlens, initial_state)
    if initial_state is None:
        initial_state = _zero_states(x, weight, cu_seqlens)
    K = weight.shape[1]
    w = weight.float().t()  # [K, C]
    y = torch.empty_like(x, dtype=torch.float32)
    states = []
    cu = cu_seqlens.tolist()
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        xs = torch.cat([initial_state[i].to(x.dtype).t(), x[s:e]]).float()  # [K + L, C]
        L = e - s
        y[s:e] = sum(w[j] * xs[1 + j : 1 + j + L] for j in range(K))
        states.append(xs[-K:].t())
    return _outputs(y.to(x.dtype), torch.stack(states).to(x.dtype).contiguous(), activation, output_final_state)


def causal_conv1d_packed_torch(x, weight, cu_seqlens, initial_state, activation=True, output_final_state=True):
    """Same result as the reference, computed with gathers only (no host sync, fixed shapes)."""
    _check(x, weight, cu_seqlens, initial_state)
    if initial_state is None:
        initial_state = _zero_states(x, weight, cu_seqlens)
    (T, C), K, N = x.shape, weight.shape[1], initial_state.shape[0]
    cu = cu_seqlens.long()
    tok = torch.arange(T, device=x.device)
    seq = torch.searchsorted(cu[1:].contiguous(), tok, right=True)  # [T] sequence of each token
    pos = tok - cu[seq]  # [T] position inside its sequence
    # one source table: row n*K + j is state n's j-th entry, row N*K + t is token t
    src = torch.cat([initial_state.to(x.dtype).transpose(1, 2).reshape(N * K, C), x])  # [N*K + T, C]

    def rows(seq_id, p, start):  # p: position in the sequence, may be negative (>= -K): then from the state
        return torch.where(p >= 0, N * K + start + p, seq_id * K + K + p)

    w = weight.float()
    y = torch.zeros(T, C, dtype=torch.float32, device=x.device)
    for j in range(K):
        y += w[:, j] * src[rows(seq, pos - (K - 1 - j), cu[seq])].float()
    n = torch.arange(N, device=x.device)
    p = (cu[1:] - cu[:-1])[:, None] - K + torch.arange(K, device=x.device)  # [N, K] last K positions
    final_state = src[rows(n[:, None], p, cu[:-1, None])].transpose(1, 2).contiguous()  # [N, C, K]
    return _outputs(y.to(x.dtype), final_state, activation, output_final_state)


@torch.library.custom_op("hf_openjev::causal_conv1d_packed", mutates_args=())
def causal_conv1d_packed(
    x: Tensor,  # [T, C]
    weight: Tensor,  # [C, K]
    cu_seqlens: Tensor,  # [N+1]
    initial_state: Tensor | None,  # [N, C, K]; None = zeros
    chunk_indices: Tensor | None = None,  # [C, 2] from prepare_varlen_metadata; CUDA: selects fla's kernel
    activation: bool = True,  # False: the conv rounded to x.dtype, without the SiLU (the caller applies it)
    output_final_state: bool = True,  # False: no final states are computed (an empty [0, C, K] result)
) -> tuple[Tensor, Tensor]:
    """-> (y [T, C] = SiLU(causal depthwise conv), final_state [N, C, K]), both in x.dtype."""
    return causal_conv1d_packed_reference(x, weight, cu_seqlens, initial_state, None, activation, output_final_state)


@causal_conv1d_packed.register_fake
def _(x, weight, cu_seqlens, initial_state, chunk_indices=None, activation=True, output_final_state=True):
    _check(x, weight, cu_seqlens, initial_state)
    n = cu_seqlens.shape[0] - 1 if output_final_state else 0
    return x.new_empty(x.shape), x.new_empty(n, x.shape[1], weight.shape[1])


@causal_conv1d_packed.register_kernel("cuda")
def _causal_conv1d_packed_cuda(x, weight, cu_seqlens, initial_state, chunk_indices=None, activation=True,
                               output_final_state=True):
    if chunk_indices is None:
        return causal_conv1d_packed_torch(x, weight, cu_seqlens, initial_state, activation, output_final_state)
    _check(x, weight, cu_seqlens, initial_state)
    from hf_openjev.ops._fla import fla_ready

    fla_ready()
    from fla.modules.causal_conv1d import causal_conv1d

    y, final_state = causal_conv1d(
        x.unsqueeze(0),
        weight=weight.contiguous(),
        bias=None,
        initial_state=None if initial_state is None else initial_state.to(x.dtype).contiguous(),
        output_final_state=output_final_state,
        activation=None,  # SiLU after rounding, as the stock module (see the module docstring)
        backend="triton",
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
    )
    if final_state is None:  # output_final_state=False
        final_state = x.new_empty((0, x.shape[1], weight.shape[1]))
    return F.silu(y[0]) if activation else y[0], final_state

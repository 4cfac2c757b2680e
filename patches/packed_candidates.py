"""Packed token mixers: Gated DeltaNet and gated full attention over ``[T, hidden]`` packed candidates.

Subclasses of the stock Qwen3.5 modules. With ``pack=None`` they are the stock modules (``super().forward``);
with a :class:`~hf_openjev.packing.pack_context.PackContext` they run the pack's levels (attention) and Gated
DeltaNet calls (one or more levels each) through the ``torch.ops.hf_openjev`` kernels, each sequence starting from
its anchor's states (shared prefix) or zeros.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

import hf_openjev.ops  # noqa: F401 - registers torch.ops.hf_openjev.*
from hf_openjev.ops.causal_conv import causal_conv1d_packed
from hf_openjev.ops.gdn_prefill import gdn_prefill
from hf_openjev.ops.packed_attention import causal_attention, packed_attention, prefix_attention

from .compiled_elementwise import elementwise_functions
from .stacked_projections import projections


def _bank(zero_row: torch.Tensor, external: torch.Tensor | None) -> list[torch.Tensor]:
    return [zero_row] if external is None else [zero_row, external]


class PackedGatedDeltaNet(qwen.Qwen3_5GatedDeltaNet):
    """Gated DeltaNet over packed sequences: conv + chunked delta rule per call, fp32 states across prefixes."""

    def forward(self, hidden_states, *args, pack=None, **kwargs):
        if pack is None:
            return super().forward(hidden_states, *args, **kwargs)
        return packed_gated_deltanet(self, hidden_states, pack)


def packed_gated_deltanet(m: qwen.Qwen3_5GatedDeltaNet, x: torch.Tensor, pack) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden]."""
    T = x.shape[0]
    qkv, z, b, a = projections(m, x)  # [T, 2*Kd + Vd], [T, Vd], [T, Hv], [T, Hv]: column views, not copied
    ew = elementwise_functions(pack.options.compile_elementwise, x.device, fused=pack.options.fused_elementwise)
    g, beta = ew.gdn_gates(a, b, m.A_log, m.dt_bias)  # [T, Hv] fp32, [T, Hv]
    conv_weight = m.conv1d.weight.squeeze(1)  # [C, K]
    layer = m.layer_idx
    # the state banks ([1, Hv, Dk, Dv] fp32 and [1, C, K] per row, then every call's final states) only when some
    # call reads them (a call with a ``source`` reads that call's final states directly) or the pack exports
    reads_bank = bool(pack.exports) or any(call.has_parents and call.source is None for call in pack.gdn_calls)
    gdn_bank = _bank(x.new_zeros(1, m.num_v_heads, m.head_k_dim, m.head_v_dim, dtype=torch.float32),
                     pack.external_gdn.get(layer)) if reads_bank else []
    conv_bank = _bank(qkv.new_zeros(1, m.conv_dim, m.conv_kernel_size), pack.external_conv.get(layer)) \
        if reads_bank else []
    gdn_finals, conv_finals = [], []  # per call
    outputs = []
    for index, call in enumerate(pack.gdn_calls):  # layout_steps.GdnCall: one or more levels
        wants_final = index < len(pack.gdn_calls) - 1 or bool(pack.exports)  # later calls or packs read them
        if call.rows is None:  # the call's rows [lo, hi) in order
            rows = slice(call.lo, call.hi)
            conv_in, g_in, beta_in = qkv[rows], g[rows], beta[rows]
        else:  # a gathered layout: sequences that continue a tail re-run its rows, [tail rows ; own rows]
            conv_in, g_in, beta_in = (t.index_select(0, call.rows) for t in (qkv, g, beta))  # [T', .]
        # [n, C, K] and [n, Hv, Dk, Dv] from the anchors; None (zeros, nothing materialised) when all start fresh
        conv_init = gdn_init = None
        if call.has_parents:
            conv_from = conv_finals[call.source] if call.source is not None else torch.cat(conv_bank)
            gdn_from = gdn_finals[call.source] if call.source is not None else torch.cat(gdn_bank)
            conv_init = conv_from.index_select(0, call.parent_rows)
            gdn_init = gdn_from.index_select(0, call.parent_rows)
        conv, conv_final = causal_conv1d_packed(conv_in, conv_weight, call.cu_seqlens, conv_init, call.chunk_indices,
                                                False, wants_final)  # [n_rows, C], no SiLU
        q, k, v = ew.silu_qkv(conv, m.key_dim, m.value_dim)  # contiguous [n_rows, Kd] x 2, [.., Vd]
        n = q.shape[0]
        q = q.reshape(n, m.num_k_heads, m.head_k_dim)
        k = k.reshape(n, m.num_k_heads, m.head_k_dim)
        v = v.reshape(n, m.num_v_heads, m.head_v_dim)
        if pack.options.gdn_fp32:  # fla then keeps its WY factors and chunk states in fp32 (as the stock fallback)
            q, k, v = q.float(), k.float(), v.float()
        out, gdn_final = gdn_prefill(q, k, v, g_in, beta_in, call.cu_seqlens, gdn_init, call.chunk_indices,
                                     wants_final, call.chunk_offsets)
        if call.keep is not None:
            out = out.index_select(0, call.keep)  # [hi - lo, Hv, Dv]: the call's own rows
        outputs.append(out.to(x.dtype))
        gdn_finals.append(gdn_final)
        conv_finals.append(conv_final)
        if reads_bank:
            gdn_bank.append(gdn_final)  # one row per sequence of the call (layout_steps.StateBank numbers the bank so)
            conv_bank.append(conv_final)
    if pack.exports:
        pack.record_recurrent(layer, torch.cat(gdn_bank), torch.cat(conv_bank))
    core = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [T, Hv, Dv]
    z = z.reshape(T, -1, m.head_v_dim)  # [T, Hv, Dv], still a column view of the stacked projection
    core = ew.gated_rms_norm(core, z, m.norm.weight, m.norm.variance_epsilon).reshape(T, -1)
    return m.out_proj(core)


class PackedAttention(qwen.Qwen3_5Attention):
    """Gated full attention over packed sequences; continuing sequences read their prefix chain's K/V."""

    def forward(self, hidden_states, *args, pack=None, rotary=None, **kwargs):
        if pack is None:
            return super().forward(hidden_states, *args, **kwargs)
        return packed_gated_attention(self, hidden_states, pack, rotary), None


def packed_gated_attention(m: qwen.Qwen3_5Attention, x: torch.Tensor, pack, rotary) -> torch.Tensor:
    """x [T, hidden], rotary = (cos, sin) [T, rotary_dim] -> [T, hidden]."""
    T, D = x.shape[0], m.head_dim
    query_gate, key, value = projections(m, x)
    query, gate = torch.chunk(query_gate.reshape(T, -1, 2 * D), 2, dim=-1)  # [T, H, D] views each
    ew = elementwise_functions(pack.options.compile_elementwise, x.device, fused=pack.options.fused_elementwise)
    query, key = ew.qk_norm_rope(query, key.reshape(T, -1, D), m.q_norm.weight, m.k_norm.weight, m.q_norm.eps,
                                 m.k_norm.eps, *rotary)  # [T, H, D], [T, Hkv, D]
    value = value.reshape(T, -1, D)
    layer = m.layer_idx
    all_key, all_value = key, value
    if layer in pack.external_key:  # [external chains ; this pack]
        all_key = torch.cat([pack.external_key[layer], key])
        all_value = torch.cat([pack.external_value[layer], value])
    outputs = []
    for level in pack.levels:
        rows = slice(level.lo, level.hi)
        if level.has_parents:  # prefix keys read in place, or from the level's gathered blocks
            prefix_key, prefix_value = (all_key, all_value) if level.chain_index is None else \
                (all_key.index_select(0, level.chain_index), all_value.index_select(0, level.chain_index))
            out = prefix_attention(query[rows], key[rows], value[rows], level.cu_seqlens, prefix_key, prefix_value,
                                   level.prefix_starts, level.prefix_lengths, m.scaling, level.max_seqlen,
                                   level.max_chain)
        elif level.dense:  # one long sequence (dummies after it): one dense causal call
            out = causal_attention(query[rows], key[rows], value[rows], m.scaling)
        else:
            out = packed_attention(query[rows], key[rows], value[rows], level.cu_seqlens, level.cu_seqlens,
                                   level.max_seqlen, level.max_seqlen, m.scaling, pack.options.packed_attention)
        outputs.append(out)
    if pack.exports:
        pack.record_kv(layer, all_key, all_value)
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [T, H, D]
    out = ew.sigmoid_gate(out, gate).reshape(T, -1)  # [T, H * D]
    return m.o_proj(out)

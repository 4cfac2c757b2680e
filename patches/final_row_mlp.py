"""Decoder layer and text model over a packed forward, with a final-row-only last layer.

In the last decoder layer every token still goes through the token mixer (its K/V and recurrent states may be
handed to later packs), but only the scored candidates' last rows go through the post-mixer norm, the MLP and
the final norm: for a pack of T tokens and N candidates, the last MLP does N rows instead of T.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

from .compiled_elementwise import elementwise_functions
from .stacked_projections import projections


class PackedDecoderLayer(qwen.Qwen3_5DecoderLayer):
    """``pack=None``: the stock layer. Otherwise ``(mlp_out, residual)``, each ``[T, hidden]`` (``[N, hidden]``
    when ``final_rows`` is given: the rows kept after the mixer), whose sum is the stock layer's output.

    The sum is left to the next layer, which adds it in the same kernel as its input norm (``add_rms_norm``;
    ``residual`` is then the previous layer's residual and ``hidden_states`` its MLP output). The residual is in
    the model dtype, or fp32 with ``residual_fp32`` (the norms' outputs stay in the model dtype)."""

    def forward(self, hidden_states, *args, pack=None, rotary=None, final_rows=None, residual=None, **kwargs):
        if pack is None:
            return super().forward(hidden_states, *args, **kwargs)
        ew = elementwise_functions(pack.options.compile_elementwise, hidden_states.device,
                                  fused=pack.options.fused_elementwise)
        norm = self.input_layernorm
        if residual is None:  # the first layer: its input is the embedding
            residual = hidden_states.float() if pack.options.residual_fp32 else hidden_states
            hidden_states = ew.rms_norm(hidden_states, norm.weight, norm.eps)
        else:
            hidden_states, residual = ew.add_rms_norm(hidden_states, residual, norm.weight, norm.eps)
        if self.block_type == "linear_attention":
            hidden_states = self.linear_attn(hidden_states, pack=pack)
        else:
            hidden_states, _ = self.self_attn(hidden_states, pack=pack, rotary=rotary)
        norm = self.post_attention_layernorm
        if final_rows is None:
            hidden_states, residual = ew.add_rms_norm(hidden_states, residual, norm.weight, norm.eps)
        else:
            dtype = hidden_states.dtype
            residual = (residual + hidden_states).index_select(0, final_rows)  # [N, hidden]
            hidden_states = ew.rms_norm(residual, norm.weight, norm.eps).to(dtype)
        gate, up = projections(self.mlp, hidden_states)
        if self.mlp.config.hidden_act == "silu":
            hidden_states = ew.silu_mul(gate, up)
        else:
            hidden_states = self.mlp.act_fn(gate) * up
        return self.mlp.down_proj(hidden_states), residual


class PackedTextModel(qwen.Qwen3_5TextModel):
    """``forward(pack=ctx)`` returns the final-norm hidden states of the pack's scored rows ``[N, hidden]``."""

    def forward(self, *args, pack=None, layers=None, **kwargs):
        if pack is None:
            return super().forward(*args, **kwargs)
        return packed_text_forward(self, pack, layers=layers)


def packed_text_forward(model: qwen.Qwen3_5TextModel, pack, *, layers=None) -> torch.Tensor:
    """``layers``: indices of the decoder layers to run, in order (None: all). A subset is a probe, no answer: each
    layer reads the previous one run, so every op meets the shapes of the whole forward (a capture's first uses,
    :mod:`.cuda_graphs`)."""
    hidden = model.embed_tokens(pack.input_ids)  # [T, hidden]
    # text positions are identical on the three mRoPE axes: [3, 1, T] (the layout every supported release reads)
    positions = pack.positions[None, None].expand(3, 1, -1)
    cos, sin = model.rotary_emb(hidden[None], positions)  # [1, T, rotary_dim]
    rotary = (cos[0], sin[0])
    decoder_layers = model.layers[: model.config.num_hidden_layers]
    last = len(decoder_layers) - 1
    residual = None
    for i in range(len(decoder_layers)) if layers is None else layers:
        layer = decoder_layers[i]
        rows = pack.final_rows if (i == last and pack.options.final_row_mlp) else None
        hidden, residual = layer(hidden, pack=pack, rotary=rotary, final_rows=rows, residual=residual)
    hidden = residual + hidden  # the last layer's output
    if not pack.options.final_row_mlp:
        hidden = hidden.index_select(0, pack.final_rows)
    return model.norm(hidden)  # [N, hidden]

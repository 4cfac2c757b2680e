"""The model shapes the recipes build (Open-Jev family members and two small ones), with each one's temperature.

``SHAPES[name]``: the Qwen3.5 text-config fields of the shape (every 4th layer full attention, Transformers'
default ``layer_types``). ``TEMPERATURES[name]``: the calibration temperature the shape's random model carries in
its manifest (the 27B's for 27b, mid and tiny, on which the committed fp32 oracles were built).
"""

from __future__ import annotations

VOCAB = 248320  # the Qwen3.5 vocabulary: every shape's embedding, and the range of the workload's random ids
T27 = 2.5343690298472983  # Open-Jev-27B's temperature
T9 = 1.8969118766347646  # Open-Jev-9B's
T2 = 1.518796342858676  # Open-Jev-2B's

SHAPES = {
    # Open-Jev-27B text shape (the project's checkpoint document)
    "27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128),
    # Open-Jev-9B on Qwen3.5-9B: 24 Gated DeltaNet + 8 full-attention layers
    "9b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
               num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128),
    # Open-Jev-2B on Qwen3.5-2B: 18 + 6 layers, tied embeddings; the MLP width 6144 is assumed (not in our documents)
    "2b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
               num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
               linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True),
    # a tiny shape, for smoke runs of the recipes on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16),
    # a mid-size shape with the real head dims and GVA (for parity runs)
    "mid": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                linear_key_head_dim=128, linear_value_head_dim=128),
}

TEMPERATURES = {"27b": T27, "9b": T9, "2b": T2, "tiny": T27, "mid": T27}

FULL_ATTENTION_INTERVAL = 4  # every 4th layer is full attention, the others Gated DeltaNet


def layer_kinds(shape: str) -> list[str]:
    """``"gdn"`` or ``"attn"`` per layer of ``shape``, in order (every 4th full attention)."""
    n = SHAPES[shape]["num_hidden_layers"]
    return ["attn" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "gdn" for i in range(n)]


def gemm_shapes(shape: str) -> dict[str, list[tuple[str, int, int]]]:
    """kind -> [(name, out_features, in_features)] of one layer's projections as the fast path stacks them:
    Gated DeltaNet in_proj q|k|v|z|b|a and out_proj, attention q(+gate)|k|v and o_proj, the MLP's gate|up and down."""
    s = SHAPES[shape]
    hidden, hk, hv = s["hidden_size"], s["linear_num_key_heads"], s["linear_num_value_heads"]
    dk, dv, heads, kv, dh = (s["linear_key_head_dim"], s["linear_value_head_dim"], s["num_attention_heads"],
                             s["num_key_value_heads"], s["head_dim"])
    return {
        "gdn": [("gdn in_proj qkv|z|b|a", 2 * hk * dk + hv * dv + hv * dv + hv + hv, hidden),
                ("gdn out_proj", hidden, hv * dv)],
        "attn": [("attn q|k|v", 2 * heads * dh + 2 * kv * dh, hidden), ("attn o_proj", hidden, heads * dh)],
        "mlp": [("mlp gate|up", 2 * s["intermediate_size"], hidden), ("mlp down", hidden, s["intermediate_size"])],
    }


def gemm_weight_count(shape: str) -> int:
    """Weights in one forward's projection GEMMs of ``shape`` (every layer's mixer and MLP; embeddings, norms and
    the head left out)."""
    shapes = gemm_shapes(shape)
    return sum(n * k for kind in layer_kinds(shape) for _, n, k in shapes[kind] + shapes["mlp"])

"""patches/compiled_elementwise.py: which functions a packed forward gets, and the compiled ones against the plain."""

from __future__ import annotations

import pytest
import torch

from hf_openjev.ops.elementwise import gdn_gates_reference as gdn_gates
from hf_openjev.patches.compiled_elementwise import FUSED, PLAIN, _compiled, elementwise_functions

torch.set_num_threads(1)


def test_compiled_only_when_asked_and_on_cuda():
    assert elementwise_functions(False, torch.device("cpu")) is PLAIN
    assert elementwise_functions(True, torch.device("cpu")) is PLAIN  # CPU: plain code either way
    assert elementwise_functions(False, torch.device("cuda")) is PLAIN
    compiled = elementwise_functions(True, torch.device("cuda"))  # wrappers only: nothing compiles until called
    assert compiled is not PLAIN and set(vars(compiled)) == set(vars(PLAIN))
    assert elementwise_functions(True, torch.device("cuda"), fused=True) is compiled  # compiled wins over fused


def test_fused_functions_are_the_registered_ops_on_every_device():
    """The default set: the hf_openjev ops (Triton kernels on CUDA, the plain code on the CPU)."""
    for device in ("cpu", "cuda"):
        assert elementwise_functions(False, torch.device(device), fused=True) is FUSED
    assert set(vars(FUSED)) == set(vars(PLAIN))
    assert all(getattr(FUSED, name) is getattr(torch.ops.hf_openjev, name) for name in vars(FUSED))


def test_qk_norm_rope_is_the_stock_attention_math():
    """Against the stock module's own q_norm / k_norm and RoPE (Qwen3_5Attention's order: norm, then rotary)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]})
    attention = qwen.Qwen3_5Attention(config, layer_idx=3)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        attention.q_norm.weight.normal_(0, 0.1, generator=gen)
        attention.k_norm.weight.normal_(0, 0.1, generator=gen)
    q, k = torch.randn(11, 4, 32, generator=gen), torch.randn(11, 2, 32, generator=gen)
    cos, sin = torch.randn(11, 8, generator=gen), torch.randn(11, 8, generator=gen)
    got_q, got_k = PLAIN.qk_norm_rope(q, k, attention.q_norm.weight, attention.k_norm.weight, attention.q_norm.eps,
                                      attention.k_norm.eps, cos, sin)
    want_q, want_k = qwen.apply_rotary_pos_emb(attention.q_norm(q), attention.k_norm(k), cos, sin, unsqueeze_dim=1)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert not torch.equal(got_q[..., 8:], q[..., 8:])  # the norm did run on the dims RoPE passes through


def test_gdn_gates_are_the_stock_gate_math():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 6, generator=gen).bfloat16(), torch.randn(7, 6, generator=gen).bfloat16()
    A_log, dt_bias = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16
    assert (g <= 0).all()  # a log decay
    expected = -A_log.exp() * torch.log1p((a.float() + dt_bias).exp())  # softplus written out
    torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(beta, torch.sigmoid(b.float()).bfloat16())


@pytest.mark.slow
def test_compiled_functions_match_the_plain_ones_on_odd_sizes():
    """Inductor (CPU here, CUDA in production) with dynamic shapes: two token counts, one compile each function."""
    compiled = _compiled()
    gen = torch.Generator().manual_seed(1)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    for tokens in (37, 300):
        cases = {
            "rms_norm": (r(tokens, 3, 32), r(32) * 0.1, 1e-6),
            "add_rms_norm": (r(tokens, 48), r(tokens, 48), r(48) * 0.1, 1e-6),
            "gated_rms_norm": (r(tokens * 3, 16), r(tokens * 3, 16), r(16), 1e-6),
            "silu_mul": (r(tokens, 40), r(tokens, 40)),
            "sigmoid_gate": (r(tokens, 24), r(tokens, 24)),
            "gdn_gates": (r(tokens, 6), r(tokens, 6), r(6), r(6)),
            "qk_norm_rope": (r(tokens, 6, 32), r(tokens, 2, 32), r(32) * 0.1, r(32) * 0.1, 1e-6, 1e-6,
                             r(tokens, 8), r(tokens, 8)),  # partial rotary: 8 of 32 dims
        }
        for name, args in cases.items():
            torch.testing.assert_close(getattr(compiled, name)(*args), getattr(PLAIN, name)(*args),
                                       rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_compiled_bf16_rounds_where_the_plain_code_rounds():
    """bf16 through Inductor (CPU here): with emulate_precision_casts the compiled functions round where eager
    rounds, so only reduction-order ties differ. Without it 26-35% of SiLU-mul / sigmoid-gate / gated-norm
    outputs differ by an ulp (measured on this CPU), the kind of drift that cost parity on the H200."""
    compiled = _compiled()
    gen = torch.Generator().manual_seed(3)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).bfloat16()

    tokens = 211
    cases = {
        "silu_mul": ((r(tokens, 384), r(tokens, 384)), 0.0),
        "sigmoid_gate": ((r(tokens, 384), r(tokens, 384)), 0.0),
        "gated_rms_norm": ((r(tokens * 4, 128), r(tokens * 4, 128), r(128), 1e-6), 1e-3),
        "add_rms_norm": ((r(tokens, 640), r(tokens, 640), r(640, scale=0.1), 1e-6), 1e-3),
        "qk_norm_rope": ((r(tokens, 6, 64), r(tokens, 2, 64), r(64, scale=0.1), r(64, scale=0.1), 1e-6, 1e-6,
                          r(tokens, 16), r(tokens, 16)), 1e-3),
    }
    for name, (args, allowed) in cases.items():
        got, want = getattr(compiled, name)(*args), getattr(PLAIN, name)(*args)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert g.dtype == w.dtype == torch.bfloat16
            differ = (g != w).float().mean().item()
            assert differ <= allowed, f"{name}: {differ:.2%} of bf16 outputs differ from the plain code"

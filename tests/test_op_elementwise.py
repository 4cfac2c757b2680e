"""The elementwise group vs the stock Qwen3.5 modules (bitwise on CPU), opcheck, torch.compile, GPU."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from hf_openjev.ops import elementwise as ew
from hf_openjev.ops._checks import capture_replay, max_errors

OPS = torch.ops.hf_openjev
EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(dtype, t=37, d=48, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    return dict(
        x=r(t, d), residual=r(t, d, scale=4.0), gate=r(t, d), up=r(t, d), weight=r(d, scale=0.3),
        rows=torch.tensor([t - 1, 0, t // 7, t // 7, t // 2], device=device), head_weight=r(1, d, dt=torch.float32),
        head_bias=r(1, dt=torch.float32),
    )


def _norm(weight):
    norm = Qwen3_5RMSNorm(weight.shape[0], eps=EPS).to(weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_stock_residual_add_then_norm(dtype):
    a = _inputs(dtype)
    normed, new_residual = OPS.add_rms_norm(a["x"], a["residual"], a["weight"], EPS)
    stock_residual = a["residual"] + a["x"]  # the decoder layer's `residual + hidden_states`
    assert torch.equal(new_residual, stock_residual)
    assert torch.equal(normed, _norm(a["weight"])(stock_residual))
    assert normed.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_is_stock(dtype):
    a = _inputs(dtype)
    stock = Qwen3_5RMSNormGated(a["x"].shape[-1], eps=EPS).to(dtype)
    stock.weight.data.copy_(a["weight"])
    out = OPS.gated_rms_norm(a["x"], a["gate"], a["weight"], EPS)
    assert out.dtype == dtype and torch.equal(out, stock(a["x"], a["gate"]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_and_sigmoid_gate_are_stock(dtype):
    a = _inputs(dtype)
    assert torch.equal(OPS.silu_mul(a["gate"], a["up"]), F.silu(a["gate"]) * a["up"])  # Qwen3_5MLP
    assert torch.equal(OPS.sigmoid_gate(a["x"], a["gate"]), a["x"] * torch.sigmoid(a["gate"]))  # attention gate


@pytest.mark.parametrize("dtype", DTYPES)
def test_final_rows_head_is_stock_norm_then_fp32_linear(dtype):
    a = _inputs(dtype)
    head = torch.nn.Linear(a["x"].shape[-1], 1)
    head.weight.data.copy_(a["head_weight"])
    head.bias.data.copy_(a["head_bias"])
    expected = head(_norm(a["weight"])(a["x"])[a["rows"]].float()).squeeze(-1)
    scores = OPS.final_rows_head(a["x"], a["rows"], a["weight"], EPS, a["head_weight"], a["head_bias"])
    assert scores.shape == (5,) and scores.dtype == torch.float32
    assert torch.equal(scores, expected)
    assert scores[2] == scores[3] and scores[0] != scores[1]


def _calls(a):
    return {
        "add_rms_norm": (a["x"], a["residual"], a["weight"], EPS),
        "gated_rms_norm": (a["x"], a["gate"], a["weight"], EPS),
        "silu_mul": (a["gate"], a["up"]),
        "sigmoid_gate": (a["x"], a["gate"]),
        "final_rows_head": (a["x"], a["rows"], a["weight"], EPS, a["head_weight"], a["head_bias"]),
    }


@pytest.mark.parametrize("name", list(_calls(_inputs(torch.float32))))
def test_opcheck(name):
    torch.library.opcheck(getattr(OPS, name), _calls(_inputs(torch.float32, t=9, d=16))[name])


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_plain_code_matches_eager(dtype):
    """What a compiled model forward does: the plain functions, fused by Inductor in one graph."""
    a = _inputs(dtype)

    def block(x, residual, gate, up, weight, rows, head_weight, head_bias):
        normed, residual = ew.add_rms_norm_reference(x, residual, weight, EPS)
        h = ew.silu_mul_reference(normed, up) + ew.sigmoid_gate_reference(gate, normed)
        h = ew.gated_rms_norm_reference(h, gate, weight, EPS)
        return h, residual, ew.final_rows_head_reference(h, rows, weight, EPS, head_weight, head_bias)

    compiled = torch.compile(block, fullgraph=True)(**a)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for got, want in zip(compiled, block(**a)):
        torch.testing.assert_close(got, want, **tol)


def test_ops_compile_fullgraph():
    a = _inputs(torch.float32)

    def f(x, residual, gate, up, weight, rows, head_weight, head_bias):
        normed, residual = OPS.add_rms_norm(x, residual, weight, EPS)
        h = OPS.gated_rms_norm(OPS.silu_mul(normed, up), OPS.sigmoid_gate(gate, x), weight, EPS)
        return residual, OPS.final_rows_head(h, rows, weight, EPS, head_weight, head_bias)

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(**a), f(**a))


# ------------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    a = _inputs(dtype, t=3399, d=5120, seed=1)
    cpu, gpu = _calls(a), _calls(_inputs(dtype, t=3399, d=5120, seed=1, device="cuda"))
    for name in cpu:
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert max_errors(getattr(OPS, name)(*gpu[name]), getattr(OPS, name)(*cpu[name]))[1] < tol, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_replay():
    a = _inputs(torch.bfloat16, t=936, d=5120, seed=1, device="cuda")
    b = _inputs(torch.bfloat16, t=936, d=5120, seed=2, device="cuda")
    for name, args in _calls(a).items():
        names = [f"a{i}" for i in range(len(args))]

        def fn(**kw):
            return getattr(OPS, name)(*(kw[n] for n in names))

        replayed, eager = capture_replay(fn, dict(zip(names, args)), dict(zip(names, _calls(b)[name])))
        assert max_errors(replayed, eager)[0] == 0.0, name

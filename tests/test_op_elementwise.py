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
KEY_DIM, VALUE_DIM = 8, 24


def _inputs(dtype, t=37, d=48, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    heads, head_dim, rotary = 3, 16, 8  # q/k norm + partial RoPE; the GDN gates over `heads` value heads
    return dict(
        x=r(t, d), residual=r(t, d, scale=4.0), gate=r(t, d), up=r(t, d), weight=r(d, scale=0.3),
        rows=torch.tensor([t - 1, 0, t // 7, t // 7, t // 2], device=device),
        query=r(t, heads, head_dim), key=r(t, 1, head_dim), q_weight=r(head_dim, scale=0.1),
        k_weight=r(head_dim, scale=0.1), cos=r(t, rotary), sin=r(t, rotary),
        a=r(t, heads), b=r(t, heads), A_log=r(heads, dt=torch.float32), dt_bias=r(heads),
        mixed=r(t, 2 * KEY_DIM + VALUE_DIM, scale=3.0),  # the GDN's conv output: q | k | v
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


def test_add_rms_norm_with_an_fp32_residual_adds_in_fp32_and_norms_into_the_model_dtype():
    """The fast path's ``residual_fp32``: the sum stays fp32 (no rounding to bf16), the norm's output is bf16."""
    a = _inputs(torch.bfloat16)
    residual = a["residual"].float() + torch.randn(a["residual"].shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    normed, new_residual = OPS.add_rms_norm(a["x"], residual, a["weight"], EPS)
    exact = residual + a["x"].float()
    assert new_residual.dtype == torch.float32 and torch.equal(new_residual, exact)
    assert not torch.equal(exact.bfloat16().float(), exact)  # a bf16 residual would have rounded it
    assert normed.dtype == torch.bfloat16
    assert torch.equal(normed, _norm(a["weight"].float())(exact).bfloat16())
    torch.library.opcheck(OPS.add_rms_norm, (a["x"], residual, a["weight"], EPS))


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
def test_silu_qkv_is_the_stock_activation_and_split(dtype):
    """Qwen3_5GatedDeltaNet: SiLU after the conv, then torch.split into q, k, v; here each part contiguous."""
    mixed = _inputs(dtype)["mixed"]
    got = OPS.silu_qkv(mixed, KEY_DIM, VALUE_DIM)
    want = torch.split(F.silu(mixed), [KEY_DIM, KEY_DIM, VALUE_DIM], dim=-1)
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous() and torch.equal(g, w)


def _calls(a):
    return {
        "rms_norm": (a["x"], a["weight"], EPS),
        "add_rms_norm": (a["x"], a["residual"], a["weight"], EPS),
        "qk_norm_rope": (a["query"], a["key"], a["q_weight"], a["k_weight"], EPS, EPS, a["cos"], a["sin"]),
        "gdn_gates": (a["a"], a["b"], a["A_log"], a["dt_bias"]),
        "gated_rms_norm": (a["x"], a["gate"], a["weight"], EPS),
        "silu_mul": (a["gate"], a["up"]),
        "sigmoid_gate": (a["x"], a["gate"]),
        "silu_qkv": (a["mixed"], KEY_DIM, VALUE_DIM),
    }


@pytest.mark.parametrize("name", list(_calls(_inputs(torch.float32))))
def test_opcheck(name):
    torch.library.opcheck(getattr(OPS, name), _calls(_inputs(torch.float32, t=9, d=16))[name])


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_plain_code_matches_eager(dtype):
    """What a compiled model forward does: the plain functions, fused by Inductor in one graph."""
    a = _inputs(dtype)

    def block(x, residual, gate, up, weight, rows, **_):
        normed, residual = ew.add_rms_norm_reference(x, residual, weight, EPS)
        h = ew.silu_mul_reference(normed, up) + ew.sigmoid_gate_reference(gate, normed)
        h = ew.gated_rms_norm_reference(h, gate, weight, EPS)
        return h, residual, ew.rms_norm_reference(h.index_select(0, rows), weight, EPS)  # the scored rows

    compiled = torch.compile(block, fullgraph=True)(**a)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for got, want in zip(compiled, block(**a)):
        torch.testing.assert_close(got, want, **tol)


def test_ops_compile_fullgraph():
    a = _inputs(torch.float32)

    def f(x, residual, gate, up, weight, rows, **_):
        normed, residual = OPS.add_rms_norm(x, residual, weight, EPS)
        h = OPS.gated_rms_norm(OPS.silu_mul(normed, up), OPS.sigmoid_gate(gate, x), weight, EPS)
        return residual, OPS.rms_norm(h.index_select(0, rows), weight, EPS)  # the scored rows

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


# the forward's own layouts at the 27B shape: column views of stacked projections, the query half of q|gate
# every kernel rounds like the plain code; the norms sum the squares in ATen's order (or take ATen's mean)
TRITON_OPS = ("silu_mul", "sigmoid_gate", "gdn_gates", "rms_norm", "add_rms_norm", "gated_rms_norm", "qk_norm_rope",
              "silu_qkv")
TRITON_FUNCTION = {"rms_norm": "rms_norm", "add_rms_norm": "rms_norm", "gated_rms_norm": "gated_rms_norm",
                   "qk_norm_rope": "norm_rope", "silu_mul": "silu_mul", "sigmoid_gate": "sigmoid_gate",
                   "gdn_gates": "gdn_gates", "silu_qkv": "silu_qkv"}


def _forward_layout(name, dtype, t, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dt)

    if name == "silu_mul":  # MLP gate|up, one [T, 2 * 17408] GEMM output
        return tuple(r(t, 2 * 17408, scale=2.0).split(17408, dim=-1))
    if name == "silu_qkv":  # the GDN conv's output [T, 2 * 2048 + 6144] (fla's conv writes it contiguous)
        return r(t, 2 * 2048 + 6144, scale=3.0), 2048, 6144
    if name == "sigmoid_gate":  # attention output [T, 24, 256] and the gate half of q|gate
        return r(t, 24, 256), r(t, 24, 512, scale=2.0).chunk(2, dim=-1)[1]
    if name == "gdn_gates":  # b and a: the last 2 x 48 columns of the GDN's stacked projection
        proj = r(t, 16384 + 96, scale=2.0)
        return proj[:, -48:], proj[:, -96:-48], r(48, dt=torch.float32), r(48)
    if name == "rms_norm":
        return r(t, 5120, scale=3.0), r(5120, scale=0.1), 1e-6
    if name == "add_rms_norm":
        return r(t, 5120), r(t, 5120, scale=4.0), r(5120, scale=0.1), 1e-6
    if name == "gated_rms_norm":  # core [T, 48, 128]; z: a column view of the stacked projection
        return r(t, 48, 128), r(t, 16384 + 96)[:, 10240:16384].reshape(t, 48, 128), 1 + r(128, scale=0.1), 1e-6
    if name == "qk_norm_rope":  # query half of q|gate [T, 24, 512]; key: columns of the stacked q|k|v
        angles = torch.rand(t, 64, generator=gen, device="cuda") * 100
        query = r(t, 24, 512).chunk(2, dim=-1)[0]
        key = r(t, 24 * 512 + 2 * 1024)[:, 24 * 512:24 * 512 + 1024].reshape(t, 4, 256)
        return (query, key, r(256, scale=0.1), r(256, scale=0.1), 1e-6, 1e-6, angles.cos().to(dtype),
                angles.sin().to(dtype))
    raise KeyError(name)


def _units_apart(got, want):
    """How many representable values of the dtype lie between got and want (elementwise, same-sign values)."""
    as_int = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[got.dtype]
    return (got.view(as_int).long() - want.view(as_int).long()).abs()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 15, 37, 1001])  # under and over the 16 rows where the norms sum in-kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", TRITON_OPS)
def test_triton_kernel_equals_the_plain_code(name, dtype, tokens, monkeypatch):
    """The CUDA op (Triton kernels reading the views in place) against the plain code on the same GPU: bit for bit.
    (Session 5's first version summed the norms' squares in its own order: 2-5 units apart in fp32 on up to 91% of
    values, one bf16 unit on ~1e-5 of them, enough to move mid-shape parity against stock from 0.0095 to 0.020.)"""
    from hf_openjev.ops import elementwise_triton

    calls = []
    kernel = getattr(elementwise_triton, TRITON_FUNCTION[name])
    monkeypatch.setattr(elementwise_triton, TRITON_FUNCTION[name], lambda *a, **k: calls.append(1) or kernel(*a, **k))
    args = _forward_layout(name, dtype, tokens)
    got = getattr(OPS, name)(*args)
    want = getattr(ew, f"{name}_reference")(*args)
    assert calls, f"{name}: the CUDA op fell back to the plain code for the forward's layout"
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous()
        units = _units_apart(g, w)
        mismatched = (units > 0).float().mean().item()
        print(f"{name} {dtype} T={tokens}: {mismatched:.2e} of {g.numel()} values differ, max {units.max().item()} unit")
        assert units.max().item() == 0, f"{name}: not bit-identical ({mismatched:.2e} differ)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 15, 37, 1001])
def test_triton_add_rms_norm_with_an_fp32_residual_equals_the_plain_code(tokens, monkeypatch):
    """``residual_fp32``: a bf16 layer output added to an fp32 residual runs the kernel (no fallback), the sum kept
    in fp32 and the norm in bf16, bit for bit the plain code's."""
    from hf_openjev.ops import elementwise_triton

    calls = []
    kernel = elementwise_triton.rms_norm
    monkeypatch.setattr(elementwise_triton, "rms_norm", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    x, residual, weight, eps = _forward_layout("add_rms_norm", torch.bfloat16, tokens)
    residual = residual.float() + torch.randn(residual.shape, device="cuda") * 1e-3  # off the bf16 grid
    got = OPS.add_rms_norm(x, residual, weight, eps)
    want = ew.add_rms_norm_reference(x, residual, weight, eps)
    assert calls, "the CUDA op fell back to the plain code for an fp32 residual"
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.bfloat16, torch.float32]
    for g, w in zip(got, want):
        assert _units_apart(g, w).max().item() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d", [128, 256, 5120])  # the 27B's GDN norm, q/k norm and hidden widths
def test_norms_sum_in_atens_order(d):
    """The kernels find ATen's summation order for these widths (else every norm falls back to three kernels), it
    holds on rows other than the check's own, and only packs of 16 rows or more sum in the kernel."""
    from hf_openjev.ops import elementwise_triton as et

    device = torch.device("cuda", torch.cuda.current_device())
    order = et.row_order(d, device)
    print(f"width {d}: ATen's order {order}")
    assert order is not None, f"no candidate order equals torch.mean over rows of {d}"
    gen = torch.Generator(device="cuda").manual_seed(d + 1)
    for rows in (16, 17, 1001):
        x = torch.randn(rows, d, generator=gen, device="cuda") * 7
        assert torch.equal(et._mean_squares_in_order(x, order), x.pow(2).mean(-1)), rows
    assert et._norm_order(torch.zeros(16, d, device=device, dtype=torch.bfloat16))[0]["IN_KERNEL_SUM"]
    assert not et._norm_order(torch.zeros(15, d, device=device, dtype=torch.bfloat16))[0]["IN_KERNEL_SUM"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", TRITON_OPS)
def test_opcheck_cuda(name):
    torch.library.opcheck(getattr(OPS, name), _forward_layout(name, torch.bfloat16, 19))


@pytest.mark.parametrize("name, args", [
    ("silu_mul", lambda a: (a["gate"].t(), a["up"].t())),  # a strided last dimension
    ("silu_qkv", lambda a: (a["mixed"].t().contiguous().t(), KEY_DIM, VALUE_DIM)),
    ("gated_rms_norm", lambda a: (a["x"], a["gate"], a["weight"].float(), EPS)),  # mixed dtypes
    ("add_rms_norm", lambda a: (a["x"], a["residual"].half(), a["weight"], EPS)),  # fp32 is covered, fp16 not
    ("qk_norm_rope", lambda a: (a["query"], a["key"], a["q_weight"], a["k_weight"], EPS, EPS, a["cos"][:, :3],
                                a["sin"][:, :3])),  # an odd rotary width
])
def test_cuda_kernels_fall_back_to_the_plain_code_outside_their_layouts(name, args):
    """The CUDA entry points hand what the Triton kernels do not cover to the reference (run here on the CPU,
    where they never import triton)."""
    call = args(_inputs(torch.bfloat16))
    got = getattr(ew, f"_{name}_cuda")(*call)
    want = getattr(ew, f"{name}_reference")(*call)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)


def test_the_cuda_add_rms_norm_hands_an_fp32_residual_to_the_kernel(monkeypatch):
    """``residual_fp32``'s layout (bf16 x, fp32 residual) goes to the Triton kernel, not the three-kernel fallback
    (the kernel stood in for here; its arithmetic is checked on the GPU above)."""
    calls = []

    class Kernels:
        @staticmethod
        def rms_norm(x, weight, eps, residual=None):
            calls.append(residual.dtype)
            return "kernel"

    monkeypatch.setattr(ew, "_triton", lambda: Kernels)
    a = _inputs(torch.bfloat16)
    assert ew._add_rms_norm_cuda(a["x"], a["residual"].float(), a["weight"], EPS) == "kernel"
    assert ew._add_rms_norm_cuda(a["x"], a["residual"], a["weight"], EPS) == "kernel"
    assert calls == [torch.float32, torch.bfloat16]


def test_the_kernels_refuse_offsets_past_int32():
    assert ew._kernel_can_read(torch.empty(4096, 34816, device="meta")[:, :17408])  # the MLP's gate at 4,096 tokens
    assert not ew._kernel_can_read(torch.empty(2**16, 2**15 + 1, device="meta"))  # -> the plain code instead
    assert not ew._kernel_can_read(torch.empty(8, 16).t())  # a strided last dimension

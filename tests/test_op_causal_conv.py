"""torch.ops.hf_openjev.causal_conv1d_packed: reference vs stock transformers conv (state prepended) and the
sync-free torch path; opcheck; compile; GPU (fla with chunk_indices, torch without)."""

import random

import pytest
import torch
import torch.nn.functional as F
from conftest import random_lengths
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, causal_conv1d_update

from hf_openjev.ops._checks import capture_replay, conv_inputs, max_errors, split_lengths, to_device
from hf_openjev.ops.causal_conv import causal_conv1d_packed_reference, causal_conv1d_packed_torch

OP = torch.ops.hf_openjev.causal_conv1d_packed
C, K = 37, 4

_rng = random.Random(99)
CONFIGS = [[1], [2, 3, 1], [4, 5, 300], random_lengths(_rng, 5), random_lengths(_rng, 16, hi=40)]


def _stock(args):
    """Per sequence: transformers' causal_conv1d_update = F.conv1d over (state ++ x) + SiLU; state updated."""
    cu = args["cu_seqlens"].tolist()
    ys, states = [], []
    for i in range(len(cu) - 1):
        x = args["x"][cu[i] : cu[i + 1]].t().unsqueeze(0)  # [1, C, L]
        state = args["initial_state"][i : i + 1].clone()  # [1, C, K], updated in place
        ys.append(causal_conv1d_update(x, state, args["weight"], None, "silu")[0].t())
        states.append(state[0])
    return torch.cat(ys), torch.stack(states)


@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("lengths", CONFIGS, ids=lambda ls: f"n{len(ls)}_t{sum(ls)}")
def test_reference_matches_stock_conv_and_torch_path(lengths, state):
    args = conv_inputs(lengths, C, K, state=state, seed=len(lengths))
    y, s = causal_conv1d_packed_reference(**args)
    y_stock, s_stock = _stock(args)
    assert y.shape == (sum(lengths), C) and s.shape == (len(lengths), C, K)
    torch.testing.assert_close(y, y_stock, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_stock, atol=0, rtol=0)
    y_t, s_t = causal_conv1d_packed_torch(args["x"], args["weight"], args["cu_seqlens"], args["initial_state"])
    torch.testing.assert_close(y_t, y, atol=1e-6, rtol=1e-6)
    assert torch.equal(s_t, s)


def test_without_state_equals_stock_prefill_conv():
    args = conv_inputs([9, 130], C, K, state=False, seed=1)
    y, _ = OP(**args)
    cu = args["cu_seqlens"].tolist()
    for i in range(2):
        x = args["x"][cu[i] : cu[i + 1]].t().unsqueeze(0)
        torch.testing.assert_close(y[cu[i] : cu[i + 1]], causal_conv1d_fn(x, args["weight"], None, "silu")[0].t())


def test_state_is_the_last_k_inputs_and_chains():
    """Running a sequence in two pieces, passing the final state on, equals running it whole."""
    args = conv_inputs([150], C, K, state=True, seed=2)
    y_full, s_full = OP(**args)
    for cut in (1, 2, 64, 149):
        a = {**args, "x": args["x"][:cut], "cu_seqlens": torch.tensor([0, cut])}
        y_a, s_a = OP(**a)
        b = {**args, "x": args["x"][cut:], "cu_seqlens": torch.tensor([0, 150 - cut]), "initial_state": s_a}
        y_b, s_b = OP(**b)
        torch.testing.assert_close(torch.cat([y_a, y_b]), y_full, atol=1e-6, rtol=1e-6)
        assert torch.equal(s_b, s_full)
    assert torch.equal(s_full[0], args["x"][-K:].t())


def test_zero_length_sequence():
    args = conv_inputs([3, 4], C, K, state=True, seed=3)
    args["cu_seqlens"] = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    args["initial_state"] = torch.randn(3, C, K)
    y, s = OP(**args)
    assert torch.equal(s[1], args["initial_state"][1])
    y_t, s_t = causal_conv1d_packed_torch(args["x"], args["weight"], args["cu_seqlens"], args["initial_state"])
    torch.testing.assert_close(y_t, y, atol=1e-6, rtol=1e-6)
    assert torch.equal(s_t, s)


def test_bf16():
    args = conv_inputs([70, 3], C, K, dtype=torch.bfloat16, seed=4)
    y, s = OP(**args)
    assert y.dtype == s.dtype == torch.bfloat16
    fp32 = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in args.items()}
    y32, s32 = causal_conv1d_packed_reference(**fp32)
    torch.testing.assert_close(y.float(), y32, atol=2e-2, rtol=2e-2)
    assert torch.equal(s.float(), s32)


@pytest.mark.parametrize("state", [False, True])
def test_bf16_rounds_like_the_stock_conv(state):
    """bf16: the conv is rounded before the SiLU, as transformers' conv (a bf16 F.conv1d, then the activation)."""
    args = conv_inputs([70, 3, 130], C, K, dtype=torch.bfloat16, state=state, seed=6)
    y, s = causal_conv1d_packed_reference(**args)
    y_stock, s_stock = _stock(args)
    assert torch.equal(s, s_stock)
    assert (y != y_stock).float().mean() < 1e-3  # equal but for rare 1-ulp ties of the conv's accumulation order
    torch.testing.assert_close(y, y_stock, atol=1e-2, rtol=1e-2)
    y_t, _ = causal_conv1d_packed_torch(args["x"], args["weight"], args["cu_seqlens"], args["initial_state"])
    assert torch.equal(y_t, y)


def test_cpu_op_is_the_reference():
    args = conv_inputs([33, 90, 1], C, K, seed=5)
    for a, b in zip(OP(**args), causal_conv1d_packed_reference(**args)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("fla", [True, False], ids=["fla", "torch"])
def test_without_activation_or_final_states(device, fla):
    """activation=False: the conv before its SiLU (the GDN applies it with its q/k/v split); output_final_state=False:
    an empty [0, C, K] instead of the states. The sync-free torch path gives the same conv."""
    channels = 10240 if device == "cuda" else C
    args = to_device(conv_inputs([33, 90, 1, 64], channels, K, dtype=torch.bfloat16, state=True, seed=13, fla=fla),
                     device)
    y, s = OP(**args)
    pre, none = OP(**args, activation=False, output_final_state=False)
    assert torch.equal(F.silu(pre), y) and none.shape == (0, channels, K) and none.dtype == s.dtype
    positional = (args["x"], args["weight"], args["cu_seqlens"], args["initial_state"])
    pre_t, none_t = causal_conv1d_packed_torch(*positional, activation=False, output_final_state=False)
    assert none_t.shape == (0, channels, K)
    if device == "cpu" or not fla:  # the op ran the reference / the torch path itself (fla's kernel: tolerances above)
        assert torch.equal(pre_t, pre)
    torch.library.opcheck(OP, tuple(args.values()) + (False, False))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("fla", [True, False], ids=["fla", "torch"])
@pytest.mark.parametrize("tail", [1, 3, 37])
def test_rerunning_a_tail_equals_continuing_it(device, fla, tail):
    """What the fast path's tails rely on (layout_steps.GdnCall): the conv over [tail ; own] from the state before
    the tail gives the own rows and final state of the conv over own from the tail's final state, bit for bit."""
    channels = 10240 if device == "cuda" else C
    own = [5, 70, 2]
    base = to_device(conv_inputs([tail] * len(own) + own, channels, K, dtype=torch.bfloat16, seed=21, fla=fla), device)
    n, x, w = len(own), base["x"], base["weight"]
    tails, owns = x[: tail * n], x[tail * n:]  # [n * tail, C], [sum(own), C]
    start = base["initial_state"][:n]  # [n, C, K]: the state before each tail

    def run(rows, lengths, state):
        meta = conv_inputs(lengths, channels, K, fla=fla)  # only its varlen metadata is used
        args = to_device(dict(cu_seqlens=meta["cu_seqlens"], chunk_indices=meta["chunk_indices"]), device)
        return OP(rows, w, args["cu_seqlens"], state, args["chunk_indices"], False, True)

    _, after_tail = run(tails, [tail] * n, start)  # [n, C, K]
    continued, final = run(owns, own, after_tail)
    offsets = [0]
    for length in own:
        offsets.append(offsets[-1] + length)
    gathered = torch.cat([torch.cat([tails[i * tail:(i + 1) * tail], owns[offsets[i]:offsets[i + 1]]]) for i in range(n)])
    rerun, final_rerun = run(gathered, [tail + length for length in own], start)
    keep = torch.cat([torch.arange(offsets[i] + (i + 1) * tail, offsets[i + 1] + (i + 1) * tail) for i in range(n)])
    assert torch.equal(rerun[keep.to(rerun.device)], continued) and torch.equal(final_rerun, final)


def _column_view(x: torch.Tensor, extra: int = 29) -> torch.Tensor:
    """x's values as the first columns of a wider tensor: the layout of qkv split off a stacked projection."""
    wide = torch.randn(x.shape[0], x.shape[1] + extra, dtype=x.dtype, device=x.device)
    wide[:, : x.shape[1]] = x
    view = wide[:, : x.shape[1]]
    assert not view.is_contiguous() and view.stride(-1) == 1
    return view


@pytest.mark.parametrize("fla", [True, False])
def test_a_column_view_input_equals_its_contiguous_copy(fla):
    args = conv_inputs([33, 90, 1], C, K, seed=11, fla=fla)
    for a, b in zip(OP(**args), OP(**{**args, "x": _column_view(args["x"])})):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fla", [True, False])
def test_opcheck(fla):
    torch.library.opcheck(OP, tuple(conv_inputs([10, 70], C, K, seed=6, fla=fla).values()))


def test_compile_fullgraph():
    args = conv_inputs([20, 65], C, K, seed=7)

    def f(x, weight, cu_seqlens, initial_state, chunk_indices):
        y, s = OP(x + 1.0, weight, cu_seqlens, initial_state, chunk_indices)
        return y * 2.0, s

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(**args), f(**args))


def test_torch_path_compiles_fullgraph():
    """The sync-free torch path traces without graph breaks (no data-dependent shapes)."""
    args = conv_inputs([20, 65, 3], C, K, seed=8, fla=False)
    args.pop("chunk_indices")
    out = torch.compile(causal_conv1d_packed_torch, fullgraph=True, backend="aot_eager")(**args)
    torch.testing.assert_close(out, causal_conv1d_packed_reference(**args), atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------------------- GPU

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # max |err| / max |ref|


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fla", [True, False], ids=["fla", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels", [C, 10240])
@pytest.mark.parametrize("state", [False, True])
def test_cuda_matches_reference(channels, dtype, fla, state):
    lengths = random_lengths(random.Random(channels), 6, hi=700) + [1, 2, 3, 64]
    args = conv_inputs(lengths, channels, K, dtype=dtype, state=state, seed=9, fla=fla)
    y, s = OP(**to_device(args, "cuda"))
    y_ref, s_ref = causal_conv1d_packed_reference(**args)
    assert y.dtype == s.dtype == dtype
    assert max_errors(y, y_ref)[1] < TOL[dtype]
    assert torch.equal(s.cpu(), s_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fla", [True, False], ids=["fla", "torch"])
def test_cuda_column_view_input_equals_its_contiguous_copy(fla):
    """The patched GDN hands the conv qkv as a column view of the stacked projection (no copy)."""
    lengths = random_lengths(random.Random(3), 6, hi=700) + [1, 64]
    args = to_device(conv_inputs(lengths, 10240, K, dtype=torch.bfloat16, state=True, seed=12, fla=fla), "cuda")
    for a, b in zip(OP(**args), OP(**{**args, "x": _column_view(args["x"], extra=6144 + 96)})):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fla", [True, False], ids=["fla", "torch"])
def test_cuda_graph_capture_replay(fla):
    lengths = split_lengths(936, 8, random.Random(0))
    a = to_device(conv_inputs(lengths, 10240, K, dtype=torch.bfloat16, seed=1, fla=fla), "cuda")
    b = to_device(conv_inputs(lengths[::-1], 10240, K, dtype=torch.bfloat16, seed=2, fla=fla), "cuda")
    replayed, eager = capture_replay(OP, a, b)
    assert max_errors(replayed, eager)[0] == 0.0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("fla", [True, False], ids=["fla", "torch"])
def test_no_initial_state_is_zeros(device, fla):
    """``initial_state=None`` equals explicit zero states bit for bit (outputs and final states)."""
    args = to_device(conv_inputs([3, 70, 1], 10240 if device == "cuda" else C, dtype=torch.bfloat16, state=False,
                                 fla=fla), device)
    for got, want in zip(OP(**{**args, "initial_state": None}), OP(**args)):
        assert torch.equal(got, want)
    torch.library.opcheck(OP, (), {**args, "initial_state": None})


"""torch.ops.hf_openjev.gdn_prefill: reference vs token recurrence vs stock transformers; opcheck; compile; GPU."""

import random

import pytest
import torch
from conftest import random_lengths
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from hf_openjev.ops._checks import capture_replay, gdn_inputs, max_errors, split_lengths, to_device
from hf_openjev.ops.gdn_prefill import _per_sequence, gdn_prefill_reference
from hf_openjev.ops.varlen import prepare_varlen_metadata

OP = torch.ops.hf_openjev.gdn_prefill
HK, HV, DK, DV = 2, 6, 16, 12  # Hv = 3 * Hk, odd-ish head dims

def _recurrent_one(q, k, v, g, beta, state):
    """One sequence, token by token (the layouts of the reference's chunked ``_chunked_one``: q, k [L, H, Dk];
    v [L, H, Dv]; g, beta [L, H]; state [H, Dk, Dv], all fp32)."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - (state * k[t][..., None]).sum(-2)) * beta[t][:, None]  # [H, Dv]
        state = state + k[t][..., None] * delta[:, None, :]
        out[t] = (state * q[t][..., None]).sum(-2)
    return out, state


def gdn_prefill_naive(q, k, v, g, beta, cu_seqlens, initial_state, chunk_indices=None, output_final_state=True):
    """Token-by-token recurrence; the independent check of the reference."""
    return _per_sequence(_recurrent_one, q, k, v, g, beta, cu_seqlens, initial_state, output_final_state)


# a seeded sample of packings (1..16 sequences of 1..300 tokens), not the cross product
_rng = random.Random(1234)
CONFIGS = [[1], [64], [65, 1, 128], random_lengths(_rng, 4), random_lengths(_rng, 16, hi=60), random_lengths(_rng, 7)]


@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("lengths", CONFIGS, ids=lambda ls: f"n{len(ls)}_t{sum(ls)}")
def test_reference_matches_token_recurrence(lengths, state):
    args = gdn_inputs(lengths, HK, HV, DK, DV, state=state, seed=len(lengths))
    o, s = gdn_prefill_reference(**args)
    o_naive, s_naive = gdn_prefill_naive(**args)
    assert o.shape == (sum(lengths), HV, DV) and o.dtype == torch.float32
    assert s.shape == (len(lengths), HV, DK, DV) and s.dtype == torch.float32
    torch.testing.assert_close(o, o_naive, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_naive, atol=1e-5, rtol=1e-5)
    assert o.abs().max() > 1e-2  # the check is not vacuous


@pytest.mark.parametrize("state", [False, True])
def test_reference_matches_stock_transformers_per_sequence(state):
    lengths = [3, 64, 200, 129]
    args = gdn_inputs(lengths, HK, HV, DK, DV, state=state, seed=7)
    o, s = gdn_prefill_reference(**args)
    cu = args["cu_seqlens"].tolist()
    for i in range(len(lengths)):
        sl = slice(cu[i], cu[i + 1])
        per_seq = [args[n][sl].unsqueeze(0) for n in ("q", "k", "v", "g", "beta")]
        # value head h reads key head h // (HV // HK): spell the grouping out (transformers 5.17's stock function
        # expects it done by its caller; later releases do it inside, a no-op on already-equal head counts)
        per_seq[0], per_seq[1] = (x.repeat_interleave(HV // HK, dim=2) for x in per_seq[:2])
        h0 = args["initial_state"][i : i + 1]
        for stock in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
            o_ref, s_ref = stock(
                *per_seq, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
            )
            torch.testing.assert_close(o[sl], o_ref[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s[i], s_ref[0], atol=1e-5, rtol=1e-5)


def test_state_carried_across_a_64_token_split_equals_the_full_sequence():
    full = gdn_inputs([200], HK, HV, DK, DV, state=True, seed=3)
    o_full, s_full = gdn_prefill_reference(**full)
    head = {**full, **{n: full[n][:128] for n in ("q", "k", "v", "g", "beta")}, "cu_seqlens": torch.tensor([0, 128])}
    o_head, s_head = gdn_prefill_reference(**head)
    tail = {**full, **{n: full[n][128:] for n in ("q", "k", "v", "g", "beta")}, "cu_seqlens": torch.tensor([0, 72])}
    o_tail, s_tail = gdn_prefill_reference(**{**tail, "initial_state": s_head})
    torch.testing.assert_close(torch.cat([o_head, o_tail]), o_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_tail, s_full, atol=1e-5, rtol=1e-5)


def test_zero_length_sequence_keeps_its_state():
    args = gdn_inputs([5, 7], HK, HV, DK, DV, state=True, seed=5)
    args["cu_seqlens"] = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    h0 = args["initial_state"]
    args["initial_state"] = torch.cat([h0[:1], torch.randn(1, HV, DK, DV), h0[1:]])
    o, s = OP(**args)
    torch.testing.assert_close(s[1], args["initial_state"][1])
    o_naive, s_naive = gdn_prefill_naive(**args)
    torch.testing.assert_close(o, o_naive, atol=1e-5, rtol=1e-5)


def test_bf16_inputs_output_in_q_dtype():
    args = gdn_inputs([70, 5], HK, HV, DK, DV, dtype=torch.bfloat16, seed=11)
    o, s = OP(**args)
    o_naive, s_naive = gdn_prefill_naive(**args)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    torch.testing.assert_close(o.float(), o_naive.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(s, s_naive, atol=1e-4, rtol=1e-4)


def test_cpu_op_is_the_reference():
    args = gdn_inputs([33, 90, 1], HK, HV, DK, DV, seed=2)
    for a, b in zip(OP(**args), gdn_prefill_reference(**args)):
        assert torch.equal(a, b)


def test_opcheck():
    torch.library.opcheck(OP, tuple(gdn_inputs([10, 70], HK, HV, DK, DV, seed=4).values()))


def test_compile_fullgraph():
    args = gdn_inputs([20, 65], HK, HV, DK, DV, seed=6)

    def f(q, k, v, g, beta, cu_seqlens, initial_state, chunk_indices):
        o, s = OP(q * 2.0, k, v, g, beta, cu_seqlens, initial_state, chunk_indices)
        return o + 1.0, s

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(**args)
    ref = f(**args)
    torch.testing.assert_close(out, ref)


def test_bad_shapes_raise():
    args = gdn_inputs([10], HK, HV, DK, DV)
    with pytest.raises(ValueError):
        OP(**{**args, "initial_state": args["initial_state"][:, :-1]})


# ------------------------------------------------------------------------------------------------------- GPU

def _rerun_tail_vs_unaligned_handoff(device, dtype, shape):
    """A 150-token sequence, shared prefix 148 = 128 aligned + a 20-token tail, 2 own tokens. The fast path's tail
    scheme (state at 128, then [tail ; own] re-run) against the full sequence, and the unaligned handoff (state
    at 148, then own) against it. Returns (own rows: re-run, unaligned, full)."""
    hk, hv, dk, dv = shape
    args = to_device(gdn_inputs([150], hk, hv, dk, dv, dtype=dtype, state=False, seed=5), device)
    zero = args["initial_state"]

    def run(lo, hi, state):
        meta = prepare_varlen_metadata([0, hi - lo], device=device)
        part = {n: args[n][lo:hi] for n in ("q", "k", "v", "g", "beta")}
        return OP(**part, cu_seqlens=meta.cu_seqlens, initial_state=state, chunk_indices=meta.chunk_indices)

    full, _ = run(0, 150, zero)
    _, at_128 = run(0, 128, zero)
    _, at_148 = run(0, 148, zero)
    rerun, _ = run(128, 150, at_128)
    unaligned, _ = run(148, 150, at_148)
    return rerun[20:], unaligned, full[148:]


def test_rerunning_a_tail_from_the_aligned_state_equals_the_full_sequence_exactly():
    """Why the planner's tails hand on no state: re-running their rows keeps every chunk boundary where the
    unshared sequence has it, so the result is bit-identical; handing the state on at an unaligned position moves
    the boundaries and changes the rounding."""
    rerun, unaligned, full = _rerun_tail_vs_unaligned_handoff("cpu", torch.float32, (HK, HV, DK, DV))
    assert torch.equal(rerun, full)
    assert not torch.equal(unaligned, full)  # the check can fail
    torch.testing.assert_close(unaligned, full, atol=1e-5, rtol=1e-5)


GPU_SHAPES = {"small": (2, 6, 32, 48), "27b": (16, 48, 128, 128)}
TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}  # max |err| / max |ref|


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("state", [False, True])
def test_cuda_matches_reference(shape, dtype, state):
    lengths = random_lengths(random.Random(shape + str(state)), 6, hi=700) + [1, 64]
    args = gdn_inputs(lengths, *GPU_SHAPES[shape], dtype=dtype, state=state, seed=9)
    o, s = OP(**to_device(args, "cuda"))
    o_ref, s_ref = gdn_prefill_reference(**args)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert max_errors(o, o_ref)[1] < TOL[dtype] and max_errors(s, s_ref)[1] < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_replay():
    lengths = split_lengths(936, 8, random.Random(0))
    a = to_device(gdn_inputs(lengths, 16, 48, 128, 128, dtype=torch.bfloat16, seed=1), "cuda")
    b = to_device(gdn_inputs(lengths[::-1], 16, 48, 128, 128, dtype=torch.bfloat16, seed=2), "cuda")
    replayed, eager = capture_replay(OP, a, b)
    assert max_errors(replayed, eager)[0] == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_rerunning_a_tail_from_the_aligned_state_equals_the_full_sequence(dtype):
    """fla's kernel: the tail re-run equals the full sequence bit for bit; the unaligned handoff is reported."""
    rerun, unaligned, full = _rerun_tail_vs_unaligned_handoff("cuda", dtype, GPU_SHAPES["27b"])
    print(f"{dtype}: unaligned handoff max |diff| {(unaligned.float() - full.float()).abs().max().item():.3g}")
    assert torch.equal(rerun, full)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_no_initial_state_is_zeros_and_final_states_are_optional(device):
    """``initial_state=None`` equals explicit zeros bit for bit; ``output_final_state=False`` leaves the outputs
    unchanged and returns an empty [0, Hv, Dk, Dv] result."""
    shape = GPU_SHAPES["27b"] if device == "cuda" else GPU_SHAPES["small"]
    args = to_device(gdn_inputs([5, 64, 130], *shape, dtype=torch.bfloat16, state=False, seed=4), device)
    o_zeros, s_zeros = OP(**args)
    o_none, s_none = OP(**{**args, "initial_state": None})
    o_no_final, s_empty = OP(**{**args, "initial_state": None}, output_final_state=False)
    assert torch.equal(o_none, o_zeros) and torch.equal(s_none, s_zeros) and torch.equal(o_no_final, o_zeros)
    assert s_empty.shape == (0, *s_zeros.shape[1:]) and s_empty.dtype == torch.float32
    torch.library.opcheck(OP, (), {**args, "initial_state": None, "output_final_state": False})


def test_opcheck_with_precomputed_chunk_offsets():
    args = gdn_inputs([10, 70, 1], HK, HV, DK, DV, seed=5)
    meta = prepare_varlen_metadata(args["cu_seqlens"].tolist())
    o, s = OP(**args, chunk_offsets=meta.chunk_offsets)
    o_ref, s_ref = gdn_prefill_reference(**args)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)  # the CPU reference needs no offsets
    torch.library.opcheck(OP, (), {**args, "chunk_offsets": meta.chunk_offsets})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state", [False, True])
def test_cuda_step_by_step_forward_is_fla_chunk_gated_delta_rule_bit_for_bit(state):
    """``fla_chunk_forward`` (fla's kernels one by one, chunk offsets precomputed or not) and the op built on it
    give what fla's ``chunk_gated_delta_rule`` gives, bit for bit: outputs and final states."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from hf_openjev.ops._fla import fla_ready
    from hf_openjev.ops.gdn_prefill import fla_chunk_forward

    fla_ready()
    hk, hv, dk, dv = GPU_SHAPES["27b"]
    args = to_device(gdn_inputs([1, 64, 65, 200, 7, 130], hk, hv, dk, dv, dtype=torch.bfloat16, state=state,
                                seed=11), "cuda")
    meta = prepare_varlen_metadata(args["cu_seqlens"].tolist(), device="cuda")
    q, k, v, g, beta = (args[name].unsqueeze(0) for name in ("q", "k", "v", "g", "beta"))
    h0 = args["initial_state"].float()
    o_fla, s_fla = chunk_gated_delta_rule(q, k, v, g, beta, scale=dk ** -0.5, initial_state=h0,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True,
                                          cu_seqlens=meta.cu_seqlens, chunk_indices=meta.chunk_indices)
    assert o_fla.abs().max() > 1e-2  # not vacuous
    for offsets in (meta.chunk_offsets, None):
        o, s = fla_chunk_forward(q, k, v, g, beta, dk ** -0.5, h0, True, meta.cu_seqlens, meta.chunk_indices, offsets)
        assert torch.equal(o, o_fla) and torch.equal(s, s_fla)
    o_op, s_op = OP(**args, chunk_offsets=meta.chunk_offsets)
    assert torch.equal(o_op, o_fla[0]) and torch.equal(s_op, s_fla)

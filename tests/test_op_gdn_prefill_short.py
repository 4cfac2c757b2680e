"""torch.ops.hf_openjev.gdn_prefill_short: the CPU path is the reference, opcheck, fake, the level switch; GPU:
the two-launch op at its defaults (27B, 9B, 2B heads) and two more variants against the fp32 reference and the
chunked fla op, varlen, states, graph capture (the one-launch v1 is checked by recipes/gdn_short_check.py)."""

import random

import pytest
import torch
from conftest import random_lengths
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_openjev.ops._checks import capture_replay, gdn_inputs, max_errors, to_device
from hf_openjev.ops.gdn_prefill import fake_gdn_prefill, gdn_prefill_reference
from hf_openjev.ops.gdn_prefill_short import BLOCK_V, CHUNK, PRECISION, SHORT_GDN_MAX_TOKENS, use_short_gdn
from hf_openjev.ops.gdn_short_limits import check_short_shapes, dot_precision
from hf_openjev.ops.varlen import prepare_varlen_metadata

OP = torch.ops.hf_openjev.gdn_prefill_short
CHUNKED = torch.ops.hf_openjev.gdn_prefill
HK, HV, DK, DV = 2, 6, 16, 32  # Hv = 3 * Hk
ODD = [1, 2, 63, 64, 65, 107, 200]


@pytest.mark.parametrize("state", [False, True])
def test_cpu_op_is_the_reference_and_the_chunked_op(state):
    args = gdn_inputs([33, 90, 1, 64], HK, HV, DK, DV, state=state, seed=2)
    out = OP(**args)
    for ref in (gdn_prefill_reference(**args), CHUNKED(**args)):
        for a, b in zip(out, ref):
            assert torch.equal(a, b)
    assert out[0].abs().max() > 1e-2 and out[1].shape == (4, HV, DK, DV)


def test_opcheck():
    torch.library.opcheck(OP, tuple(gdn_inputs([10, 70], HK, HV, DK, DV, seed=4).values()))


def test_opcheck_with_chunk_offsets_like_the_chunked_op():
    args = gdn_inputs([10, 70, 1], HK, HV, DK, DV, seed=5)
    offsets = prepare_varlen_metadata(args["cu_seqlens"].tolist()).chunk_offsets
    for a, b in zip(OP(**args, chunk_offsets=offsets), CHUNKED(**args, chunk_offsets=offsets)):
        assert torch.equal(a, b)
    torch.library.opcheck(OP, (), {**args, "chunk_offsets": offsets})


def test_opcheck_no_state_and_no_final_state():
    args = gdn_inputs([5, 64, 13], HK, HV, DK, DV, dtype=torch.bfloat16, state=False, seed=3)
    o, s = OP(**{**args, "initial_state": None}, output_final_state=False)
    assert o.dtype == torch.bfloat16 and s.shape == (0, HV, DK, DV) and s.dtype == torch.float32
    torch.library.opcheck(OP, (), {**args, "initial_state": None, "output_final_state": False})


def test_fake_gives_the_shapes_and_dtypes_of_the_results():
    args = gdn_inputs([7, 9], HK, HV, DK, DV, dtype=torch.bfloat16, seed=1)
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        o, s = OP(**fake)
    assert o.shape == (16, HV, DV) and o.dtype == torch.bfloat16
    assert s.shape == (2, HV, DK, DV) and s.dtype == torch.float32


@pytest.mark.parametrize("final", [True, False])
def test_both_ops_fake_through_the_one_shared_fake(final):
    args = {**gdn_inputs([7, 9, 1], HK, HV, DK, DV, dtype=torch.bfloat16, seed=1), "output_final_state": final}
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        shared = fake_gdn_prefill(**fake)
        results = [shared, OP(**fake), CHUNKED(**fake)]
    assert [(o.shape, o.dtype, s.shape, s.dtype) for o, s in results] == \
        [((17, HV, DV), torch.bfloat16, (3 if final else 0, HV, DK, DV), torch.float32)] * 3
    with pytest.raises(ValueError, match="g/beta"):  # the shared fake checks the inputs like the ops
        fake_gdn_prefill(**{**args, "g": args["g"][:, :-1]})


def test_compile_fullgraph():
    args = gdn_inputs([20, 65], HK, HV, DK, DV, seed=6)

    def f(q, k, v, g, beta, cu_seqlens, initial_state, chunk_indices):
        o, s = OP(q * 2.0, k, v, g, beta, cu_seqlens, initial_state, chunk_indices)
        return o + 1.0, s

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(**args), f(**args))


def test_bad_state_shape_raises():
    args = gdn_inputs([10], HK, HV, DK, DV)
    with pytest.raises(ValueError, match="initial_state"):
        OP(**{**args, "initial_state": args["initial_state"][:, :-1]})


def test_use_short_gdn_switches_at_the_threshold():
    assert use_short_gdn(1) and use_short_gdn(SHORT_GDN_MAX_TOKENS)
    assert not use_short_gdn(SHORT_GDN_MAX_TOKENS + 1)
    assert use_short_gdn(300, threshold=512) and not use_short_gdn(65, threshold=64)
    with pytest.raises(ValueError, match="max_seq_len"):
        use_short_gdn(-1)


@pytest.mark.parametrize("dk, dv, block_v, chunk, precision, message", [
    (96, 128, 32, 16, "ieee", "Dk=96"),
    (128, 8, 8, 16, "ieee", "Dv=8"),
    (128, 128, 48, 16, "ieee", "block_v=48"),
    (64, 32, 64, 16, "ieee", "block_v=64"),
    (128, 128, 32, 8, "ieee", "chunk=8"),
    (128, 128, 32, 16, "bf16", "precision"),
])
def test_kernel_limits_are_checked_with_a_message(dk, dv, block_v, chunk, precision, message):
    q, v = torch.empty(3, 2, dk), torch.empty(3, 6, dv)
    with pytest.raises(ValueError, match=message):
        check_short_shapes(q, v, block_v, chunk, precision)
    check_short_shapes(torch.empty(3, 2, 128), torch.empty(3, 6, 128), BLOCK_V, CHUNK, PRECISION)  # the defaults


def test_dv_blocks_narrower_than_four_columns_per_warp_are_refused():
    """wy-bv16-w8-p8-s1-tf32x3 faulted on an H200 (illegal memory access): block_v 16 with 8 warps is refused."""
    q, v = torch.empty(3, 2, 128), torch.empty(3, 6, 128)
    with pytest.raises(ValueError, match="block_v=16 with num_warps=8"):
        check_short_shapes(q, v, 16, 64, "tf32x3", num_warps=8)
    check_short_shapes(q, v, 16, 64, "tf32x3", num_warps=4)
    check_short_shapes(q, v, 32, 64, "tf32x3", num_warps=8)


def test_bf16_split_precisions_are_accepted_and_run_as_ieee_off_cuda():
    for precision in ("bf16x3", "bf16x6"):
        check_short_shapes(torch.empty(3, 2, 128), torch.empty(3, 6, 128), 32, 64, precision)
        assert dot_precision(precision, on_cuda=True) == precision
        assert dot_precision(precision, on_cuda=False) == "ieee"  # Triton's interpreter lacks the bf16 splits
    assert dot_precision("tf32x3", on_cuda=False) == "tf32x3"


def test_gpu_checks_cover_the_op_shapes_states_and_dtypes_with_at_most_two_variants():
    assert {c[0] for c in GPU_CASES} == set(GPU_SHAPES) and {c[1] for c in GPU_CASES} == set(TOL)
    assert {c[2] for c in GPU_CASES} == {False, True} and len(GPU_CASES) <= 5
    assert len(EXTRA_VARIANTS) <= 2
    for variant in EXTRA_VARIANTS:
        assert variant["precision"] != PRECISION and variant["num_stages"] == 1
        check_short_shapes(torch.empty(1, 16, 128), torch.empty(1, 48, 128), variant["block_v"], CHUNK,
                           variant["precision"], variant["num_warps"])


# ------------------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = {"27b": (16, 48, 128, 128), "9b": (16, 32, 128, 128), "2b": (16, 16, 128, 128)}
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # max |err| / max |ref|, against the fp32 reference
# (shape, dtype, state) of the op's GPU checks: each distinct dtype, state flag and GROUP == 1 (2B) is one more
# Triton build, and builds dominate the file's time, so fp32 runs at one shape
GPU_CASES = [("27b", torch.bfloat16, False), ("27b", torch.bfloat16, True), ("9b", torch.bfloat16, True),
             ("2b", torch.bfloat16, True), ("27b", torch.float32, True)]
# gdn_wy_forward variants beside the op's defaults (at most two: each is two more builds)
EXTRA_VARIANTS = [dict(block_v=32, num_warps=8, prep_warps=8, num_stages=1, precision="ieee"),
                  dict(block_v=32, num_warps=8, prep_warps=8, num_stages=1, precision="bf16x3")]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _check_against_reference(args, out, dtype=torch.bfloat16, tol=None):
    o_ref, s_ref = gdn_prefill_reference(**args)
    tol = tol or TOL[dtype]
    assert out[0].dtype == o_ref.dtype and out[1].dtype == torch.float32 and out[1].shape == s_ref.shape
    assert out[0].float().isfinite().all() and out[1].isfinite().all()  # max_errors' max() would hide a NaN
    assert max_errors(out[0], o_ref)[1] < tol and max_errors(out[1], s_ref)[1] < tol


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape, dtype, state", GPU_CASES)
def test_cuda_matches_reference_and_chunked_op(shape, dtype, state):
    lengths = ODD + random_lengths(random.Random(shape + str(state)), 3, hi=300)
    args = gdn_inputs(lengths, *GPU_SHAPES[shape], dtype=dtype, state=state, seed=9)
    out = OP(**to_device(args, "cuda"))
    _check_against_reference(args, out, dtype)
    o_fla, s_fla = CHUNKED(**to_device(args, "cuda"))
    # the chunked op rounds its intermediates to the input dtype: compare at its own tolerance
    assert o_fla.float().isfinite().all()
    bound = 3e-2 + TOL[dtype]  # the chunked op's own tolerance against the reference, plus ours
    assert max_errors(out[0], o_fla)[1] < bound and max_errors(out[1], s_fla)[1] < bound


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", EXTRA_VARIANTS, ids=lambda v: f"{v['precision']}-bv{v['block_v']}")
def test_cuda_two_launch_variants_match_reference(variant):
    from hf_openjev.ops.gdn_wy_triton import gdn_wy_forward

    args = gdn_inputs([107, 1, 0, 64, 65, 200], *GPU_SHAPES["27b"], dtype=torch.bfloat16, state=True, seed=4)
    cuda = to_device(args, "cuda")
    out = gdn_wy_forward(*(cuda[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state")), **variant)
    _check_against_reference(args, out)


@pytest.mark.gpu
@needs_cuda
def test_cuda_empty_sequence_keeps_its_state_and_no_state_is_zeros():
    args = gdn_inputs([5, 7], *GPU_SHAPES["9b"], dtype=torch.bfloat16, state=True, seed=5)
    args["cu_seqlens"] = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    h0 = args["initial_state"]
    args["initial_state"] = torch.cat([h0[:1], torch.randn(1, *h0.shape[1:]), h0[1:]])
    cuda = to_device(args, "cuda")
    o, s = OP(**cuda)
    assert torch.equal(s[1].cpu(), args["initial_state"][1])
    _check_against_reference(args, (o, s))
    zeros = {**cuda, "initial_state": torch.zeros_like(cuda["initial_state"])}
    o_none, s_none = OP(**{**cuda, "initial_state": None})
    o_zeros, s_zeros = OP(**zeros)
    o_no_final, s_empty = OP(**{**cuda, "initial_state": None}, output_final_state=False)
    assert torch.equal(o_none, o_zeros) and torch.equal(s_none, s_zeros) and torch.equal(o_no_final, o_zeros)
    assert s_empty.shape == (0, *s.shape[1:])


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture_replay():
    lengths = [107, 40, 3, 64, 65]
    a = to_device(gdn_inputs(lengths, *GPU_SHAPES["27b"], dtype=torch.bfloat16, seed=1), "cuda")
    b = to_device(gdn_inputs(lengths[::-1], *GPU_SHAPES["27b"], dtype=torch.bfloat16, seed=2), "cuda")
    replayed, eager = capture_replay(OP, a, b)
    assert max_errors(replayed, eager)[0] == 0.0


@pytest.mark.gpu
@needs_cuda
def test_cuda_rerunning_a_tail_from_the_aligned_state_equals_the_full_sequence():
    """The planner's shared tails re-run their rows from the state at the last multiple of 64: with 64-token
    chunks every such point is a chunk boundary, so the re-run equals the full sequence bit for bit."""
    args = to_device(gdn_inputs([150], *GPU_SHAPES["27b"], dtype=torch.bfloat16, state=False, seed=5), "cuda")

    def run(lo, hi, state):
        part = {n: args[n][lo:hi] for n in ("q", "k", "v", "g", "beta")}
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device="cuda")
        return OP(**part, cu_seqlens=cu, initial_state=state, chunk_indices=args["chunk_indices"])

    full, _ = run(0, 150, None)
    _, at_128 = run(0, 128, None)
    rerun, _ = run(128, 150, at_128)
    assert torch.equal(rerun, full[128:])

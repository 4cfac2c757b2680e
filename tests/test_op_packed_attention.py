"""torch.ops.hf_openjev.packed_attention / prefix_attention: references vs per-sequence stock eager attention,
the sync-free masked path and the flash log-sum-exp merge (with a CPU stand-in for FA2); opcheck; compile; GPU."""

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import random_lengths
from transformers.models.qwen3_5.modeling_qwen3_5 import eager_attention_forward

from hf_openjev.ops import packed_attention as pa
from hf_openjev.ops._checks import (
    attention_inputs,
    capture_replay,
    max_errors,
    prefix_inputs,
    split_lengths,
    to_device,
)

PACKED, PREFIX = torch.ops.hf_openjev.packed_attention, torch.ops.hf_openjev.prefix_attention
CAUSAL = torch.ops.hf_openjev.causal_attention
H, HKV, D = 6, 2, 24


def _eager(q, k, v, allowed, scale):
    """Stock transformers eager attention for one sequence: q [Lq, H, D], k/v [Lk, Hkv, D], allowed [Lq, Lk]."""
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
    out, _ = eager_attention_forward(module, *(x.transpose(0, 1)[None] for x in (q, k, v)), mask, scale)
    return out[0]


def _packed_naive(args):
    cq, ck = args["cu_seqlens_q"].tolist(), args["cu_seqlens_k"].tolist()
    outs = []
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        allowed = torch.tensor([[j <= t + lk - lq for j in range(lk)] for t in range(lq)], dtype=torch.bool)
        sl = slice(ck[i], ck[i + 1])
        outs.append(_eager(args["q"][cq[i] : cq[i + 1]], args["k"][sl], args["v"][sl], allowed, args["scale"]))
    return torch.cat(outs)


def _prefix_naive(args):
    cu, starts, lengths = (args[n].tolist() for n in ("cu_seqlens", "prefix_starts", "prefix_lengths"))
    outs = []
    for i in range(len(cu) - 1):
        own, pre = slice(cu[i], cu[i + 1]), slice(starts[i], starts[i] + lengths[i])
        n, p = cu[i + 1] - cu[i], lengths[i]
        allowed = torch.tensor([[True] * p + [s <= t for s in range(n)] for t in range(n)], dtype=torch.bool)
        k = torch.cat([args["prefix_k"][pre], args["k"][own]])
        v = torch.cat([args["prefix_v"][pre], args["v"][own]])
        outs.append(_eager(args["q"][own], k, v, allowed, args["scale"]))
    return torch.cat(outs)


def _fa2_standin(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, seqused_k=None):
    """FA2 varlen semantics on CPU: offset cu_k[b], length seqused_k[b] if given; lse [H, Tq], +inf if no key."""
    o, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("inf"))
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        lq = cq[b + 1] - cq[b]
        lk = int(seqused_k[b]) if seqused_k is not None else ck[b + 1] - ck[b]
        assert lq <= max_q and lk <= max_k, "max_seqlen bounds passed to FA2 must hold"
        if lk == 0 or lq == 0:
            continue
        kk, vv = (x[ck[b] : ck[b] + lk].repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (k, v))
        s = torch.einsum("qhd,khd->hqk", q[cq[b] : cq[b + 1]], kk) * scale
        if causal:
            s = s.masked_fill(torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + lk - lq, float("-inf"))
        lse[:, cq[b] : cq[b + 1]] = s.logsumexp(-1)
        o[cq[b] : cq[b + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)
    return o, lse


_rng = random.Random(7)
PACKED_CONFIGS = [([1], [1]), ([1, 5], [9, 5]), ([3, 300, 40, 1], [3, 300, 100, 64])]
for _n in (4, 16):
    _lk = random_lengths(_rng, _n, hi=120)
    PACKED_CONFIGS.append(([_rng.randint(1, n) for n in _lk], _lk))


@pytest.mark.parametrize("lq,lk", PACKED_CONFIGS, ids=lambda x: f"n{len(x)}_t{sum(x)}")
def test_packed_reference_matches_stock_eager_and_masked(lq, lk):
    args = attention_inputs(lq, lk, H, HKV, D, seed=len(lq))
    o = pa.packed_attention_reference(**args)
    torch.testing.assert_close(o, _packed_naive(args), atol=1e-5, rtol=1e-5)
    masked = pa.packed_attention_masked(*(args[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "scale")))
    torch.testing.assert_close(masked, o, atol=1e-5, rtol=1e-5)
    assert torch.equal(PACKED(**args), o)


def test_packed_more_queries_than_keys_raises():
    with pytest.raises(ValueError):
        PACKED(**attention_inputs([5], [4], H, HKV, D))


PREFIX_CONFIGS = [  # (own lengths, prefix block lengths, block of each sequence)
    ([1], [64], [0]),
    ([5, 70, 1], [128, 64], [1, 0, 1]),
    ([9, 3, 30, 2], [64, 0, 192], [2, 1, 2, 0]),  # an empty block, blocks shared and out of order
    (random_lengths(_rng, 16, hi=50), [64, 128, 64], [_rng.randrange(3) for _ in range(16)]),
]


@pytest.mark.parametrize("lengths,prefixes,index", PREFIX_CONFIGS, ids=lambda x: f"{len(x)}_{sum(x)}")
def test_prefix_reference_matches_stock_eager_masked_and_flash_merge(lengths, prefixes, index):
    args = prefix_inputs(lengths, prefixes, index, H, HKV, D, seed=len(lengths))
    o = pa.prefix_attention_reference(**args)
    torch.testing.assert_close(o, _prefix_naive(args), atol=1e-5, rtol=1e-5)
    positional = [args[n] for n in ("q", "k", "v", "cu_seqlens", "prefix_k", "prefix_v", "prefix_starts",
                                    "prefix_lengths")]
    torch.testing.assert_close(pa.prefix_attention_masked(*positional, args["scale"]), o, atol=1e-5, rtol=1e-5)
    for bounds in ((args["max_seqlen_q"], args["max_seqlen_prefix"]), (sum(lengths), sum(prefixes))):
        merged = pa.prefix_attention_flash(*positional, args["scale"], *bounds, flash=_fa2_standin)
        torch.testing.assert_close(merged, o, atol=1e-5, rtol=1e-5)
    assert torch.equal(PREFIX(**args), o)


def test_prefix_blocks_are_any_row_ranges_of_the_pool():
    """Sequences read overlapping, nested and out-of-order row ranges of one pool in place (how the fast path reads a
    parent's keys from the whole pack's K/V); starts and lengths go to FA2 as they are."""
    args = prefix_inputs([4, 9, 2, 5], [200], [0, 0, 0, 0], H, HKV, D, seed=9)
    args.update(prefix_starts=torch.tensor([0, 10, 0, 64, 0], dtype=torch.int32),  # last entry: not read
                prefix_lengths=torch.tensor([64, 140, 0, 136], dtype=torch.int32), max_seqlen_prefix=140)
    o = pa.prefix_attention_reference(**args)
    torch.testing.assert_close(o, _prefix_naive(args), atol=1e-5, rtol=1e-5)
    positional = [args[n] for n in ("q", "k", "v", "cu_seqlens", "prefix_k", "prefix_v", "prefix_starts",
                                    "prefix_lengths")]
    torch.testing.assert_close(pa.prefix_attention_masked(*positional, args["scale"]), o, atol=1e-5, rtol=1e-5)
    merged = pa.prefix_attention_flash(*positional, args["scale"], 9, 140, flash=_fa2_standin)
    torch.testing.assert_close(merged, o, atol=1e-5, rtol=1e-5)
    whole = dict(args, prefix_starts=torch.tensor([0, 0, 0, 0, 0], dtype=torch.int32),
                 prefix_lengths=torch.tensor([200] * 4, dtype=torch.int32))
    assert max_errors(pa.prefix_attention_reference(**whole), o)[0] > 1e-3  # the ranges matter


def test_prefix_attention_is_not_plain_causal_attention():
    """Guards against a vacuous pass: the prefix really changes the output."""
    args = prefix_inputs([10, 20], [64], [0, 0], H, HKV, D, seed=3)
    plain = attention_inputs([10, 20], [10, 20], H, HKV, D)
    plain.update({n: args[n] for n in ("q", "k", "v")})
    assert max_errors(PREFIX(**args), PACKED(**plain))[0] > 1e-2


def _one_sequence(T, h, hkv, d, dtype=torch.float32, device="cpu", seed=0) -> dict:
    args = attention_inputs([T], [T], h, hkv, d, dtype=dtype, device=device, seed=seed)
    return {"q": args["q"], "k": args["k"], "v": args["v"], "scale": args["scale"]}


@pytest.mark.parametrize("T", [1, 37, 130])
def test_causal_reference_is_stock_eager_causal_attention(T):
    args = _one_sequence(T, H, HKV, D, seed=T)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    expected = _eager(args["q"], args["k"], args["v"], allowed, args["scale"])
    torch.testing.assert_close(CAUSAL(**args), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pa.causal_attention_reference(**args), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_sdpa_matches_the_reference_on_cpu(dtype):
    """The CUDA kernel's SDPA call (views of the packed rows, enable_gqa), run by the CPU's SDPA backends."""
    args = _one_sequence(91, H, HKV, D, dtype=dtype, seed=7)
    o = pa.causal_attention_sdpa(**args)
    assert o.dtype == dtype and o.shape == args["q"].shape and o.is_contiguous()
    assert max_errors(o, pa.causal_attention_reference(**args))[1] < {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]


def test_causal_attention_is_not_bidirectional():
    """Guards against a vacuous pass: a later key changes no earlier query's output, and does change its own."""
    args = _one_sequence(40, H, HKV, D, seed=8)
    changed = {**args, "k": args["k"].clone(), "v": args["v"].clone()}
    changed["k"][-1] += 1.0
    changed["v"][-1] += 1.0
    a, b = CAUSAL(**args), CAUSAL(**changed)
    assert torch.equal(a[:-1], b[:-1]) and not torch.equal(a[-1], b[-1])


def test_causal_attention_refuses_mismatched_heads():
    args = _one_sequence(5, H, HKV, D)
    with pytest.raises(ValueError, match="H a multiple of Hkv"):
        CAUSAL(args["q"][:, :5], args["k"], args["v"], 1.0)
    with pytest.raises(ValueError, match="k, v"):
        CAUSAL(args["q"], args["k"][:4], args["v"][:4], 1.0)


def test_bf16_cpu():
    args = prefix_inputs([20, 7], [64], [0, 0], H, HKV, D, dtype=torch.bfloat16, seed=4)
    fp32 = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in args.items()}
    o = PREFIX(**args)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.float(), pa.prefix_attention_reference(**fp32), atol=2e-2, rtol=2e-2)


def test_the_kernel_argument_is_checked_and_the_reference_answers_for_every_kernel():
    """On the CPU every kernel name runs the reference; a name the op does not know, or a top-left causal kernel
    given queries and keys of other lengths, is refused (also by the fake, so before anything runs)."""
    args = attention_inputs([3, 7], [3, 7], H, HKV, D)
    want = pa.packed_attention_reference(**args)
    for kernel in pa.PACKED_KERNELS:
        torch.testing.assert_close(PACKED(**args, kernel_name=kernel), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="kernel must be one of 'flash', 'efficient', got 'fa3'"):
        PACKED(**args, kernel_name="fa3")
    suffix = attention_inputs([2, 7], [5, 9], H, HKV, D)
    PACKED(**suffix, kernel_name="flash")  # bottom-right causal: fewer queries than keys
    with pytest.raises(ValueError, match="'efficient' kernel takes queries and keys of the same lengths"):
        PACKED(**suffix, kernel_name="efficient")
    assert tuple(pa.PACKED_KERNELS) == __import__("hf_openjev.fast_options").fast_options.PACKED_ATTENTION_KERNELS


def test_opcheck():
    torch.library.opcheck(PACKED, tuple(attention_inputs([3, 7], [5, 9], H, HKV, D).values()))
    torch.library.opcheck(PACKED, tuple(attention_inputs([3, 7], [3, 7], H, HKV, D).values()),
                          {"kernel_name": "efficient"})
    torch.library.opcheck(PREFIX, tuple(prefix_inputs([3, 7], [64, 2], [1, 0], H, HKV, D).values()))
    torch.library.opcheck(CAUSAL, tuple(_one_sequence(11, H, HKV, D).values()))


def test_compile_fullgraph():
    args = attention_inputs([3, 7], [5, 9], H, HKV, D)
    pargs = prefix_inputs([3, 7], [64, 2], [1, 0], H, HKV, D)

    def f(a, p):
        return PACKED(**a) * 2.0, PREFIX(**p) + 1.0

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(args, pargs), f(args, pargs))


# ------------------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = {"small": (6, 2, 64), "27b": (24, 4, 256)}
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max |err| / max |ref|
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("queries", ["all", "suffix"])
def test_cuda_packed_matches_reference(shape, dtype, queries):
    rng = random.Random(shape + queries)
    lk = random_lengths(rng, 8, hi=900) + [1]
    lq = lk if queries == "all" else [rng.randint(1, n) for n in lk]
    args = attention_inputs(lq, lk, *GPU_SHAPES[shape], dtype=dtype, seed=5)
    o = PACKED(**to_device(args, "cuda"))
    assert o.dtype == dtype and max_errors(o, pa.packed_attention_reference(**args))[1] < TOL[dtype]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kernel", ["efficient"])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_cuda_packed_kernels_match_the_reference_and_replay(shape, kernel):
    """The opt-in kernel (FastPathOptions.packed_attention) on equal query and key lengths, bf16: the reference's
    answer, and a captured graph replays new lengths of the same bucket as eager does."""
    lengths = random_lengths(random.Random(shape + kernel), 8, hi=900) + [1]
    args = attention_inputs(lengths, lengths, *GPU_SHAPES[shape], dtype=torch.bfloat16, seed=7)
    o = PACKED(**to_device(args, "cuda"), kernel_name=kernel)
    assert o.dtype == torch.bfloat16 and max_errors(o, pa.packed_attention_reference(**args))[1] < TOL[torch.bfloat16]
    split = split_lengths(936, 8, random.Random(1))
    a, b = (to_device(attention_inputs(ls, ls, 24, 4, 256, dtype=torch.bfloat16, seed=s), "cuda")
            for ls, s in ((split, 8), (split[::-1], 9)))
    replayed, eager = capture_replay(lambda **kw: PACKED(**kw, kernel_name=kernel), a, b)
    assert max_errors(replayed, eager)[0] == 0.0


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("bounds", ["tight", "static"])
def test_cuda_prefix_matches_reference(shape, dtype, bounds):
    rng = random.Random(shape)
    lengths = random_lengths(rng, 10, hi=300) + [1]
    index = [rng.randrange(4) for _ in lengths]
    args = prefix_inputs(lengths, [64, 0, 512, 1024], index, *GPU_SHAPES[shape], dtype=dtype, seed=6)
    if bounds == "static":  # no host bounds: the op falls back to Tq / P
        args.update(max_seqlen_q=0, max_seqlen_prefix=0)
    o = PREFIX(**to_device(args, "cuda"))
    assert o.dtype == dtype and max_errors(o, pa.prefix_attention_reference(**args))[1] < TOL[dtype]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [2048, 3417])
@pytest.mark.parametrize("layout", ["contiguous", "stacked"])
def test_cuda_causal_matches_reference_at_27b(T, dtype, layout):
    """cuDNN (bf16) or SDPA's fp32 kernel against the reference, on the forward's own layouts: v and k as column
    views of one stacked projection's rows (``stacked``), q contiguous."""
    args = to_device(_one_sequence(T, 24, 4, 256, dtype=dtype, seed=T), "cuda")
    if layout == "stacked":
        kv = torch.cat([args["k"].flatten(1), args["v"].flatten(1), torch.zeros_like(args["v"].flatten(1))], 1)
        args["k"], args["v"] = (kv[:, i * 1024:(i + 1) * 1024].view(T, 4, 256) for i in range(2))
        assert not args["v"].is_contiguous()
    o = CAUSAL(**args)
    ref = pa.causal_attention_reference(**args)  # plain torch on the GPU (fp32 math)
    assert o.dtype == dtype and o.is_contiguous() and max_errors(o, ref)[1] < TOL[dtype]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_capture_replay(dtype):
    lengths = split_lengths(936, 8, random.Random(0))
    a = to_device(attention_inputs(lengths, lengths, 24, 4, 256, dtype=dtype, seed=1), "cuda")
    b = to_device(attention_inputs(lengths[::-1], lengths[::-1], 24, 4, 256, dtype=dtype, seed=2), "cuda")
    replayed, eager = capture_replay(PACKED, a, b)
    assert max_errors(replayed, eager)[0] == 0.0
    index = [i % 3 for i in range(8)]
    a = to_device(prefix_inputs(lengths, [64, 128, 256], index, 24, 4, 256, dtype=dtype, seed=3), "cuda")
    b = to_device(prefix_inputs(lengths[::-1], [64, 128, 256], index[::-1], 24, 4, 256, dtype=dtype, seed=4), "cuda")
    replayed, eager = capture_replay(PREFIX, a, b)
    assert max_errors(replayed, eager)[0] == 0.0
    a, b = (to_device(_one_sequence(2100, 24, 4, 256, dtype=dtype, seed=seed), "cuda") for seed in (5, 6))
    replayed, eager = capture_replay(CAUSAL, a, b)
    assert max_errors(replayed, eager)[0] == 0.0


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_lse_merge_kernel_equals_the_reference(dtype):
    """The Triton merge against merge_by_lse_reference on the same GPU, bit for bit, with rows whose prefix part had
    no keys (FA2's +inf lse) among them."""
    from hf_openjev.ops.lse_merge_triton import merge_by_lse as merge_in_triton

    gen = torch.Generator(device="cuda").manual_seed(11)
    tq, h, d = 1001, 24, 256
    o_own, o_pre = (torch.randn(tq, h, d, generator=gen, device="cuda").to(dtype) for _ in range(2))
    lse_own, lse_pre = (torch.randn(h, tq, generator=gen, device="cuda") * 8 for _ in range(2))
    lse_pre[:, 100:137] = float("inf")
    o_pre[100:137] = float("nan")  # never read where the part is empty
    want = pa.merge_by_lse_reference(o_own, lse_own, o_pre, lse_pre)
    got = merge_in_triton(o_own, lse_own, o_pre, lse_pre)
    assert torch.equal(got, want) and torch.equal(got[100:137], o_own[100:137])
    assert torch.equal(pa.merge_by_lse(o_own, lse_own, o_pre, lse_pre), want)


def test_lse_merge_reference_drops_an_empty_part():
    o_own, o_pre = torch.randn(5, 3, 8), torch.full((5, 3, 8), float("nan"))
    lse_own, lse_pre = torch.randn(3, 5), torch.full((3, 5), float("inf"))
    assert torch.equal(pa.merge_by_lse_reference(o_own, lse_own, o_pre, lse_pre), o_own)
    assert torch.equal(pa.merge_by_lse(o_own, lse_own, o_pre, lse_pre), o_own)  # CPU: the reference

"""The ``short_gdn_tokens`` option: a Gated DeltaNet call whose longest sequence (dummies and re-run tails
included) has at most that many tokens runs ``torch.ops.hf_openjev.gdn_prefill_short``, the others the chunked
``gdn_prefill``, chosen on the host when the pack is laid out (``GdnCall.short``).

CPU, fp32: both ops run the same reference here, so scores with the option on must equal those with it off (to
fp32 rounding) and the reference path's within the fast path's gate; what is checked besides is that the short op
really runs (on the calls the threshold picks, with initial states from shared prefixes and states handed between
packs), never when the option is off, never on calls longer than the threshold, and never on heads outside the
kernel's limits; and that the flag is in the layout's cache key and the graph key. On CUDA (``-m gpu``): the
Triton kernel in the whole bf16 forward, eager and replayed from CUDA graphs, against the chunked op's scores.
"""

from __future__ import annotations

import random
import types

import pytest
import torch
from small_plans import random_token_requests
from test_fast_path import TOLERANCE, compare, random_model, random_request

from hf_openjev.fast_options import FastPathOptions
from hf_openjev.ops.gdn_prefill_short import short_gdn_fits
from hf_openjev.packing import naive_layout as nl
from hf_openjev.packing.layout_cache import shape_key
from hf_openjev.packing.pack_context import build_pack_context
from hf_openjev.packing.planner import plan_requests
from hf_openjev.patches import apply_patches, packed_candidates
from hf_openjev.scoring import score_prepared

torch.set_num_threads(1)

# GDN heads the CUDA kernel takes (Dk, Dv powers of two, Dv a multiple of its 32-column block), Hv = 2 Hk
SHORT_HEADS = dict(vocab_size=256, hidden_size=64, num_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=32, linear_value_head_dim=32)
# Dv = 24: outside the kernel's limits, so the chunked op stays whatever the option says
ODD_HEADS = dict(SHORT_HEADS, linear_value_head_dim=24)
THRESHOLD = 128  # the requests' sequences run up to 300 tokens, their shared prefixes up to 230


@pytest.fixture(scope="module")
def workload():
    model = random_model(SHORT_HEADS, seed=21, name="short-heads")
    rng = random.Random(2100)
    prepared = [random_request(rng, model.config.vocab_size) for _ in range(16)]
    reference = score_prepared(model, prepared, fast=False, batch_size=16).scores
    return types.SimpleNamespace(model=model, prepared=prepared, reference=reference)


@pytest.fixture()
def gdn_calls(monkeypatch):
    """Every GDN op call of the packed forward: (op, longest sequence, starts from given states)."""
    seen = []

    def counting(name, op):
        def call(q, k, v, g, beta, cu_seqlens, initial_state, *rest):
            seen.append((name, int(cu_seqlens.diff().max()), initial_state is not None))
            return op(q, k, v, g, beta, cu_seqlens, initial_state, *rest)
        return call

    monkeypatch.setattr(packed_candidates, "gdn_prefill", counting("chunked", packed_candidates.gdn_prefill))
    monkeypatch.setattr(packed_candidates, "gdn_prefill_short", counting("short", packed_candidates.gdn_prefill_short))
    return seen


def score(workload, **options) -> list:
    apply_patches(workload.model)
    return score_prepared(workload.model, workload.prepared, fast=True, options=FastPathOptions(**options)).scores


def max_difference(a, b) -> float:
    return max(abs(x - y) for p, q in zip(a, b, strict=True) for u, v in zip(p, q, strict=True)
               for x, y in zip(u, v, strict=True))


@pytest.mark.parametrize("limits", [{}, dict(max_sequences=3), dict(share_tails=False, min_shared_tokens=64)])
def test_short_calls_score_as_the_option_off_and_as_the_reference(workload, gdn_calls, limits):
    off = score(workload, **limits)
    assert {name for name, _, _ in gdn_calls} == {"chunked"}  # off: the short op never runs
    gdn_calls.clear()
    on = score(workload, short_gdn_tokens=THRESHOLD, **limits)
    assert max_difference(on, off) <= 1e-5
    assert compare(workload.prepared, workload.reference, on) <= TOLERANCE
    short = [(n, parents) for name, n, parents in gdn_calls if name == "short"]
    chunked = [n for name, n, _ in gdn_calls if name == "chunked"]
    assert short and chunked  # both ops ran: the threshold splits this workload's calls
    assert all(n <= THRESHOLD for n, _ in short) and all(n > THRESHOLD for n in chunked)
    assert any(parents for _, parents in short)  # short calls that continue shared prefixes (initial states)
    assert any(n % 64 and n > 64 for n, _ in short)  # odd lengths past one chunk


def test_the_threshold_is_the_longest_sequence_of_the_call(workload, gdn_calls):
    score(workload, short_gdn_tokens=THRESHOLD)
    longest = max(n for _, n, _ in gdn_calls)
    gdn_calls.clear()
    everything = score(workload, short_gdn_tokens=longest)
    assert {name for name, _, _ in gdn_calls} == {"short"}
    gdn_calls.clear()
    score(workload, short_gdn_tokens=longest - 1)
    assert [n for name, n, _ in gdn_calls if name == "chunked"] and max_difference(everything, score(workload)) <= 1e-5


def test_heads_outside_the_kernels_limits_keep_the_chunked_op(gdn_calls):
    assert short_gdn_fits(32, 32) and short_gdn_fits(128, 128)
    assert not short_gdn_fits(32, 24) and not short_gdn_fits(16, 16) and not short_gdn_fits(96, 128)
    model = random_model(ODD_HEADS, seed=22, name="odd-heads")
    apply_patches(model)
    prepared = [random_request(random.Random(7), model.config.vocab_size) for _ in range(3)]
    options = FastPathOptions(short_gdn_tokens=4096)
    plan = plan_requests([p.tokens for p in prepared])
    assert all(call.short for call in build_pack_context(plan, plan.packs[0], {}, "cpu", options).gdn_calls)
    on = score_prepared(model, prepared, fast=True, options=options).scores
    assert gdn_calls and {name for name, _, _ in gdn_calls} == {"chunked"}
    assert max_difference(on, score_prepared(model, prepared, fast=True).scores) == 0.0


# --- the flag in the layout (no model) ----------------------------------------------------------------------------

def _one_prefix_plan(prefix: int, suffixes: list[int], **plan_options):
    rng = random.Random(prefix)
    head = [rng.randrange(5, 400) for _ in range(prefix)]
    return plan_requests([[[head + [rng.randrange(5, 400) for _ in range(n)] for n in suffixes]]], **plan_options)


@pytest.mark.parametrize("pad", [False, True])
def test_a_call_is_short_up_to_its_longest_sequence(pad):
    plan = _one_prefix_plan(128, [3, 70, 9], share_tails=False, min_shared_tokens=64)  # 128 shared, then 3/70/9

    def flags(threshold):
        ctx = build_pack_context(plan, plan.packs[0], {}, "cpu", FastPathOptions(short_gdn_tokens=threshold),
                                 pad=pad)
        lengths = [int(call.cu_seqlens.diff().max()) for call in ctx.gdn_calls]
        return [call.short for call in ctx.gdn_calls], lengths

    assert flags(0)[0] == [False, False]
    _, (prefix_len, children_len) = flags(0)
    assert prefix_len == 128 and children_len >= 70  # padding may add a longer dummy; it counts
    assert flags(children_len)[0] == [False, True] and flags(children_len - 1)[0] == [False, False]
    assert flags(128)[0] == [True, True] and flags(127)[0] == [False, children_len <= 127]


def test_re_run_tails_count_in_a_gathered_calls_length():
    """Exact sharing of 100 tokens: 64 hand a state on, then one gathered call re-runs the 36-token tail before
    each candidate's own 2 or 3 tokens: sequences of 36 (the tail itself), 38 and 39 tokens."""
    plan = _one_prefix_plan(100, [2, 3])

    def flags(threshold):
        ctx = build_pack_context(plan, plan.packs[0], {}, "cpu", FastPathOptions(short_gdn_tokens=threshold))
        assert [call.rows is not None for call in ctx.gdn_calls] == [False, True]
        assert ctx.gdn_calls[1].cu_seqlens.tolist() == [0, 36, 74, 113]
        return [call.short for call in ctx.gdn_calls]

    assert flags(39) == [False, True] and flags(38) == [False, False] and flags(64) == [True, True]


def test_the_flag_is_in_the_shape_key_and_the_graph_key():
    plan = _one_prefix_plan(128, [3, 70, 9])
    keys = {shape_key(plan, plan.packs[0], {}, pad=True, merge_levels=True, dense_attention_tokens=2048,
                      short_gdn_tokens=n) for n in (0, 256)}
    assert len(keys) == 2
    graph_keys = [build_pack_context(plan, plan.packs[0], {}, "cpu", FastPathOptions(short_gdn_tokens=n),
                                     pad=True).graph_key for n in (0, 256)]
    assert graph_keys[0] != graph_keys[1]
    assert graph_keys[1] == nl.build_naive_pack_context(plan, plan.packs[0], {}, "cpu",
                                                        FastPathOptions(short_gdn_tokens=256), pad=True).graph_key


# --- CUDA (-m gpu): the Triton kernel in the whole forward, eager and replayed ------------------------------------

@pytest.fixture(scope="module")
def heads27_checkpoint(tmp_path_factory):
    """A tiny checkpoint (4 layers, hidden 256) with the 27B model's Gated DeltaNet and attention head layouts
    (tests/test_cuda_graphs.py's: fla's kernels are already tuned for it when the GPU suite runs that first)."""
    from hf_openjev.checkpoint.tiny import tiny_text_config
    from hf_openjev.export.tiny import build_tiny_checkpoint

    config = tiny_text_config(hidden_size=256, linear_num_key_heads=16, linear_num_value_heads=48,
                              linear_key_head_dim=128, linear_value_head_dim=128, num_attention_heads=24,
                              num_key_value_heads=4, head_dim=256,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                               "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    return build_tiny_checkpoint(tmp_path_factory.mktemp("heads27"), config=config)


def short_against_chunked(checkpoint, device: str, dtype, gdn_calls) -> None:
    """Scores with ``short_gdn_tokens=THRESHOLD`` (eager, then graphs where the device has them: captures, then
    replays equal to them) within 1% of the largest score of the chunked op's eager scores (bf16: one rounding step
    of a hidden row moves this model's scores by ~0.1 of ~24; a misrouted state moves them by O(score)); the short
    op ran."""
    from hf_openjev import load_export
    from hf_openjev.fast_path import score_fast
    from hf_openjev.patches import patch_record, read_options

    model = load_export(checkpoint.export, dtype=dtype, device=device)
    rng = random.Random(3)
    batches = [random_token_requests(rng, model.config.vocab_size) for _ in range(4)]
    apply_patches(model, FastPathOptions(cuda_graphs=False))
    chunked = [score_fast(model, b)[0] for b in batches]
    assert {name for name, _, _ in gdn_calls} == {"chunked"}
    eager = [score_fast(model, b, read_options(model).replace(short_gdn_tokens=THRESHOLD))[0] for b in batches]
    assert any(name == "short" for name, _, _ in gdn_calls)
    apply_patches(model, FastPathOptions(cuda_graphs=True, short_gdn_tokens=THRESHOLD))
    first = [score_fast(model, b)[0] for b in batches]  # captures (CUDA)
    again = [score_fast(model, b)[0] for b in batches]  # replays
    graphs = patch_record(model).graphs
    assert graphs is None or graphs.replays > 0
    for c, e, f, a in zip(chunked, eager, first, again, strict=True):
        assert f == a
        bound = 0.01 * max(abs(x) for x in c)
        assert max(abs(x - y) for x, y in zip(c, e, strict=True)) <= bound
        assert max(abs(x - y) for x, y in zip(c, f, strict=True)) <= bound


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_short_calls_match_the_chunked_op_eager_and_replayed_on_cuda(heads27_checkpoint, gdn_calls):
    short_against_chunked(heads27_checkpoint, "cuda", torch.bfloat16, gdn_calls)

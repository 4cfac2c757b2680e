"""The fast path (packed candidates, shared prefixes, final-row last layer) against the reference path.

CPU, fp32, several random tiny Qwen3.5 configs (4..8 layers with both layer types, GDN value heads a multiple of
key heads, hidden <= 128), token-id requests crafted for the prefix tree: long shared prefixes, prefixes just
below/at/above multiples of 64, one-token suffixes, identical candidates, 1-option choices, 10-level scores,
several questions per request with and without their own shared prefix. Gate (docs/design.md "Numerics"): max |dp| <=
1e-4 and the same decisions, for the default plan, for plans split across packs (states handed over between
forwards) and with each patch switched off in turn. Sabotage tests show that the gate fails when a state is
not handed over.

Models are built here (no tokenizer); ``tiny_model`` is not used, so the patches the fast path applies stay on
these private models.
"""

from __future__ import annotations

import dataclasses
import math
import random
import types

import pytest
import torch
from aligned_plans import ALIGNED
from transformers import Qwen3_5TextModel

from hf_openjev.checkpoint.backbone import make_head
from hf_openjev.checkpoint.manifest import ExportManifest
from hf_openjev.checkpoint.tiny import tiny_text_config
from hf_openjev.contract import answers_from_scores, parse_request
from hf_openjev.fast_options import FastPathOptions
from hf_openjev.model import JevModel
from hf_openjev.packing.planner import plan_requests
from hf_openjev.patches import apply_patches, patch_record, read_options
from hf_openjev.scoring import PreparedRequest, build_answer, score_prepared, use_fast_path

DEFAULTS = FastPathOptions()  # the fast path's options as packing receives them

torch.set_num_threads(1)

TOLERANCE = 1e-4
TIE = 1e-6
TEMPERATURE = 1.7

# (name, tiny_text_config overrides): 4..8 layers, both layer types (last layer of either type), GQA, GDN value
# heads 1x/2x/3x the key heads, hidden 48..128
CONFIGS = {
    "l4-h64": dict(vocab_size=256, hidden_size=64, num_layers=4),  # L L L F, Hv = 3 Hk
    "l6-h96-lastlinear": dict(vocab_size=300, hidden_size=96, num_layers=6,
                              layer_types=["full_attention", "linear_attention", "linear_attention",
                                           "full_attention", "linear_attention", "linear_attention"],
                              num_attention_heads=4, num_key_value_heads=1, linear_num_key_heads=1,
                              linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=24),
    "l8-h128": dict(vocab_size=400, hidden_size=128, num_layers=8, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                     "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
    "l5-h48": dict(vocab_size=200, hidden_size=48, num_layers=5,
                   layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                                "full_attention"],
                   num_attention_heads=2, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=2),
}
REQUESTS_PER_CONFIG = 60


def build_model(name: str, seed: int) -> JevModel:
    """A random fp32 CPU JevModel of ``CONFIGS[name]`` (:func:`random_model`)."""
    return random_model(CONFIGS[name], seed, name)


def random_model(overrides: dict, seed: int, name: str = "custom") -> JevModel:
    """A random fp32 CPU JevModel of ``tiny_text_config(**overrides)``: non-zero norm weights, slow-decaying GDN heads
    (long memory), random head."""
    config = tiny_text_config(initializer_range=0.05, **overrides)
    torch.manual_seed(seed)
    backbone = Qwen3_5TextModel(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in backbone.named_parameters():
            if pname.endswith("linear_attn.norm.weight"):  # gated RMSNorm: weight * x
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif pname.endswith("norm.weight"):  # zero-centred RMSNorm: (1 + weight) * x
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif pname.endswith("A_log"):  # half the heads remember for hundreds of tokens
                decay = torch.rand(p.shape, generator=gen) * 0.05 + 0.002
                decay[::2] = torch.rand(p[::2].shape, generator=gen) * 4 + 0.5
                p.copy_(decay.log())
            elif pname.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    weight = torch.randn(1, config.hidden_size, generator=gen) * 3 / config.hidden_size**0.5
    manifest = ExportManifest(model_id=f"random-{name}", base_revision="random", checkpoint_revision="random",
                              temperature=TEMPERATURE, max_length=4096, chat_prefix="", chat_suffix="",
                              head_weight=tuple(weight.flatten().tolist()), head_bias=0.1)
    return JevModel(backbone, make_head(manifest.head_weight, manifest.head_bias, "cpu"), None, manifest,
                    method="random")


# --- random requests with a crafted prefix structure --------------------------------------------------------------

def random_question(rng: random.Random, q: int) -> dict:
    kind = rng.choice(["choice", "choice", "score", "noul"])
    if kind == "choice":
        n = rng.choice([1, 1, 2, 3, 4, 6])
        return {"type": "choice", "instructions": f"q{q}", "criteria": {f"o{i}": None for i in range(n)}}
    if kind == "score":
        n = rng.choice([10, 10, 2, 3, 5])
        return {"type": "score", "instructions": f"q{q}", "criteria": [f"level {i}" for i in range(n)]}
    return {"type": "noul", "instructions": f"q{q}"}


def random_request(rng: random.Random, vocab: int, max_len: int = 300) -> PreparedRequest:
    """Request prefix, then per question an optional question prefix, then each candidate's own tokens."""
    questions = {f"q{q}": random_question(rng, q) for q in range(rng.choice([1, 1, 2, 3, 4]))}
    parsed = parse_request({"state": "x", "questions": questions})

    def tokens(n):
        return [rng.randrange(vocab) for _ in range(n)]

    rp = rng.choice([0, 1, 5, 63, 64, 65, 100, 127, 128, 129, 191, 192, 193, 230])
    prefix = tokens(rp)
    same_question_prefix = rng.random() < 0.25  # then the questions' common prefix extends the request prefix
    shared_qp = tokens(rng.choice([1, 63, 64, 65]))
    identical = rng.random() < 0.15
    out = []
    for question in parsed.questions:
        room = max_len - rp - 12
        qp = shared_qp if same_question_prefix else tokens(min(room, rng.choice([0, 0, 2, 63, 64, 65, 70, 128])))
        own_len = rng.choice([1, 1, 1, 2, 3, 5, 9])
        first = tokens(own_len)
        cands = []
        for _ in question.prompts:
            own = first if identical else tokens(rng.choice([own_len, 1, 2, 4]))
            cands.append(prefix + qp + own)
        out.append(cands)
    return PreparedRequest(parsed, out)


def probabilities(parsed, scores) -> dict[str, list[float]]:
    """Every probability the response reports (choice/score distributions; noul as [1 - p, p])."""
    out = {}
    for qid, a in answers_from_scores(parsed, scores, TEMPERATURE).items():
        out[qid] = [1.0 - a["noul"], a["noul"]] if a["type"] == "noul" else list(a["probabilities"].values())
    return out


def decision(p: list[float]) -> int:
    """The decision of a question: the first most probable candidate (noul: yes iff p > 1/2)."""
    return max(range(len(p)), key=lambda i: (p[i], -i))


def abs_dp(prepared, reference, scores) -> list[float]:
    """|dp| of every probability of every answer against the reference's."""
    out = []
    for p, ref, got in zip(prepared, reference, scores, strict=True):
        p_ref, p_got = probabilities(p.parsed, ref), probabilities(p.parsed, got)
        for qid in p_ref:
            out += [abs(x - y) for x, y in zip(p_ref[qid], p_got[qid], strict=True)]
    return out


def max_dp(prepared, reference, fast) -> float:
    return max(abs_dp(prepared, reference, fast), default=0.0)


def compare(prepared, reference, fast) -> float:
    """Max |dp| over every probability of every answer; asserts the same decisions.

    Identical candidates (exact ties in the reference) are broken by rounding noise; a different pick is accepted
    only between candidates whose reference probabilities are equal to within TIE (100x below the gate).
    """
    worst, decided = 0.0, 0
    for p, ref, got in zip(prepared, reference, fast, strict=True):
        p_ref, p_got = probabilities(p.parsed, ref), probabilities(p.parsed, got)
        for qid in p_ref:
            a, b = p_ref[qid], p_got[qid]
            worst = max(worst, max(abs(x - y) for x, y in zip(a, b, strict=True)))
            i, j = decision(a), decision(b)
            if i != j:
                assert abs(a[i] - a[j]) <= TIE, f"decision flip on {qid}: {a} vs {b}"
            else:
                decided += 1
    assert decided >= len(prepared)  # almost every decision is a real one
    return worst


# the largest config's tests take 5-20 s each on 2 cores: slow (`pytest -m "not slow"` runs the other three)
SLOW_CONFIGS = {"l8-h128"}


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CONFIGS else name
                                        for name in CONFIGS])
def workload(request):
    name = request.param
    seed = list(CONFIGS).index(name)
    model = build_model(name, seed)
    rng = random.Random(1000 + seed)
    prepared = [random_request(rng, model.config.vocab_size) for _ in range(REQUESTS_PER_CONFIG)]
    reference = score_prepared(model, prepared, fast=False, batch_size=16)
    return types.SimpleNamespace(name=name, model=model, prepared=prepared, reference=reference.scores)


def test_workload_covers_the_cases(workload):
    prepared = workload.prepared
    lengths = [len(s) for p in prepared for s in p.sequences]
    assert max(lengths) <= 300
    kinds = [(q.type, len(q.prompts)) for p in prepared for q in p.parsed.questions]
    assert ("choice", 1) in kinds and ("score", 10) in kinds and any(k == "noul" for k, _ in kinds)
    assert any(len(p.parsed.questions) >= 3 for p in prepared)
    plan = plan_requests([p.tokens for p in prepared], **ALIGNED)  # cases of the aligned layout (tails: below)
    by_len = [len(s.tokens) for s in plan.segments if s.leaf is None]
    assert sum(plan.shared_tokens) > 0 and max(by_len) >= 192
    prefixes = {s.id for s in plan.segments if s.leaf is None}
    assert any(s.parent in prefixes and plan.segments[s.parent].parent is not None for s in plan.segments)  # 2 levels
    assert any(s.leaf is not None and len(s.tokens) == 1 and s.parent is not None for s in plan.segments)
    ends = {s.end % 64 for s in plan.segments if s.leaf is None}
    assert ends == {0}
    # sequences whose common prefix is not a multiple of 64 (the planner cuts below it)
    assert any(len(s.tokens) > 1 and s.parent is not None and s.leaf is not None for s in plan.segments)


def run_fast(workload, **changes):
    """The fast path with the options the model is patched with, ``changes`` changed."""
    options = read_options(workload.model).replace(**changes)
    result = score_prepared(workload.model, workload.prepared, fast=True, options=options)
    assert all(math.isfinite(x) for p in result.scores for q in p for x in q)
    return result


def test_default_fast_path_matches_the_reference(workload):
    apply_patches(workload.model)
    fast = run_fast(workload)
    worst = compare(workload.prepared, workload.reference, fast.scores)
    assert worst <= TOLERANCE
    expected = plan_requests([p.tokens for p in workload.prepared]).shared_tokens
    assert [c["shared_tokens"] for c in fast.prefix_cache] == expected
    assert all(c["enabled"] and c["mode"] == "prefix-tree" for c in fast.prefix_cache)


@pytest.mark.parametrize("limits", [dict(max_sequences=3, max_tokens=4096), dict(max_sequences=16, max_tokens=80),
                                    dict(max_sequences=1, max_tokens=4096)])
def test_plans_split_across_packs_match_the_reference(workload, limits):
    apply_patches(workload.model)
    plan = plan_requests([p.tokens for p in workload.prepared], **limits)
    assert any(pack.external for pack in plan.packs)  # states really are handed to later forwards
    fast = run_fast(workload, **limits)
    assert compare(workload.prepared, workload.reference, fast.scores) <= TOLERANCE


@pytest.mark.parametrize("flag, value", [("compile_elementwise", True), ("gdn_fp32", True), ("residual_fp32", True)])
def test_each_numerics_option_flipped_matches_the_reference(workload, flag, value):
    """On an fp32 model on the CPU each option keeps the plain fp32 path (compiling is CUDA-only; the reference GDN
    is fp32 inside; the residual is fp32 already), so the scores equal the default's exactly; what they change in
    bf16 on the GPU is measured there."""
    apply_patches(workload.model)
    default = run_fast(workload).scores
    assert getattr(FastPathOptions(), flag) is not value
    record = apply_patches(workload.model, FastPathOptions(**{flag: value}))
    try:
        assert getattr(record.options, flag) is value
        fast = run_fast(workload)
        assert fast.scores == default
        assert compare(workload.prepared, workload.reference, fast.scores) <= TOLERANCE
    finally:
        apply_patches(workload.model)


def test_the_packed_attention_kernel_reaches_the_op(workload, monkeypatch):
    """``packed_attention`` names the kernel of a packed level's attention: the forward hands it to the op (on the
    CPU every kernel runs the reference, so the scores are the default's exactly)."""
    from hf_openjev.patches import packed_candidates

    apply_patches(workload.model)
    default = run_fast(workload).scores
    kernels = []

    def recorded(*args):
        kernels.append(args[-1])
        return torch.ops.hf_openjev.packed_attention(*args)

    monkeypatch.setattr(packed_candidates, "packed_attention", recorded)
    assert run_fast(workload, packed_attention="efficient").scores == default
    assert kernels and set(kernels) == {"efficient"}
    kernels.clear()
    run_fast(workload)
    assert kernels and set(kernels) == {"flash"}


@pytest.mark.parametrize("flag", ["packed_candidates", "shared_prefix", "final_row_mlp"])
def test_each_patch_switched_off_matches_the_reference(workload, flag):
    record = apply_patches(workload.model, FastPathOptions(**{flag: False}))
    try:
        assert record.options == dataclasses.replace(FastPathOptions(), **{flag: False})
        fast = run_fast(workload)
        assert compare(workload.prepared, workload.reference, fast.scores) <= TOLERANCE
        sharing = flag != "shared_prefix"
        assert all(c["enabled"] is sharing for c in fast.prefix_cache)
        if not sharing:
            assert all(c == {"enabled": False, "mode": "none", "shared_tokens": 0} for c in fast.prefix_cache)
    finally:
        apply_patches(workload.model)


TAILS = dict(share_tails=True, min_shared_tokens=1)  # every common prefix shared exactly, its tail re-run in the GDN


@pytest.mark.parametrize("limits", [{}, dict(max_sequences=3, max_tokens=4096), dict(max_sequences=16, max_tokens=80)])
def test_shared_tails_match_the_reference(workload, limits):
    apply_patches(workload.model)
    tokens = [p.tokens for p in workload.prepared]
    plan = plan_requests(tokens, **TAILS, **limits)
    segments = plan.segments
    assert any(not s.hands_state for s in segments)  # tails ...
    if not limits:  # ... continued by a prefix that hands on a state (trees too large for a pack have no tails)
        assert any(s.hands_state and s.leaf is None and s.start % 64 for s in segments)
    assert sum(plan.shared_tokens) > sum(plan_requests(tokens, **ALIGNED, **limits).shared_tokens)
    fast = run_fast(workload, **TAILS, **limits)
    assert compare(workload.prepared, workload.reference, fast.scores) <= TOLERANCE
    assert [c["shared_tokens"] for c in fast.prefix_cache] == plan.shared_tokens


def test_requests_scored_one_at_a_time_match_those_scored_together(workload):
    apply_patches(workload.model)
    together = run_fast(workload).scores
    for p, scores in zip(workload.prepared[:12], together):
        alone = score_prepared(workload.model, [p], fast=True).scores[0]
        assert [len(q) for q in alone] == [len(q) for q in scores]
        assert max(abs(a - b) for qa, qb in zip(alone, scores) for a, b in zip(qa, qb)) <= 1e-5


# --- edge cases, defaults, and proof that the gate can fail ------------------------------------------------------

def crafted_requests(vocab: int) -> list[PreparedRequest]:
    rng = random.Random(7)

    def t(n):
        return [rng.randrange(vocab) for _ in range(n)]

    def req(questions, tokens):
        return PreparedRequest(parse_request({"state": "x", "questions": questions}), tokens)

    one = {"q": {"type": "choice", "instructions": "x", "criteria": {"only": None}}}
    noul = {"q": {"type": "noul", "instructions": "x"}}
    two = {"q": {"type": "choice", "instructions": "x", "criteria": {"a": None, "b": None}}}
    ten = {"q": {"type": "score", "instructions": "x", "criteria": [str(i) for i in range(10)]}}
    p64, p128, p129, p255 = t(64), t(128), t(129), t(255)
    return [
        req(one, [[t(1)]]),  # a one-token sequence
        req(noul, [[t(64)]]), req(noul, [[t(128)]]), req(noul, [[t(129)]]),  # alone, at chunk multiples
        req(two, [[p64 + t(1), p64 + t(1)]]),  # common 64, shortest 65: 64 shared, one-token suffixes
        req(two, [[p64, p64 + t(5)]]),  # one candidate is a prefix of the other: nothing shared
        req(two, [[p128 + t(1), p128]]),  # 64 shared, then 64 (+1) own tokens
        req(two, [[p129, p129]]),  # identical: 128 shared, one own token each
        req(ten, [[p255 + [i] for i in range(10)]]),  # ten one-token suffixes after 192 shared tokens
        req({"a": two["q"], "b": ten["q"], "c": noul["q"]},  # request prefix 128, question prefixes 64
            [[p128 + p64 + t(2), p128 + p64 + t(3)], [p128 + p129 + [i] for i in range(10)], [p128 + t(40)]]),
    ]


@pytest.fixture(scope="module")
def sensitive():
    """One config, crafted requests plus long-prefix one-token-suffix requests, and their reference scores."""
    model = build_model("l6-h96-lastlinear", 11)
    vocab = model.config.vocab_size
    rng = random.Random(5)
    prepared = crafted_requests(vocab)
    for n in (130, 200, 250):
        prefix = [rng.randrange(vocab) for _ in range(n)]
        questions = {"s": {"type": "score", "instructions": "x", "criteria": [str(i) for i in range(10)]},
                     "c": {"type": "choice", "instructions": "x", "criteria": {"a": None, "b": None, "c": None}}}
        tokens = [[prefix + [rng.randrange(vocab)] for _ in range(10)],
                  [prefix + [rng.randrange(vocab) for _ in range(3)] for _ in range(3)]]
        prepared.append(PreparedRequest(parse_request({"state": "x", "questions": questions}), tokens))
    reference = score_prepared(model, prepared, fast=False).scores
    return types.SimpleNamespace(model=model, prepared=prepared, reference=reference)


@pytest.mark.parametrize("limits", [{}, dict(max_sequences=2), dict(max_sequences=1, max_tokens=64)])
def test_crafted_edge_cases_match_the_reference(sensitive, limits):
    apply_patches(sensitive.model)
    options = FastPathOptions(**ALIGNED, **limits)  # the aligned layout, whose shared tokens are listed below
    fast = score_prepared(sensitive.model, sensitive.prepared, fast=True, options=options)
    assert compare(sensitive.prepared, sensitive.reference, fast.scores) <= TOLERANCE
    plan = plan_requests([p.tokens for p in sensitive.prepared], **ALIGNED)
    assert [c["shared_tokens"] for c in fast.prefix_cache] == plan.shared_tokens
    assert plan.shared_tokens[:6] == [0, 0, 0, 0, 64, 0]
    assert plan.shared_tokens[6:10] == [64, 128, 192 * 9, 128 * 12 + 64 + 128 * 9]


@pytest.mark.parametrize("limits", [{}, dict(max_sequences=2), dict(max_sequences=1, max_tokens=64)])
def test_crafted_edge_cases_match_the_reference_with_the_default_exact_sharing(sensitive, limits):
    apply_patches(sensitive.model)
    fast = score_prepared(sensitive.model, sensitive.prepared, fast=True, options=FastPathOptions(**limits))
    assert compare(sensitive.prepared, sensitive.reference, fast.scores) <= TOLERANCE
    tokens = [p.tokens for p in sensitive.prepared]
    assert [c["shared_tokens"] for c in fast.prefix_cache] == plan_requests(tokens, **limits).shared_tokens
    if not limits:  # exact sharing shares more than the aligned layout on these requests
        assert sum(plan_requests(tokens).shared_tokens) > sum(plan_requests(tokens, **ALIGNED).shared_tokens)


def _zero(tensors: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in tensors.items()}


def _sabotage(kind: str, ctx) -> None:
    if kind == "external_gdn":
        ctx.external_gdn = _zero(ctx.external_gdn)
    elif kind == "external_conv":
        ctx.external_conv = _zero(ctx.external_conv)
    elif kind == "external_kv":
        ctx.external_value = _zero(ctx.external_value)
    elif kind == "parent_states":  # every sequence starts from the bank's zero row
        for call in ctx.gdn_calls:
            call.parent_rows, call.source = torch.zeros_like(call.parent_rows), None
    elif kind == "parent_chain":  # attention reads only the first half of each parent's chain of keys
        for level in ctx.levels:
            if level.has_parents:
                level.prefix_lengths = level.prefix_lengths // 2
    elif kind == "tail_rows":  # children of a tail start from the anchor's state but skip the tail's rows
        for call in ctx.gdn_calls:
            if call.rows is not None:
                own = torch.zeros_like(call.rows, dtype=torch.bool)
                own[call.keep] = True
                call.rows = torch.where(own, call.rows, call.rows[call.keep[0]])  # tail rows -> one own row
    elif kind == "positions":
        for level in ctx.levels:
            if level.has_parents:
                ctx.positions[level.lo:level.hi] += 3


@pytest.mark.parametrize("kind, limits", [
    ("external_gdn", dict(max_sequences=3)), ("external_conv", dict(max_sequences=3)),
    ("external_kv", dict(max_sequences=3)), ("parent_states", {}), ("parent_chain", {}), ("positions", {}),
    ("tail_rows", TAILS),
])
def test_the_parity_gate_fails_when_a_state_is_not_handed_over(sensitive, monkeypatch, kind, limits):
    import hf_openjev.fast_path as fast_path

    build = fast_path.build_pack_context
    hit = []

    def sabotaged(*args, **kwargs):
        ctx = build(*args, **kwargs)
        if ctx.n_external or any(level.has_parents for level in ctx.levels):
            hit.append(True)
            _sabotage(kind, ctx)
        return ctx

    apply_patches(sensitive.model)
    monkeypatch.setattr(fast_path, "build_pack_context", sabotaged)
    fast = score_prepared(sensitive.model, sensitive.prepared, fast=True, options=FastPathOptions(**limits))
    assert hit
    worst = max_dp(sensitive.prepared, sensitive.reference, fast.scores)
    print(f"sabotage {kind}: max |dp| = {worst:.3g}")
    assert worst > 100 * TOLERANCE


def test_fast_is_the_default_on_cuda_only(sensitive):
    assert use_fast_path(types.SimpleNamespace(device=torch.device("cuda", 0)), None) is True
    assert use_fast_path(types.SimpleNamespace(device=torch.device("cuda", 0)), False) is False
    assert use_fast_path(sensitive.model, None) is False
    assert use_fast_path(sensitive.model, True) is True


def test_usage_and_metadata_fast_vs_reference(sensitive):
    model = sensitive.model
    apply_patches(model)
    fast = score_prepared(model, sensitive.prepared, fast=True)
    default = score_prepared(model, sensitive.prepared)  # CPU: the reference path
    assert default.prefix_cache == [{"enabled": False, "mode": "none", "shared_tokens": 0}] * len(sensitive.prepared)
    assert default.scores == sensitive.reference
    for p, ref, got, cache in zip(sensitive.prepared, sensitive.reference, fast.scores, fast.prefix_cache):
        a = build_answer(model, p, ref, seconds=0.0, prefix_cache={"enabled": False, "mode": "none",
                                                                   "shared_tokens": 0}, method="reference")
        b = build_answer(model, p, got, seconds=0.0, prefix_cache=cache, method="fast")
        assert a["usage"] == b["usage"] == {"input_tokens": sum(len(s) for s in p.sequences), "output_tokens": 0}
        assert b["metadata"]["prefix_cache"] == cache
        assert a["metadata"]["candidate_sequences"] == b["metadata"]["candidate_sequences"]


def test_patches_stay_applied_with_the_default_options(sensitive):
    model = build_model("l4-h64", 3)
    assert patch_record(model) is None
    request = crafted_requests(model.config.vocab_size)[4]
    apply_patches(model)
    score_prepared(model, [request], fast=True)
    assert patch_record(model).options == FastPathOptions()


def test_the_fast_path_refuses_an_unpatched_model_and_names_the_verb():
    """Patching is explicit (apply_patches when the model is set up), never a side effect of scoring."""
    from hf_openjev.fast_path import score_fast

    model = build_model("l4-h64", 3)
    request = crafted_requests(model.config.vocab_size)[4]
    with pytest.raises(RuntimeError, match=r"apply_patches\(model, options\)"):
        score_fast(model, [request.tokens])
    with pytest.raises(RuntimeError, match="apply_patches"):  # before any work, not an InferenceError
        score_prepared(model, [request], fast=True)
    assert patch_record(model) is None  # nothing was patched on the way
    assert score_prepared(model, [request], fast=False).path == "reference"
    apply_patches(model)
    assert score_prepared(model, [request], fast=True).path == "fast"


def test_fresh_levels_read_no_state_and_last_levels_write_none(workload, monkeypatch):
    """The GDN passes no initial state to a level whose sequences all start fresh, and asks no final states of a
    pack's last level when nothing is exported (plans that split trees across packs do export)."""
    from hf_openjev.patches import packed_candidates

    calls = []

    def recording_gdn(*args):
        calls.append((args[6] is None, args[8]))  # (no initial state, output_final_state)
        return gdn(*args)

    gdn = packed_candidates.gdn_prefill
    monkeypatch.setattr(packed_candidates, "gdn_prefill", recording_gdn)
    apply_patches(workload.model)
    fast = run_fast(workload)
    assert compare(workload.prepared, workload.reference, fast.scores) <= TOLERANCE
    assert (True, False) in calls  # a one-level pack: no state in, none out
    assert (True, True) in calls and (False, False) in calls  # a prefix level, then its children
    assert (False, True) in calls  # split trees: states handed in and exported


def test_the_gdn_hands_on_contiguous_qkv_and_asks_only_for_states_it_reads(workload, monkeypatch):
    """The GDN kernel gets q, k, v contiguous (``silu_qkv``; fla would copy views), and the conv computes final
    states only where a later level or pack reads them (not on a pack's last level without exports)."""
    from hf_openjev.patches import packed_candidates

    qkv_layouts, conv_final_asked = [], []

    def recording_gdn(q, k, v, *args):
        qkv_layouts.append((q.is_contiguous(), k.is_contiguous(), v.is_contiguous()))
        return gdn(q, k, v, *args)

    def recording_conv(x, weight, cu_seqlens, initial_state, chunk_indices, activation, output_final_state):
        conv_final_asked.append(output_final_state)
        return conv(x, weight, cu_seqlens, initial_state, chunk_indices, activation, output_final_state)

    gdn, conv = packed_candidates.gdn_prefill, packed_candidates.causal_conv1d_packed
    monkeypatch.setattr(packed_candidates, "gdn_prefill", recording_gdn)
    monkeypatch.setattr(packed_candidates, "causal_conv1d_packed", recording_conv)
    apply_patches(workload.model)
    fast = run_fast(workload)
    assert qkv_layouts and all(layout == (True, True, True) for layout in qkv_layouts)
    assert False in conv_final_asked  # last levels without exports skip them
    assert compare(workload.prepared, workload.reference, fast.scores) <= TOLERANCE


def test_the_conv_reads_qkv_in_place_from_the_stacked_projection(workload, monkeypatch):
    """With stacked projections the GDN hands the conv qkv as a column view (no [T, C] copy per layer)."""
    from hf_openjev.patches import packed_candidates

    layouts = []

    def recording_conv(x, *args):
        layouts.append((x.is_contiguous(), x.stride(-1)))
        return causal_conv(x, *args)

    causal_conv = packed_candidates.causal_conv1d_packed
    monkeypatch.setattr(packed_candidates, "causal_conv1d_packed", recording_conv)
    apply_patches(workload.model)
    fast = run_fast(workload, **ALIGNED)  # levels that re-run a tail's rows gather them (a copy): aligned here
    assert layouts and all(layout == (False, 1) for layout in layouts)
    assert compare(workload.prepared, workload.reference, fast.scores) <= TOLERANCE


# --- torch.compile -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["padded tails (graph-ready), inductor", "split packs (states in and out), aot_eager"])
def test_the_packed_forward_compiles_without_graph_breaks(case):
    """The plugin's promise to torch.compile: the patched text model's forward over one pack context traces as ONE
    graph (``fullgraph=True``: the custom ops with their fake implementations, the context's metadata) and gives
    the eager rows, and the same exported states, within fp32 rounding."""
    from hf_openjev.family import text_model_of
    from hf_openjev.packing.pack_context import build_pack_context

    model = build_model("l4-h64", 3)
    apply_patches(model)
    text_model = text_model_of(model)
    rng = random.Random(4)
    prefix = [rng.randrange(256) for _ in range(140)]
    requests = [[[prefix + [rng.randrange(256) for _ in range(n)] for n in (3, 5, 1)]]]
    if case.startswith("padded"):  # prefix level, tail + children in one gathered GDN call, dummies
        plan, backend = plan_requests(requests, share_tails=True, min_shared_tokens=8), "inductor"
        contexts = [build_pack_context(plan, plan.packs[0], {}, "cpu", DEFAULTS, pad=True)]
        assert any(call.rows is not None for call in contexts[0].gdn_calls)
    else:  # the prefix exports its states; each candidate continues them from the bank
        plan, backend = plan_requests(requests, max_sequences=1), "aot_eager"
        store, contexts = {}, []
        with torch.no_grad():
            for pack in plan.packs:
                contexts.append(build_pack_context(plan, pack, store, "cpu", DEFAULTS))
                text_model(pack=contexts[-1])
                store.update(contexts[-1].exported)
        assert contexts[0].exports and all(ctx.n_external for ctx in contexts[1:])
    with torch.no_grad():
        for ctx in contexts:
            ctx.exported.clear()
            eager = text_model(pack=ctx)
            exported = {seg: dict(state.gdn) for seg, state in ctx.exported.items()}
            ctx.exported.clear()
            torch._dynamo.reset()
            compiled = torch.compile(lambda: text_model(pack=ctx), fullgraph=True, backend=backend)()
            assert compiled.shape == eager.shape
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
            for seg, states in exported.items():
                for layer, state in states.items():
                    torch.testing.assert_close(ctx.exported[seg].gdn[layer], state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["l5-h48", pytest.param("l6-h96-lastlinear", marks=pytest.mark.slow)])
def test_an_fp32_residual_brings_the_bf16_fast_path_closer_to_the_fp32_reference(name):
    """``residual_fp32`` on a bf16 copy of a model, against the fp32 model's reference path: its largest |dp| and the
    sum of its raw scores' errors are below the bf16 default's. The scores are where an fp32 residual stream acts
    (the head reads the rows it leaves); the probabilities' summed |dp| moves either way by a few percent, with the
    CPU's bf16 kernels (s34: at l6 1.879 against 1.846 on one machine, below it on another). On one 2-core machine
    (s34): max |dp| 0.029 vs 0.034 and summed |dscore| 16.0 vs 18.4 at l5-h48, 0.035 vs 0.045 and 31.7 vs 34.2 at l6.
    A residual left in bf16 gives the default's errors exactly, so this fails."""
    seed = list(CONFIGS).index(name)
    model = build_model(name, seed)
    rng = random.Random(1000 + seed)
    prepared = [random_request(rng, model.config.vocab_size) for _ in range(REQUESTS_PER_CONFIG)]
    reference = score_prepared(model, prepared, fast=False, batch_size=16).scores
    model.backbone.to(torch.bfloat16)
    errors, score_errors = {}, {}
    for residual_fp32 in (False, True):
        apply_patches(model, FastPathOptions(residual_fp32=residual_fp32))
        scores = score_prepared(model, prepared, fast=True).scores
        errors[residual_fp32] = abs_dp(prepared, reference, scores)
        score_errors[residual_fp32] = sum(abs(a - b) for ref, got in zip(reference, scores, strict=True)
                                          for ref_q, got_q in zip(ref, got, strict=True)
                                          for a, b in zip(ref_q, got_q, strict=True))
    assert max(errors[True]) < max(errors[False])
    assert score_errors[True] < score_errors[False]

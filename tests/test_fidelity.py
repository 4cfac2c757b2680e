"""hf_openjev.fidelity_check.gate: |Δp| statistics, decision flips and near-ties, the gate against B, input checks, the report,
the weights hash; then the whole comparison on a tiny bf16 model against its own fp32 oracle, where a sabotaged
fast path (a wrong prefix state) must fail the gate."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from hf_openjev.fidelity_check import gate as fidelity
from hf_openjev.fidelity_check.gate import (
    FidelityStats,
    compare_with_oracle,
    describe_request,
    find_flip,
    hash_tokens,
    hash_weights,
    passes_gate,
    select_requests,
    verify_oracle_identity,
)


def entry(rid, kind, probs, **extra):
    return {"id": rid, "kind": kind, "probabilities": {"q": list(probs)}, **extra}


ORACLE = [entry("a", "choice", [0.5, 0.3, 0.2]), entry("b", "noul", [0.8]), entry("c", "score", [0.1, 0.6, 0.3])]


def test_identical_answers_have_no_difference_and_pass_against_themselves():
    stats = compare_with_oracle(ORACLE, copy.deepcopy(ORACLE))
    assert (stats.max_abs_dp, stats.p99_abs_dp, stats.mean_abs_dp, stats.flips, stats.near_tie_flips) == (0, 0, 0, 0, 0)
    assert stats.n_probabilities == 7 and stats.request_ids == ("a", "b", "c")
    assert passes_gate(stats, stats).passes


def test_statistics_pool_every_candidate_probability():
    config = [entry("a", "choice", [0.49, 0.31, 0.2]), entry("b", "noul", [0.75]),
              entry("c", "score", [0.1, 0.6, 0.3])]
    stats = compare_with_oracle(ORACLE, config)
    diffs = sorted([0.01, 0.01, 0.0, 0.05, 0.0, 0.0, 0.0])
    assert stats.max_abs_dp == pytest.approx(0.05)
    assert stats.mean_abs_dp == pytest.approx(sum(diffs) / 7)
    assert stats.p99_abs_dp == pytest.approx(diffs[int(0.99 * 7) - 1])  # the bench's percentile convention
    assert stats.per_request_max_abs_dp == pytest.approx((0.01, 0.05, 0.0))
    assert stats.flips == 0


def test_p99_leaves_out_the_top_percent():
    def with_outliers(k):  # 200 noul answers: k off by 0.5, the others by 0 .. 0.006
        oracle = [entry(str(i), "noul", [0.9]) for i in range(200)]
        config = [entry(str(i), "noul", [0.9 - (0.5 if i < k else 0.001 * (i % 7))]) for i in range(200)]
        return compare_with_oracle(oracle, config)

    assert with_outliers(2).max_abs_dp == pytest.approx(0.5)
    assert with_outliers(2).p99_abs_dp == pytest.approx(0.006)  # sorted[197]: two of 200 are the top 1%
    assert with_outliers(3).p99_abs_dp == pytest.approx(0.5)


@pytest.mark.parametrize("kind, oracle_p, config_p, flip, near", [
    ("choice", [0.5, 0.3, 0.2], [0.3, 0.5, 0.2], True, False),  # margin 0.2
    ("choice", [0.41, 0.40, 0.19], [0.40, 0.41, 0.19], True, True),  # margin 0.01 < 0.02
    ("choice", [0.43, 0.40, 0.17], [0.40, 0.43, 0.17], True, False),  # margin 0.03
    ("choice", [0.5, 0.5], [0.5, 0.5], False, False),  # the same first arg-max
    ("choice", [1.0], [1.0], False, False),  # one option: no decision to flip
    ("score", [0.2, 0.3, 0.5], [0.2, 0.5, 0.3], True, False),
    ("noul", [0.7], [0.4], True, False),
    ("noul", [0.505], [0.495], True, True),  # |p - 0.5| = 0.005 < 0.01
    ("noul", [0.52], [0.49], True, False),
    ("noul", [0.5], [0.5], False, False),  # 0.5 is "no" on both sides (docs/design.md "Numerics")
    ("noul", [0.3], [0.1], False, False),
])
def test_flips_and_near_ties(kind, oracle_p, config_p, flip, near):
    found = find_flip(kind, oracle_p, config_p)
    assert (found is not None) == flip
    if flip:
        assert found["near_tie"] == near
        stats = compare_with_oracle([entry("x", kind, oracle_p)], [entry("x", kind, config_p)])
        assert (stats.flips, stats.near_tie_flips) == ((0, 1) if near else (1, 0))
        assert [f["id"] for f in stats.flipped_requests] == ["x"]


def stats_of(max_dp, mean_dp, flips, ids=("a",)):
    return FidelityStats(request_ids=tuple(ids), n_probabilities=10, max_abs_dp=max_dp, p99_abs_dp=max_dp,
                         mean_abs_dp=mean_dp, flips=flips, near_tie_flips=0, flipped_requests=(),
                         per_request_max_abs_dp=(max_dp,))


B = stats_of(0.04, 0.002, 2)


@pytest.mark.parametrize("stats, passes, reason", [
    (stats_of(0.05, 0.0022, 2), True, None),  # exactly at every bound
    (stats_of(0.0501, 0.001, 0), False, "max"),
    (stats_of(0.01, 0.00221, 0), False, "mean"),
    (stats_of(0.01, 0.001, 3), False, "flips"),
    (stats_of(0.2, 0.01, 9), False, "max"),
])
def test_the_gate_bounds(stats, passes, reason):
    verdict = passes_gate(stats, B)
    assert verdict.passes == passes
    assert verdict.limits == pytest.approx({"max_abs_dp": 0.05, "mean_abs_dp": 0.0022, "flips": 2})
    if reason:
        assert any(reason in r for r in verdict.reasons)
    else:
        assert verdict.reasons == ()


def test_the_gate_needs_the_same_requests_as_b():
    with pytest.raises(ValueError, match="different requests"):
        passes_gate(stats_of(0.01, 0.001, 0, ids=("a", "b")), B)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop(), "2 requests to compare with 3"),
    (lambda c: c[1].update(id="z"), "id 'z'"),
    (lambda c: c[0].update(kind="score"), "kind"),
    (lambda c: c[0]["probabilities"]["q"].append(0.0), "candidate probabilities"),
    (lambda c: c[0].update(probabilities={"other": [0.5, 0.3, 0.2]}), "questions"),
    (lambda c: c[2]["probabilities"]["q"].__setitem__(0, float("nan")), "not a probability"),
    (lambda c: c[2]["probabilities"]["q"].__setitem__(0, 1.5), "not a probability"),
])
def test_mismatched_inputs_are_refused(change, message):
    config = copy.deepcopy(ORACLE)
    change(config)
    with pytest.raises(ValueError, match=message):
        compare_with_oracle(ORACLE, config)


def test_token_hashes_must_agree_when_both_sides_carry_them():
    oracle = [entry("a", "noul", [0.5], tokens_sha256=hash_tokens([[[1, 2, 3]]]))]
    assert compare_with_oracle(oracle, [entry("a", "noul", [0.5])]).max_abs_dp == 0  # one side only: not checked
    with pytest.raises(ValueError, match="token ids differ"):
        compare_with_oracle(oracle, [entry("a", "noul", [0.5], tokens_sha256=hash_tokens([[[1, 2, 4]]]))])


def test_selecting_oracle_requests_by_id():
    assert [r["id"] for r in select_requests(ORACLE, ["c", "a"])] == ["c", "a"]
    with pytest.raises(ValueError, match="not in the oracle"):
        select_requests(ORACLE, ["a", "nope"])


def test_the_oracle_identity_check():
    oracle = {"shape": "mid", "seed": 0, "weights_sha256": "ab"}
    verify_oracle_identity(oracle, shape="mid", seed=0, weights_sha256="ab")
    for kwargs, message in [(dict(shape="27b", seed=0), "shape"), (dict(shape="mid", seed=1), "seed"),
                            (dict(shape="mid", seed=0, weights_sha256="cd"), "refusing to compare")]:
        with pytest.raises(ValueError, match=message):
            verify_oracle_identity(oracle, **kwargs)


def test_responses_become_entries():
    response = {"answers": {"c": {"type": "choice", "probabilities": {"x": 0.25, "y": 0.75}},
                            "n": {"type": "noul", "noul": 0.6}}}
    assert describe_request(7, "choice", response, tokens_sha256="t", scores=[1]) == {
        "id": "7", "kind": "choice", "probabilities": {"c": [0.25, 0.75], "n": [0.6]}, "tokens_sha256": "t",
        "scores": [1]}


def test_the_weights_hash_sees_every_value_dtype_and_name():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    model.register_buffer("scale", torch.ones(2))
    first = hash_weights(model)
    assert first == hash_weights(copy.deepcopy(model)) and len(first) == 64
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed[0].weight.view(torch.int16)[1, 2] += 1
    assert hash_weights(changed) != first  # one bf16 unit in one weight
    assert hash_weights(copy.deepcopy(model).float()) != first  # the same values, upcast
    buffered = copy.deepcopy(model)
    buffered.scale.mul_(2)
    assert hash_weights(buffered) != first  # buffers count


def test_the_report_files(tmp_path):
    stats = {"B": compare_with_oracle(ORACLE, copy.deepcopy(ORACLE)),
             "bad": compare_with_oracle(ORACLE, [entry("a", "choice", [0.2, 0.3, 0.5]), *ORACLE[1:]])}
    report = fidelity.build_fidelity_report(stats, shape="mid", command="x", git_commit="abc")
    assert report["configurations"]["B"]["passes"] is True
    assert report["configurations"]["bad"]["passes"] is False and report["configurations"]["bad"]["flips"] == 1
    fidelity.write_fidelity_report(tmp_path, "fidelity_mid", report)
    assert (tmp_path / "fidelity_mid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(tmp_path / "fidelity_mid.png") as image:  # a palette PNG: the committed plots stay small
        assert image.mode == "P" and image.size == (720, 288) and len(image.getcolors(256)) <= 64
    markdown = (tmp_path / "fidelity_mid.md").read_text()
    assert "| `bad` | 3 | 0.3 |" in markdown and "**no**" in markdown and "a/q (choice, 0 -> 2" in markdown
    without_b = fidelity.build_fidelity_report({"C": stats["bad"]})
    assert without_b["configurations"]["C"]["passes"] is None  # no B in the run: not judged


# --- the whole comparison on a tiny model ------------------------------------------------------------------------

def tiny_jev_model():
    """A tiny random JevModel with bf16-stored weights (fp32 head), long GDN memory, non-zero norms."""
    from transformers import Qwen3_5TextModel

    from hf_openjev.checkpoint.backbone import make_head
    from hf_openjev.checkpoint.manifest import ExportManifest
    from hf_openjev.checkpoint.tiny import tiny_text_config
    from hf_openjev.model import JevModel

    torch.manual_seed(3)
    backbone = Qwen3_5TextModel(tiny_text_config(vocab_size=300, hidden_size=64, num_layers=4)).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_((torch.rand(p.shape, generator=gen) * 0.05 + 0.002).log())
    weight = torch.randn(1, 64, generator=gen) * 3 / 8
    manifest = ExportManifest(model_id="random", base_revision="random", checkpoint_revision="random",
                              temperature=1.7, max_length=4096, chat_prefix="", chat_suffix="",
                              head_weight=tuple(weight.flatten().tolist()), head_bias=0.1)
    model = JevModel(backbone, make_head(manifest.head_weight, manifest.head_bias, "cpu"), None, manifest,
                     method="random")
    return model.to(torch.bfloat16)


def tiny_workload(vocab: int):
    """Choice / score / noul requests with 64..130-token shared prefixes (the fast path shares them)."""
    from hf_openjev.contract import parse_request
    from hf_openjev.scoring import PreparedRequest

    rng = random.Random(7)
    work = []
    for i in range(12):
        kind = ["choice", "score", "noul"][i % 3]
        n = {"choice": 4, "score": 5, "noul": 1}[kind]
        question = {"type": kind, "instructions": "x"}
        if kind == "choice":
            question["criteria"] = {f"o{j}": None for j in range(n)}
        elif kind == "score":
            question["criteria"] = [str(j) for j in range(n)]
        prefix = [rng.randrange(vocab) for _ in range(rng.choice([64, 90, 130]))]
        tokens = [[prefix + [rng.randrange(vocab) for _ in range(rng.choice([1, 3, 8]))] for _ in range(n)]]
        work.append((f"r{i}", kind, PreparedRequest(parse_request({"state": "x", "questions": {"q": question}}),
                                                    tokens)))
    return work


def entries_of(model, work, *, fast: bool, batch_size: int = 32):
    from hf_openjev.scoring import build_answer, score_prepared

    result = score_prepared(model, [p for _, _, p in work], fast=fast, batch_size=batch_size)
    return [describe_request(rid, kind, build_answer(model, p, s, seconds=0.0, prefix_cache={}, method="x"),
                             tokens_sha256=hash_tokens(p.tokens))
            for (rid, kind, p), s in zip(work, result.scores)]


def test_a_fast_path_with_a_wrong_prefix_state_fails_the_gate_that_b_and_the_fast_path_are_judged_by(monkeypatch):
    import hf_openjev.fast_path as fast_path
    from hf_openjev.patches import apply_patches

    torch.set_num_threads(1)
    stored = tiny_jev_model()
    oracle_model = copy.deepcopy(stored).float()  # the same bf16 weights, upcast
    work = tiny_workload(stored.config.vocab_size)
    oracle = entries_of(oracle_model, work, fast=False, batch_size=1)
    b = compare_with_oracle(oracle, entries_of(stored, work, fast=False))  # the reference path in bf16
    apply_patches(stored)
    c = compare_with_oracle(oracle, entries_of(stored, work, fast=True))
    assert 0 < b.max_abs_dp < 0.05 and 0 < c.max_abs_dp < 0.05  # bf16 rounding, not a different model

    build, hit = fast_path.build_pack_context, []

    def wrong_prefix_state(*args, **kwargs):  # children start from the zero state instead of their prefix's
        ctx = build(*args, **kwargs)
        for call in ctx.gdn_calls:
            if call.has_parents:
                hit.append(True)
                call.parent_rows, call.source = torch.zeros_like(call.parent_rows), None
        return ctx

    monkeypatch.setattr(fast_path, "build_pack_context", wrong_prefix_state)
    sabotaged = compare_with_oracle(oracle, entries_of(stored, work, fast=True))
    assert hit
    verdict = passes_gate(sabotaged, b)
    print(f"B max {b.max_abs_dp:.3g} mean {b.mean_abs_dp:.3g}; C max {c.max_abs_dp:.3g} mean {c.mean_abs_dp:.3g}; "
          f"sabotaged max {sabotaged.max_abs_dp:.3g} mean {sabotaged.mean_abs_dp:.3g} flips {sabotaged.flips}")
    assert not verdict.passes and any("max" in r for r in verdict.reasons)
    assert math.isfinite(sabotaged.mean_abs_dp) and sabotaged.mean_abs_dp > 2 * b.mean_abs_dp


def test_the_stored_weights_fingerprint_ignores_derived_buffers_and_old_oracles_keep_theirs():
    """A model built on one device and its export loaded on another may differ in a derived buffer (rotary
    inv_freq) alone: the stored-weights fingerprint matches them, the whole one (older oracles') does not."""
    from torch import nn

    from hf_openjev.fidelity_check.gate import same_weights, weights_identity

    def module(derived: float, weight: float = 1.0) -> nn.Module:
        m = nn.Linear(3, 2)
        with torch.no_grad():
            m.weight.fill_(weight)
            m.bias.fill_(0.5)
        m.register_buffer("inv_freq", torch.full((4,), derived), persistent=False)
        return m

    built, loaded, other = weights_identity(module(1.0)), weights_identity(module(1.0 + 2**-20)), \
        weights_identity(module(1.0, weight=2.0))
    assert built["weights_sha256"] != loaded["weights_sha256"]
    assert built["stored_weights_sha256"] == loaded["stored_weights_sha256"]
    assert same_weights(built, loaded) and not same_weights(built, other)
    legacy = {"weights_sha256": built["weights_sha256"]}  # an oracle written before the stored fingerprint
    assert same_weights(legacy, built) and not same_weights(legacy, loaded)
    assert same_weights(legacy, built["weights_sha256"])  # a bare sha256 compares the whole fingerprint

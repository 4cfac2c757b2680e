"""hf_openjev/packing/bucket_policy.py: a pack padded to the cheapest measured row count, from the shipped table."""

from __future__ import annotations

import random

import pytest
import torch
from repo_data import load_recipe, repo_path

from hf_openjev.family import MEMBERS, text_config_of
from hf_openjev.fast_options import FastPathOptions
from hf_openjev.packing import pack_context as pc
from hf_openjev.packing.bucket_policy import BucketPolicy, bucket_policy_for, table_policy
from hf_openjev.packing.gemm_costs import GEMM_COSTS
from hf_openjev.packing.graph_buckets import bucket_sequences, bucket_tokens, chunks, pad_level
from hf_openjev.packing.layout import lay_out_template
from hf_openjev.packing.layout_cache import TEMPLATES
from hf_openjev.packing.naive_layout import build_naive_pack_context
from hf_openjev.packing.planner import plan_requests

DEFAULTS = FastPathOptions()  # the fast path's options as packing receives them

torch.set_num_threads(1)

# a synthetic non-monotone curve on a 16-row grid: 48 is dearer than 64, 96 than 112 and 128
SYNTHETIC = BucketPolicy("synthetic", (16, 32, 48, 64, 80, 96, 112, 128, 144),
                         (1.0, 1.0, 3.0, 2.0, 2.5, 6.0, 4.0, 4.0, 5.0), window=64)


def _cheapest_at_least(policy: BucketPolicy, rows: int) -> int:
    """The brute-force rule: the cheapest measured row count in [rows, rows + window], ties to the smallest."""
    candidates = [(ms, r) for r, ms in zip(policy.rows, policy.ms) if rows <= r <= rows + policy.window]
    return min(candidates)[1] if candidates else bucket_tokens(rows)


def test_the_bucket_of_t_is_the_cheapest_measured_size_at_least_t():
    assert [SYNTHETIC.pack_rows(t) for t in (1, 16, 17, 32, 33, 48, 49, 64, 65, 81, 97, 113, 129, 144)] == \
        [16, 16, 32, 32, 64, 64, 64, 64, 80, 112, 112, 128, 144, 144]
    for t in range(1, 200):
        assert SYNTHETIC.pack_rows(t) == _cheapest_at_least(SYNTHETIC, t) >= t
    assert SYNTHETIC.pack_rows(145) == bucket_tokens(145) == 160  # past the table: the fixed token steps


def test_no_padded_size_costs_more_than_a_larger_one_within_the_window():
    policy = table_policy("27b")
    for t in range(1, policy.rows[-1] + 1):
        b = policy.pack_rows(t)
        later = [ms for r, ms in zip(policy.rows, policy.ms) if b < r <= t + policy.window]
        assert b >= t and all(policy.cost_ms(b) <= ms for ms in later), t


def test_the_27b_table_never_pads_to_320_rows_where_336_is_cheaper():
    policy = table_policy("27b")
    assert policy.cost_ms(320) > policy.cost_ms(336)  # the shipped sweep's inversion
    assert [policy.pack_rows(t) for t in (288, 300, 304, 305, 320, 336)] == [288, 304, 304, 336, 336, 336]
    assert 320 not in {policy.pack_rows(t) for t in range(1, 4097)}
    assert policy.pack_rows(3441) == bucket_tokens(3441)  # past the 27B sweep's last row


def test_a_padded_level_keeps_its_invariants_under_a_policy():
    policy = table_policy("27b")
    rng = random.Random(1)
    for _ in range(400):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 20))]
        before = rng.choice([0, 64, 320])
        dummies = pad_level(lengths, policy, rows_before=before)
        if not dummies:
            assert bucket_sequences(len(lengths)) == len(lengths)
            assert policy.pack_rows(before + sum(lengths)) == before + sum(lengths)
            continue
        padded = lengths + dummies
        assert len(padded) == bucket_sequences(len(lengths) + 1) and min(dummies) >= 1
        assert before + sum(padded) == policy.pack_rows(before + sum(lengths) + len(dummies))
        assert chunks(padded) == chunks(lengths) + max(len(dummies), -(-(sum(padded) - sum(lengths)) // 64))


def test_only_the_shapes_with_a_table_get_a_policy():
    for member in MEMBERS:
        policy = bucket_policy_for(text_config_of(member))
        assert policy is not None and policy.name == member.size and tuple(member.shape) == GEMM_COSTS[member.size][0]
    unknown = text_config_of(MEMBERS[0])
    unknown.intermediate_size = 1024
    assert bucket_policy_for(unknown) is None
    assert bucket_policy_for(object()) is None


def test_a_tiny_model_keeps_the_fixed_steps(tiny_model):
    from hf_openjev.patches import apply_patches, patch_record, revert_patches

    patched_before = patch_record(tiny_model) is not None
    try:
        assert apply_patches(tiny_model, FastPathOptions()).buckets is None
    finally:
        if not patched_before:
            revert_patches(tiny_model)


def test_the_pack_is_padded_to_the_policys_rows_and_the_cache_tells_policies_apart():
    # two levels: a 64-token prefix, then 3 suffixes of 80 tokens in all
    plan = plan_requests([[[[7] * 64 + [8] * 30, [7] * 64 + [9] * 41, [7] * 64 + [4] * 9]]],
                         share_tails=False, min_shared_tokens=64)
    pack = plan.packs[0]
    policy = BucketPolicy("test", (64, 96, 128, 144, 160, 192), (1.0, 5.0, 4.0, 9.0, 3.5, 3.0), window=128)
    TEMPLATES.clear()
    plain = pc.build_pack_context(plan, pack, {}, "cpu", DEFAULTS, pad=True)
    cheap = pc.build_pack_context(plan, pack, {}, "cpu", DEFAULTS, pad=True, buckets=policy)
    assert TEMPLATES.misses == 2
    assert [level.hi - level.lo for level in plain.levels] == [64, bucket_tokens(80 + 1)]
    # the last level: 80 real tokens + 1 dummy after 64 rows -> the pack's 145 rows go to 192 (3.0 ms), not 160
    assert cheap.levels[-1].hi == policy.pack_rows(64 + 80 + 1) == 192
    assert plain.graph_key != cheap.graph_key
    reference = build_naive_pack_context(plan, pack, {}, "cpu", DEFAULTS, pad=True, buckets=policy)
    assert reference.graph_key == cheap.graph_key and torch.equal(reference.input_ids, cheap.input_ids)


@pytest.mark.parametrize("bad", [dict(rows=(), ms=()), dict(rows=(32, 16), ms=(1.0, 2.0)),
                                 dict(rows=(16,), ms=(1.0, 2.0)), dict(rows=(16,), ms=(1.0,), window=-1)])
def test_a_bad_table_is_refused(bad):
    with pytest.raises(ValueError):
        BucketPolicy("bad", **bad)


def test_the_shipped_table_is_what_the_recipe_writes_from_the_committed_sweeps(tmp_path):
    recipe = load_recipe("bucket_table")
    sweeps = [repo_path(f"recipes/results/gemm_sweep/gemm_sweep_{name}.json") for name in ("27b", "9b", "2b")]
    out = tmp_path / "gemm_costs.py"
    assert recipe.main([*map(str, sweeps), "--out", str(out)]) == 0
    assert out.read_text() == repo_path("hf_openjev/packing/gemm_costs.py").read_text()
    name, step, ms, _ = recipe.read_sweep(sweeps[0])
    assert (name, step) == ("27b", 16) and GEMM_COSTS["27b"][2][19] == round(ms[19], 2)  # 320 rows


def test_the_recipe_refuses_a_sweep_off_its_grid(tmp_path):
    recipe = load_recipe("bucket_table")
    path = tmp_path / "sweep.json"
    path.write_text('{"shape": "27b", "libraries": {"cublas": {"ms": {"16": 1.0, "48": 2.0}}}}')
    with pytest.raises(ValueError, match="grid"):
        recipe.read_sweep(path)


def test_apply_patches_keeps_the_table_of_the_models_shape():
    from transformers import Qwen3_5TextModel

    from hf_openjev.patches import apply_patches

    with torch.device("meta"):  # the 2B's modules without their memory
        model = Qwen3_5TextModel(text_config_of(MEMBERS[2]))
    assert apply_patches(model, FastPathOptions(cuda_graphs=False)).buckets.name == "2b"


@pytest.mark.parametrize("measured", [True, False])
def test_score_fast_lays_packs_out_with_the_records_policy(tiny_model, monkeypatch, measured):
    """The record's policy reaches every pack's layout; ``measured_buckets=False`` gives the fixed steps (None)."""
    from hf_openjev import fast_path
    from hf_openjev.patches import apply_patches, patch_record, revert_patches

    patched_before = patch_record(tiny_model) is not None
    record = apply_patches(tiny_model, FastPathOptions())
    seen = []
    real = fast_path.build_pack_context

    def spying(*args, **kwargs):
        seen.append(kwargs.get("buckets"))
        return real(*args, **kwargs)

    monkeypatch.setattr(fast_path, "build_pack_context", spying)
    monkeypatch.setattr(record, "buckets", SYNTHETIC)
    try:
        fast_path.score_fast(tiny_model, [[[[5, 6, 7], [5, 6, 8, 9]]]],
                             options=FastPathOptions(measured_buckets=measured))
    finally:
        monkeypatch.undo()
        if not patched_before:
            revert_patches(tiny_model)
    assert seen and all(b is (SYNTHETIC if measured else None) for b in seen)


def test_packs_padded_under_a_policy_give_the_same_rows(tiny_checkpoint):
    from hf_openjev import load_export
    from hf_openjev.family import text_model_of
    from hf_openjev.patches import apply_patches, revert_patches

    model = load_export(tiny_checkpoint.export, dtype=torch.float32, device="cpu")
    apply_patches(model)
    text_model = text_model_of(model)
    rng = random.Random(3)
    policy = BucketPolicy("noisy", tuple(range(16, 1025, 16)), tuple(rng.uniform(1, 3) + r / 100 for r in range(64)))
    checked = 0
    try:
        for _ in range(6):
            prefix = [rng.randrange(5, 200) for _ in range(rng.randint(0, 120))]
            plan = plan_requests([[[prefix + [rng.randrange(5, 200) for _ in range(rng.randint(1, 40))]
                                    for _ in range(rng.randint(1, 5))]]], share_tails=True, min_shared_tokens=8)
            for pack in plan.packs:
                plain = pc.build_pack_context(plan, pack, {}, "cpu", DEFAULTS)
                padded = pc.build_pack_context(plan, pack, {}, "cpu", DEFAULTS, pad=True, buckets=policy)
                assert padded.levels[-1].hi in policy.rows  # the pack ends on a measured row count
                rows = text_model(pack=padded)[: len(padded.leaf_ids)]
                torch.testing.assert_close(rows, text_model(pack=plain), rtol=1e-5, atol=1e-5)
                checked += 1
    finally:
        revert_patches(model)
    assert checked >= 6


@pytest.mark.slow
def test_the_27b_policy_keeps_the_jevbench_graph_buckets_bounded():
    import json

    from hf_openjev.patches.cuda_graphs import DEFAULT_CAPACITY, graph_ready

    shapes = json.loads(repo_path("data/bench/jevbench231-shapes.json").read_text())
    policy, rng = table_policy("27b"), random.Random(0)
    keys, real, padded = set(), 0, 0
    for item in shapes["requests"]:
        prefix = [rng.randrange(5, 1000) for _ in range(item["prefix_tokens"])]
        plan = plan_requests([[[prefix + [rng.randrange(5, 1000) for _ in range(n)] for n in item["suffix_tokens"]]]])
        for pack in plan.packs:
            if graph_ready(plan, pack):
                template = lay_out_template(plan, pack, {}, pad=True, merge_levels=True, dense_attention_tokens=2048,
                                            buckets=policy)
                keys.add(template.key_tail)
                real += pack.tokens(plan)
                padded += sum(length for _, length in template.token_runs)
    assert 10 < len(keys) <= DEFAULT_CAPACITY // 2 and padded <= 1.2 * real

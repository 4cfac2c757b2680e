"""recipes/bucket_report.py: the fixed token steps and the measured-cost buckets costed on the JevBench workload."""

from __future__ import annotations

import json

from repo_data import load_recipe


def test_the_report_costs_every_rule_on_the_measured_curve(tmp_path):
    recipe = load_recipe("bucket_report")
    assert recipe.main(["--limit", "8", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "buckets.json").read_text())
    rules = results["rules"]
    measured = "measured, window 128 (its default window; opt-in: measured_buckets)"
    assert list(rules)[0] == "token steps (the fast path's default)" and measured in rules
    assert results["graphed_packs"] > 0 and "not a GPU timing" in results["note"] and results["unpadded_gemm_ms"] > 0
    real = {r["real_tokens"] for r in rules.values()}
    assert len(real) == 1  # the same packs under every rule
    for r in rules.values():
        assert r["gemm_ms"] > 0 and r["padding_tokens"] >= 0 and "max_over_unpadded_ms" in r and 1 <= r["row_counts"] <= r["graph_keys"]
        assert 1 <= r["graph_keys_without_gdn_shapes"] <= r["graph_keys"]
        assert r["row_counts"] <= r["graph_keys_rows_and_level_kinds"] <= r["graph_keys"]
        eager = [r["graph_keys_eager_above"][str(limit)] for limit in recipe.EAGER_ABOVE]
        assert eager == sorted(eager) and eager[-1] <= r["graph_keys"]  # a higher cut keeps more graphs
    assert rules[measured]["packs_costlier_than_steps"] == 0
    markdown = (tmp_path / "buckets.md").read_text()
    assert "not a GPU timing" in markdown and "| token steps (the fast path's default) |" in markdown


def test_eager_cuts_count_the_graph_keys_of_packs_up_to_each_cut():
    """A key counts under a cut when one of its packs has at most that many tokens before padding (graph_ready with
    that graph_tokens: packs over it run eagerly), whatever its padded rows."""
    recipe = load_recipe("bucket_report")

    class Pack:
        external = export = ()

        def __init__(self, tokens):
            self._tokens = tokens

        def tokens(self, plan):
            return self._tokens

    tokens = (1000, 2040, 2100, 2600, 3100, 4000)
    rows = (1024, 2080, 2112, 2624, 3104, 4096)  # padded: the second pack's 2,080 rows are over 2,048, its tokens not
    keys = ("a", "b", "b", "c", "d", "e")  # a key's tail: final rows, levels, GDN calls
    laid_out = [(n, (key, (), ())) for n, key in zip(rows, keys)]
    packs = [(None, Pack(t)) for t in tokens]
    figures = recipe.cost_rule(packs, laid_out, laid_out, recipe.table_policy("27b"))
    assert figures["graph_keys"] == 5
    assert figures["graph_keys_eager_above"] == {"2048": 2, "2560": 2, "3072": 3}


def test_keys_by_rows_and_level_kinds_drop_every_other_layout_detail():
    """The layout-on-the-device costing: two packs of equal padded rows and level kinds (has parents, dense) share a
    key whatever their levels' tokens, sequences, chunks, GDN calls and scored rows; another kind or row count not."""
    recipe = load_recipe("bucket_report")

    def level(tokens, seqs, has_parents, dense):  # naive_layout.key_graph's level tuple
        return tokens, (seqs + 1,), (tokens // 64 + seqs, 2), has_parents, 0, None, dense

    a = (4, (level(64, 1, False, False), level(192, 4, True, False)), (("call", 1),))
    b = (6, (level(96, 1, False, False), level(160, 6, True, False)), (("call", 2),))
    c = (4, (level(64, 1, False, False), level(192, 4, False, False)), (("call", 1),))
    assert recipe.key_by_rows_and_level_kinds(256, a) == recipe.key_by_rows_and_level_kinds(256, b)
    assert recipe.key_by_rows_and_level_kinds(256, a) != recipe.key_by_rows_and_level_kinds(256, c)
    assert recipe.key_by_rows_and_level_kinds(256, a) != recipe.key_by_rows_and_level_kinds(288, a)
    Pack = type("Pack", (), {"external": (), "export": (), "tokens": lambda self, plan: 200})
    figures = recipe.cost_rule([(None, Pack())] * 3, [(256, a), (256, b), (256, c)], [(256, a)] * 3,
                               recipe.table_policy("27b"))
    assert (figures["graph_keys"], figures["graph_keys_rows_and_level_kinds"]) == (3, 2)


def test_the_report_plans_with_the_shapes_own_defaults(tmp_path):
    """A 2B plans every candidate alone (its own defaults), so its graphed packs hold one sequence each and no shared
    prefix; the 27B's packs share prefixes and several candidates."""
    recipe = load_recipe("bucket_report")
    assert recipe.main(["--shape", "2b", "--limit", "8", "--out", str(tmp_path)]) == 0
    small = json.loads((tmp_path / "buckets_2b.json").read_text())
    assert small["options"] == {"dense_attention_tokens": 1, "packed_candidates": False, "shared_prefix": False}
    assert recipe.main(["--shape", "27b", "--limit", "8", "--out", str(tmp_path)]) == 0
    large = json.loads((tmp_path / "buckets.json").read_text())
    assert large["options"] == {} and large["graphed_packs"] < small["graphed_packs"]
    assert "packed_candidates" in (tmp_path / "buckets_2b.md").read_text()

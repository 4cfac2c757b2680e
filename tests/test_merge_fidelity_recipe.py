"""recipes/merge_fidelity.py: several runs' fidelity reports of one shape joined into one table."""

from __future__ import annotations

import json

import pytest
from repo_data import load_recipe

from hf_openjev.fidelity_check.gate import FidelityStats, build_fidelity_report

ORACLE_CHECK = {"oracle": "ab" * 32, "run": "ab" * 32, "match": True}


def stats(max_dp: float, mean_dp: float, flips: int) -> FidelityStats:
    return FidelityStats(request_ids=("r0", "r1"), n_probabilities=4, max_abs_dp=max_dp, p99_abs_dp=max_dp,
                         mean_abs_dp=mean_dp, flips=flips, near_tie_flips=0, flipped_requests=(),
                         per_request_max_abs_dp=(max_dp, mean_dp))


def report(configurations: dict, *, fp8=None, b=stats(0.04, 0.01, 1), **changes) -> dict:
    meta = {"command": f"bench --fp8 {fp8}", "git_commit": "abc1234", "device": "NVIDIA H200",
            "versions": {"torch": "2.11"}, "shape": "mid", "seed": 0, "dtype": "bfloat16", "fp8": fp8,
            "oracle": {"path": "oracle_mid.json"}, "oracle_sha256_check": ORACLE_CHECK, "requests_compared": 2,
            **changes}
    return json.loads(json.dumps(build_fidelity_report({"B": b, **configurations}, **meta)))


def test_runs_join_into_one_table_with_their_own_verdicts(tmp_path):
    recipe = load_recipe("merge_fidelity")
    runs = [report({"C": stats(0.045, 0.0105, 1)}), report({"fp8-all": stats(0.3, 0.05, 9)}, fp8="all")]
    paths = []
    for i, r in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(r))
    assert recipe.main([str(tmp_path / "out"), *map(str, paths), "--rename", "1:C=default"]) == 0
    merged = json.loads((tmp_path / "out" / "fidelity_mid.json").read_text())
    assert list(merged["configurations"]) == ["B", "default", "fp8-all"]  # B once
    assert [c["run"] for c in merged["configurations"].values()] == [0, 0, 1]
    assert [c["passes"] for c in merged["configurations"].values()] == [True, True, False]
    assert [run["fp8"] for run in merged["runs"]] == [None, "all"]
    text = (tmp_path / "out" / "fidelity_mid.md").read_text()
    assert "Run 2: `bench --fp8 all`" in text and "| `fp8-all` (run 2) |" in text
    assert (tmp_path / "out" / "fidelity_mid.png").stat().st_size > 0


@pytest.mark.parametrize("second, match", [
    (dict(b=stats(0.05, 0.01, 1)), "B's statistics differ"),  # another B: the runs did not compare the same thing
    (dict(shape="27b"), "shape"),
    (dict(oracle_sha256_check={**ORACLE_CHECK, "oracle": "cd" * 32}), "another oracle"),
])
def test_runs_that_cannot_share_a_table_are_refused(second, match):
    recipe = load_recipe("merge_fidelity")
    with pytest.raises(ValueError, match=match):
        recipe.merge_reports([report({"C": stats(0.04, 0.01, 1)}), report({"fp8-all": stats(0.3, 0.05, 9)}, **second)])


def test_a_name_twice_with_other_statistics_or_a_rename_of_nothing_is_refused():
    recipe = load_recipe("merge_fidelity")
    runs = [report({"C": stats(0.04, 0.01, 1)}), report({"C": stats(0.04, 0.011, 1)})]
    with pytest.raises(ValueError, match="appears twice .* with other statistics"):
        recipe.merge_reports(runs)
    assert list(recipe.merge_reports(runs, {(1, "C"): "C2"})["configurations"]) == ["B", "C", "C2"]
    with pytest.raises(ValueError, match="no run has"):
        recipe.merge_reports(runs, {(1, "C"): "C2", (0, "E"): "x"})
    with pytest.raises(ValueError, match="RUN:OLD=NEW"):
        recipe.parse_renames(["3:C=x"], 2)


def test_a_configuration_answered_identically_in_two_runs_is_kept_once():
    """A gate probe that reused its stored answers reports the default again, unchanged: one row, from its first run.
    The command's reports name no dtype; runs without one join."""
    recipe = load_recipe("merge_fidelity")
    runs = [report({"default": stats(0.05, 0.01, 3), "B1": stats(0.04, 0.01, 1)}),
            report({"default": stats(0.05, 0.01, 3), "plain": stats(0.06, 0.01, 3)})]
    for run in runs:
        del run["dtype"]
    merged = recipe.merge_reports(runs)
    assert list(merged["configurations"]) == ["B", "default", "B1", "plain"]
    assert [c["run"] for c in merged["configurations"].values()] == [0, 0, 0, 1]
    assert "dtype" not in merged
    runs[0]["configurations"]["B1"]["per_request_max_abs_dp"] = [0.0123456789, 0.5]
    assert recipe.merge_reports(runs)["configurations"]["B1"]["per_request_max_abs_dp"] == [0.01235, 0.5]
    runs[1]["dtype"] = "bfloat16"  # one run names a dtype, the other none: not one table
    with pytest.raises(ValueError, match="dtype"):
        recipe.merge_reports(runs)


def test_a_merged_report_takes_a_new_run():
    """A committed table (this recipe's output) joined with a new run equals the three runs joined at once; its B,
    whose per-request figures the table rounded, still matches the new run's."""
    recipe = load_recipe("merge_fidelity")
    b = stats(0.04, 0.0123456789, 1)
    runs = [report({"C": stats(0.045, 0.0105, 1)}, b=b), report({"fp8-all": stats(0.3, 0.05, 9)}, fp8="all", b=b),
            report({"packed": stats(0.05, 0.011, 2)}, b=b, git_commit="def5678")]
    at_once = recipe.merge_reports(runs)
    table = json.loads(json.dumps(recipe.merge_reports(runs[:2])))
    assert table["configurations"]["B"]["per_request_max_abs_dp"] == [0.04, 0.01235]
    joined = recipe.merge_reports([table, runs[2]])
    assert joined == at_once
    assert [c["run"] for c in joined["configurations"].values()] == [0, 0, 1, 2]
    assert [run["git_commit"] for run in joined["runs"]] == ["abc1234", "abc1234", "def5678"]
    again = recipe.merge_reports([runs[2], table])  # the table second: its runs after the new one's
    assert [c["run"] for c in again["configurations"].values()] == [0, 0, 1, 2]
    assert [run["fp8"] for run in again["runs"]] == [None, None, "all"]
    assert recipe.merge_reports([table, table])["runs"] == table["runs"]  # runs that add no row are not listed

"""recipes/scaleout_eval.py on the tiny shape (CPU): one process in-process, then two launched ranks, so a broken
scale-out recipe never costs GPU time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch_ranks import launch
from repo_data import load_recipe

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "scaleout_eval.py"


@pytest.mark.slow
def test_the_scaleout_recipe_shards_the_workload_and_compares_with_one_process(tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("scaleout_eval")
    args = ["--shape", "tiny", "--dtype", "float32", "--limit", "8", "--batch-size", "4", "--out", str(tmp_path)]
    assert recipe.main(args) == 0
    one = json.loads((tmp_path / "scaleout_tiny_w1.json").read_text())
    assert one["world"] == 1 and one["requests"] == one["scored"] == 8 and one["vs_one_process"] is None
    assert one["ranks"][0]["requests"] == 8 and one["wall_seconds"] > 0
    done = launch(2, [str(RECIPE), *args])
    assert done.returncode == 0, done.stderr[-4000:]
    two = json.loads((tmp_path / "scaleout_tiny_w2.json").read_text())
    assert two["world"] == 2 and two["scored"] == 8 and [r["rank"] for r in two["ranks"]] == [0, 1]
    assert sum(r["requests"] for r in two["ranks"]) == 8 and all(r["requests"] for r in two["ranks"])
    costs = [r["cost_tokens"] for r in two["ranks"]]
    assert sum(costs) == one["ranks"][0]["cost_tokens"]
    v = two["vs_one_process"]
    assert v["compared"] == 8 and v["decision_flips"] == 0 and v["max_abs_dp"] < 1e-5 and v["speedup"] > 0
    assert "speed-up over 1 process" in done.stdout

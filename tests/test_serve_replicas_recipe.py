"""recipes/serve_replicas.py on the tiny shape with two CPU replicas, so a broken driver never costs GPU time."""

from __future__ import annotations

import json

import torch
from repo_data import load_recipe


def test_the_replica_benchmark_measures_one_and_two_replicas(tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("serve_replicas")
    rc = recipe.main(["--shape", "tiny", "--dtype", "float32", "--replicas", "2", "--limit", "6", "--in-flight", "2,4",
                      "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "serve_replicas_tiny_r2.json").read_text())
    assert results["devices"] == ["cpu", "cpu"] and results["requests"] == 6
    assert set(results["replicas"]) == {"1", "2"} and set(results["replicas"]["2"]) == {"2", "4"}
    assert all(run["n"] == 6 and run["decisions_per_s"] > 0 for runs in results["replicas"].values()
               for run in runs.values())
    assert set(results["speedup"]) == {"2", "4"}
    assert all(len(run["replica_groups"]) == int(count) and sum(run["replica_groups"]) == run["groups"]
               for count, runs in results["replicas"].items() for run in runs.values())

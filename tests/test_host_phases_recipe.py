"""recipes/host_phases.py on a small layer count: the graph path's host phases on the CPU, the wrappers removed."""

import json

import torch
from repo_data import load_recipe


def test_the_graph_paths_host_phases_are_timed_and_the_wrappers_removed(tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("host_phases")
    from hf_openjev import fast_path
    from hf_openjev.patches.cuda_graphs import PackGraphs

    originals = (fast_path.plan_with_options, fast_path.build_pack_context, PackGraphs.run)
    assert recipe.main(["--layers", "4", "--requests", "0", "--repeats", "3", "--out", str(tmp_path)]) == 0
    assert (fast_path.plan_with_options, fast_path.build_pack_context, PackGraphs.run) == originals
    result = json.loads((tmp_path / "host_phases.json").read_text())
    assert result["repeats"] == 3 and result["layers"] == 4 and len(result["requests"]) == 2
    for phases in result["requests"].values():
        assert set(phases) == set(recipe.PHASES)
        assert all(phases[name] > 0 for name in ("prepare", "plan", "context", "launch", "context, new shape"))
        assert phases["host"] >= phases["prepare"] + phases["plan"] + phases["context"] + phases["launch"]
    # every call after the first replayed a stand-in graph: the timed code is score_fast's graph path
    graphs = result["graphs"]
    assert graphs["captures"] == 2 and graphs["replays"] >= 2 * 3
    markdown = (tmp_path / "host_phases.md").read_text()
    assert "one 107-token candidate" in markdown and "easy-intent-00 (index 0)" in markdown


def test_the_stand_in_graph_replays_nothing_and_captures_once_per_key():
    recipe = load_recipe("host_phases")
    calls = []
    graphs = recipe.stand_in_graphs(lambda pack: calls.append(pack) or torch.zeros(2, 3))

    class Context:
        graph_key = ("k",)
        input_buffer = (torch.zeros(4, dtype=torch.uint8),)

    first = graphs.run(Context())
    again = graphs.run(Context())
    assert len(calls) == 1 and again is first and graphs.stats()["replays"] == 1

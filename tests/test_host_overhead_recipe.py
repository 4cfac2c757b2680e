"""recipes/host_overhead.py on the tiny shape (CPU smoke run: the eager path's phases, no graph)."""

import json

import torch
from repo_data import load_recipe


def test_the_host_phases_are_timed_on_the_tiny_shape_and_the_wrappers_removed(tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("host_overhead")
    from hf_openjev import fast_path
    from hf_openjev.patches.cuda_graphs import PackGraphs

    originals = (fast_path.plan_with_options, fast_path.build_pack_context, PackGraphs.run)
    assert recipe.main(["--shape", "tiny", "--tokens", "37", "--requests", "0", "--repeats", "3",
                        "--out", str(tmp_path)]) == 0
    assert (fast_path.plan_with_options, fast_path.build_pack_context, PackGraphs.run) == originals
    result = json.loads((tmp_path / "host_overhead_tiny.json").read_text())
    assert result["repeats"] == 3 and len(result["requests"]) == 2
    for phases in result["requests"].values():
        assert set(phases) == set(recipe.PHASES)
        assert phases["plan"] > 0 and phases["context"] > 0 and phases["graph (GPU)"] == 0.0  # no CUDA here
        assert phases["wall"] >= phases["plan"] + phases["context"] and phases["rest"] > 0
    markdown = (tmp_path / "host_overhead_tiny.md").read_text()
    assert "one 37-token candidate" in markdown and "JevBench request 0" in markdown


def test_a_phase_is_timed_even_when_it_raises():
    recipe = load_recipe("host_overhead")
    from hf_openjev import fast_path

    times = {}
    original = fast_path.plan_with_options
    with recipe.timed_phases(times, []):
        try:
            fast_path.plan_with_options(None, None)
        except Exception:  # noqa: BLE001 - a bad plan input; the time is still counted
            pass
    assert "plan" in times and fast_path.plan_with_options is original

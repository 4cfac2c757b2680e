"""recipes/warmup_breakdown.py on the CPU (a smoke run: no graphs, no Triton) and its Triton hooks on stand-ins."""

import json
import sys
import types
from collections import Counter

import pytest
from repo_data import load_recipe


def test_the_warm_up_pass_runs_and_reports_its_parts(tmp_path):
    recipe = load_recipe("warmup_breakdown")
    assert recipe.main(["--shape", "mid", "--requests", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "warmup_mid.json").read_text())
    assert result["requests"] == 1 and result["warmup_s"] >= result["requests_s"] > 0
    assert result["graphs"] == {} and result["other_s"] == result["warmup_s"]  # no CUDA: no graph cache
    assert "| whole pass |" in (tmp_path / "warmup_mid.md").read_text()
    assert "op_profile_top" not in result


@pytest.mark.parametrize("capture, probe", [(None, (0, 3)), ("probe", (0, 3)), ("eager", None)])
def test_capture_eager_runs_the_whole_forward_first_and_the_default_keeps_the_probe(tmp_path, monkeypatch, capture,
                                                                                   probe):
    """--capture eager empties the graph cache's probe (the capture before s25); probe, the default, keeps what
    apply_patches made. (The graph cache stood in for: a CPU makes none.)"""
    import hf_openjev.patches as patches

    graphs = types.SimpleNamespace(probe_layers=(0, 3), stats=lambda: {})
    real = patches.patch_record
    monkeypatch.setattr(patches, "patch_record", lambda model: types.SimpleNamespace(
        **{**vars(real(model)), "graphs": graphs}))
    recipe = load_recipe("warmup_breakdown")
    args = ["--shape", "mid", "--requests", "1", "--out", str(tmp_path)] + (["--capture", capture] if capture else [])
    assert recipe.main(args) == 0
    assert graphs.probe_layers == probe
    assert json.loads((tmp_path / "warmup_mid.json").read_text())["capture"] == (capture or "probe")


def test_the_op_profile_lists_the_hosts_time_per_op(tmp_path, capsys):
    recipe = load_recipe("warmup_breakdown")
    assert recipe.main(["--shape", "mid", "--requests", "1", "--op-profile", "--out", str(tmp_path)]) == 0
    table = "\n".join(json.loads((tmp_path / "warmup_mid.json").read_text())["op_profile_top"])
    assert "Self CPU" in table and "aten::mm" in table and "hf_openjev::gdn_prefill" in table
    assert "hf_openjev::" in capsys.readouterr().out


def test_the_triton_hooks_time_autotuning_and_compiles_and_put_the_originals_back(monkeypatch):
    recipe = load_recipe("warmup_breakdown")

    class Autotuner:
        def __init__(self, name):
            self.fn = types.SimpleNamespace(__name__=name)

        def _bench(self, *args, **kwargs):
            return 1.0

        def prune_configs(self, kwargs):
            return ["config"]

    class JITFunction:
        def _do_compile(self, *args):
            return "kernel"

    triton = types.ModuleType("triton")
    runtime = types.ModuleType("triton.runtime")
    runtime.autotuner = types.SimpleNamespace(Autotuner=Autotuner)
    runtime.jit = types.SimpleNamespace(JITFunction=JITFunction)
    triton.runtime = runtime
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.runtime", runtime)
    originals = (Autotuner._bench, Autotuner.prune_configs, JITFunction._do_compile)
    totals, tuned = {"autotune_s": 0.0, "compile_s": 0.0, "compiles": 0}, Counter()
    with recipe.triton_hooks(totals, tuned):
        tuner = Autotuner("chunk_fwd_o")
        assert tuner.prune_configs({}) == ["config"] and tuner._bench(config=1) == 1.0
        Autotuner("solve_tril").prune_configs({})
        assert JITFunction()._do_compile() == "kernel" and JITFunction()._do_compile() == "kernel"
    assert (Autotuner._bench, Autotuner.prune_configs, JITFunction._do_compile) == originals
    assert tuned == Counter({"chunk_fwd_o": 1, "solve_tril": 1}) and totals["compiles"] == 2
    assert totals["autotune_s"] > 0 and totals["compile_s"] > 0


def test_autotuners_are_found_inside_the_wrappers_that_decorate_them(monkeypatch):
    """fla decorates most kernels @triton.heuristics over @autotune: the module holds the wrapper, whose .fn is
    the autotuner (s15's first GPU run found only the one kernel without a wrapper)."""
    recipe = load_recipe("warmup_breakdown")

    class Tuner:
        def __init__(self):
            self.fn = types.SimpleNamespace(fn=None)  # the jitted function below it

    class Heuristics:
        def __init__(self, fn):
            self.fn = fn

    bare, wrapped, twice = Tuner(), Tuner(), Tuner()
    module = types.ModuleType("fla.ops.fake")
    module.bare, module.wrapped = bare, Heuristics(wrapped)
    module.twice, module.again = Heuristics(Heuristics(twice)), Heuristics(twice)
    module.other = types.SimpleNamespace(fn=3)
    monkeypatch.setitem(sys.modules, "fla.ops.fake", module)
    monkeypatch.setitem(sys.modules, "elsewhere", types.SimpleNamespace(kernel=Tuner()))
    found = recipe.find_autotuners(Tuner)
    assert sorted(map(id, found)) == sorted(map(id, [bare, wrapped, twice]))


def test_runs_of_several_shapes_merge_into_one_file_per_kernel(tmp_path):
    recipe = load_recipe("warmup_breakdown")

    def entry(key, warps):
        return {"autotune_key": key, "config": {"kwargs": {"BT": 64}, "num_warps": warps, "num_stages": 2,
                                                 "num_ctas": 1, "maxnreg": None}}

    first = {"k": {"kernel_name": "k", "triton_version": "3.6.0", "autotune_entries": {"a": entry([1], 4),
                                                                                       "b": entry([2], 4)}}}
    assert recipe.write_fla_configs(tmp_path / "GPU", first) == {"k": 2}
    second = {"k": {"kernel_name": "k", "triton_version": "3.6.0", "autotune_entries": {"b": entry([2], 8),
                                                                                       "c": entry([3], 4)}}}
    assert recipe.write_fla_configs(tmp_path / "GPU", second) == {"k": 3}
    data = json.loads((tmp_path / "GPU" / "k.json").read_text())
    assert sorted(data["autotune_entries"]) == ["a", "b", "c"]
    assert data["autotune_entries"]["b"]["config"]["num_warps"] == 8  # the newer run's choice for the same key

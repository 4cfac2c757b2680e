"""recipes/warmup_breakdown.py on the CPU (a smoke run: no graphs, no Triton) and its Triton hooks on stand-ins."""

import contextlib
import json
import sys
import types
from collections import Counter

import pytest
import torch
from repo_data import load_recipe


def test_the_warm_up_pass_runs_and_reports_its_parts(tmp_path):
    recipe = load_recipe("warmup_breakdown")
    assert recipe.main(["--shape", "tiny", "--requests", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "warmup_tiny.json").read_text())
    assert result["requests"] == 1 and result["warmup_s"] >= result["requests_s"] > 0
    assert result["graphs"] == {} and result["other_s"] == result["warmup_s"]  # no CUDA: no graph cache
    assert "| whole pass |" in (tmp_path / "warmup_tiny.md").read_text()
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
    args = ["--shape", "tiny", "--requests", "1", "--out", str(tmp_path)] + (["--capture", capture] if capture else [])
    assert recipe.main(args) == 0
    assert graphs.probe_layers == probe
    assert json.loads((tmp_path / "warmup_tiny.json").read_text())["capture"] == (capture or "probe")


@pytest.mark.parametrize("answered", [False, True])
def test_the_pass_runs_inside_warming_up_unless_answered_and_a_measured_pass_follows(tmp_path, monkeypatch,
                                                                                       answered):
    """The warm-up pass runs inside patches.warming_up (as the bench's and the server's), --answered outside it;
    --measured-pass then times one answered pass and counts its captures. (A stand-in graph cache.)"""
    import hf_openjev.patches as patches

    graphs = types.SimpleNamespace(probe_layers=(0, 3), stats=lambda: {}, captures=2)
    real = patches.patch_record
    monkeypatch.setattr(patches, "patch_record", lambda model: types.SimpleNamespace(
        **{**vars(real(model)), "graphs": graphs}))
    inside = []

    @contextlib.contextmanager
    def warming_up(model):
        inside.append(True)
        yield
        inside.pop()

    monkeypatch.setattr(patches, "warming_up", warming_up)
    recipe = load_recipe("warmup_breakdown")
    passes = []

    def run_pass(model, work, *, fast):  # the passes themselves are the smoke test's (a tiny request)
        passes.append(bool(inside))
        return [(0.010 * (i + 1), None) for i in range(len(work))]

    monkeypatch.setattr(recipe, "run_pass", run_pass)
    args = ["--shape", "tiny", "--requests", "3", "--measured-pass", "--out", str(tmp_path)]
    assert recipe.main(args + (["--answered"] if answered else [])) == 0
    assert passes == [not answered, False]  # the warm-up pass (inside unless answered), then the measured one
    result = json.loads((tmp_path / "warmup_tiny.json").read_text())
    assert result["answered"] is answered
    assert result["measured_pass"] == {"mean_ms": pytest.approx(20.0), "p50_ms": pytest.approx(20.0),
                                       "p95_ms": pytest.approx(20.0), "captures": 0}
    assert "Measured pass after it" in (tmp_path / "warmup_tiny.md").read_text()


def test_record_ops_times_each_top_level_op_of_the_recordings_and_the_rest(monkeypatch):
    """--record-ops: inside a recording, each op called at the top level is timed (a custom op with the ops it
    calls, counted once), and the table says what is left between ops. (The recording itself stood in for.)"""
    from hf_openjev.patches import cuda_graphs

    def stand_in(graph, pool, stream):
        return contextlib.nullcontext()

    monkeypatch.setattr(cuda_graphs, "recording", stand_in)
    recipe = load_recipe("warmup_breakdown")
    timer, seconds = recipe.OpTimer(), []
    x, weight = torch.randn(5, 16), torch.ones(16)
    with recipe.timing_recordings(timer, seconds):
        for _ in range(2):  # two graphs
            with cuda_graphs.recording(None, None, None):
                y = torch.ops.hf_openjev.rms_norm(x, weight, 1e-6)
                torch.add(y, 1.0)
    assert cuda_graphs.recording is stand_in and len(seconds) == 2  # put back
    torch.add(x, 1.0)  # after the block: not timed
    assert timer.totals["hf_openjev.rms_norm"][0] == 2 and timer.totals["aten.add"][0] == 2
    assert not any(name.startswith("aten.") and name != "aten.add" for name in timer.totals)  # inner ops not apart
    data, lines = recipe.record_ops_table(timer, seconds)
    assert data["graphs"] == 2 and data["record_s"] >= data["in_ops_s"]  # rounded to ms: a fast op rounds to 0
    assert sum(seconds) >= sum(t for _, t in timer.totals.values()) > 0
    assert set(data["ops"]) == {"hf_openjev.rms_norm", "aten.add"}
    assert any(line.startswith("| hf_openjev.rms_norm | 1 |") for line in lines)
    assert any("between ops" in line for line in lines)


def test_the_op_profile_lists_the_hosts_time_per_op(tmp_path, capsys):
    recipe = load_recipe("warmup_breakdown")
    assert recipe.main(["--shape", "tiny", "--requests", "1", "--op-profile", "--out", str(tmp_path)]) == 0
    table = "\n".join(json.loads((tmp_path / "warmup_tiny.json").read_text())["op_profile_top"])
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
        def __init__(self, name):
            self.fn = types.SimpleNamespace(__name__=name)

        def _do_compile(self, *args):
            return "kernel"

    class CompiledKernel:  # as Triton's: _init_handles does work once, then returns at once
        def __init__(self, name):
            self.name, self.module = name, None

        def _init_handles(self):
            if self.module is None:
                self.module = "loaded"

    triton = types.ModuleType("triton")
    runtime = types.ModuleType("triton.runtime")
    runtime.autotuner = types.SimpleNamespace(Autotuner=Autotuner)
    runtime.jit = types.SimpleNamespace(JITFunction=JITFunction)
    triton.runtime = runtime
    compiler = types.ModuleType("triton.compiler.compiler")
    compiler.CompiledKernel = CompiledKernel
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.runtime", runtime)
    monkeypatch.setitem(sys.modules, "triton.compiler", types.ModuleType("triton.compiler"))
    monkeypatch.setitem(sys.modules, "triton.compiler.compiler", compiler)
    originals = (Autotuner._bench, Autotuner.prune_configs, JITFunction._do_compile, CompiledKernel._init_handles)
    totals, tuned = {"autotune_s": 0.0, "compile_s": 0.0, "compiles": 0}, Counter()
    with recipe.triton_hooks(totals, tuned):
        tuner = Autotuner("chunk_fwd_o")
        assert tuner.prune_configs({}) == ["config"] and tuner._bench(config=1) == 1.0
        Autotuner("solve_tril").prune_configs({})
        assert JITFunction("rms_norm")._do_compile() == "kernel" and JITFunction("rms_norm")._do_compile() == "kernel"
        JITFunction("chunk_fwd_o")._do_compile()
        first = CompiledKernel("rms_norm")
        for _ in range(3):  # a first launch and two more: one load
            first._init_handles()
    assert (Autotuner._bench, Autotuner.prune_configs, JITFunction._do_compile,
            CompiledKernel._init_handles) == originals
    assert tuned == Counter({"chunk_fwd_o": 1, "solve_tril": 1}) and totals["compiles"] == 3
    assert totals["autotune_s"] > 0 and totals["compile_s"] > 0 and totals["loads"] == 1 and totals["load_s"] >= 0
    assert {name: (k["compiles"], k["loads"]) for name, k in totals["by_kernel"].items()} == {
        "rms_norm": (2, 1), "chunk_fwd_o": (1, 0)}
    assert "missing_hooks" not in totals
    table = recipe.kernel_table(totals["by_kernel"])
    assert list(table) == sorted(table, key=lambda n: -(table[n]["compile_s"] + table[n]["load_s"]))


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


def test_compile_threads_runs_a_compile_ahead_pass_first_timed_apart_and_checked_before_the_build(tmp_path,
                                                                                                   monkeypatch, capsys):
    """--compile-threads N: the pass runs once inside patches.compiling_ahead(model, N) before the hooked one, its
    time and report in ``compile_ahead``; a negative N is refused before the model is built."""
    import hf_openjev.patches as patches

    recipe = load_recipe("warmup_breakdown")
    with pytest.raises(SystemExit) as stop:
        recipe.main(["--shape", "tiny", "--compile-threads", "-1", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "--compile-threads" in capsys.readouterr().err
    assert not (tmp_path / "warmup_tiny.json").exists()
    calls = []

    @contextlib.contextmanager
    def compiling_ahead(model, threads):
        calls.append(threads)
        report = {"threads": threads, "compiles": 0, "loads": 0, "untuned": 0, "failures": ["k: RuntimeError: x"],
                  "compile_wait_s": 0.0, "load_s": 0.0}
        yield report
        report["compiles"] = 5

    monkeypatch.setattr(patches, "compiling_ahead", compiling_ahead)
    passes = []
    real_run_pass = recipe.run_pass
    monkeypatch.setattr(recipe, "run_pass", lambda *a, **k: passes.append(list(calls)) or real_run_pass(*a, **k))
    assert recipe.main(["--shape", "tiny", "--requests", "1", "--compile-threads", "4", "--out", str(tmp_path)]) == 0
    assert calls == [4] and passes == [[4], [4]]  # the ahead pass, then the hooked one
    ahead = json.loads((tmp_path / "warmup_tiny.json").read_text())["compile_ahead"]
    assert ahead["compiles"] == 5 and ahead["threads"] == 4 and ahead["seconds"] >= 0
    text = (tmp_path / "warmup_tiny.md").read_text()
    assert "Compile-ahead pass before it:" in text and "5 compiles (4 threads" in text and "- k: RuntimeError: x" in text
    assert recipe.main(["--shape", "tiny", "--requests", "1", "--out", str(tmp_path / "plain")]) == 0
    assert calls == [4] and "compile_ahead" not in json.loads((tmp_path / "plain" / "warmup_tiny.json").read_text())


def test_the_report_lists_the_first_launches_and_each_kernels_compiles_and_loads(tmp_path, monkeypatch):
    recipe = load_recipe("warmup_breakdown")

    @contextlib.contextmanager
    def hooks(totals, tuned):  # what triton_hooks gathers on a GPU: two kernels, one compiled twice
        yield
        totals.update(compile_s=1.5, compiles=3, load_s=0.75, loads=2, by_kernel={
            "_rms_norm_kernel": {"compiles": 2, "compile_s": 1.0, "loads": 1, "load_s": 0.5},
            "chunk_fwd_kernel_o": {"compiles": 1, "compile_s": 0.5, "loads": 1, "load_s": 0.25}})

    monkeypatch.setattr(recipe, "triton_hooks", hooks)
    assert recipe.main(["--shape", "tiny", "--requests", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "warmup_tiny.json").read_text())
    assert (result["loads"], result["load_s"]) == (2, 0.75)
    assert list(result["by_kernel"]) == ["_rms_norm_kernel", "chunk_fwd_kernel_o"]
    text = (tmp_path / "warmup_tiny.md").read_text()
    assert "| kernel loads: first launches (2; inside the above) | 0.8 |" in text
    assert "| _rms_norm_kernel | 2 | 1.00 | 1 | 0.50 |" in text and "| chunk_fwd_kernel_o | 1 | 0.50 | 1 | 0.25 |" in text

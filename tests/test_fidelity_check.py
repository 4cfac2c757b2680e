"""hf-openjev fidelity on tiny checkpoints (CPU): the fp32 oracle, resume, the gate (a sabotaged configuration
fails it), a checkpoint or task mismatch refused, bad options refused before anything loads, the workload input,
agreement and accuracy, and where the oracle is placed."""

from __future__ import annotations

import gzip
import json
import types
from pathlib import Path

import pytest
import torch
from repo_data import JEVBENCH_EASY, load_recipe, read_committed_oracle

import hf_openjev
from hf_openjev.checkpoint.tiny import tiny_text_config
from hf_openjev.cli import main
from hf_openjev.errors import UsageError
from hf_openjev.export.tiny import build_tiny_checkpoint
from hf_openjev.fidelity_check import check_fidelity
from hf_openjev.fidelity_check import oracle as oracle_module
from hf_openjev.fidelity_check.gate import hash_tokens, hash_weights
from hf_openjev.fidelity_check.placement import choose_oracle_placement, estimate_oracle_seconds, plan_device_map
from hf_openjev.fidelity_check.workload import build_workload

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "data" / "bench" / "jevbench231-shapes-estimated.json"  # the committed oracles' workload
GB = 10**9


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A tiny export whose vocabulary holds the workload's random ids (drawn from 1000 up)."""
    root = tmp_path_factory.mktemp("fidelity-tiny")
    return build_tiny_checkpoint(root, config=tiny_text_config(vocab_size=1100)).export


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """The first three public JevBench tasks (choice, with labels and expected answers)."""
    path = tmp_path_factory.mktemp("tasks") / "easy.jsonl"
    path.write_text("".join(JEVBENCH_EASY.read_text().splitlines(keepends=True)[:3]))
    return path


@pytest.fixture(scope="module")
def first_run(export, tasks, tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity-out")
    report = check_fidelity(model=export, out=out, data=[tasks], configs="default,fp8-all", progress=False)
    return out, report


def refuse_loading(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr("hf_openjev.model.load_export", refuse)


def test_the_oracle_is_fp32_one_candidate_at_a_time_on_the_stored_weights(first_run, export, spec):
    from hf_openjev.eval.tasks import load_tasks, resolve_inputs
    from hf_openjev.model import load_export
    from hf_openjev.scoring import prepare_request

    out, report = first_run
    oracle = json.loads((out / "oracle_export.json").read_text())
    stored = load_export(export, dtype="bfloat16", device="cpu")
    assert oracle["format"] == "hf-openjev-oracle/1" and oracle["weights_sha256"] == hash_weights(stored)
    numerics = oracle["numerics"]
    assert not numerics["allow_tf32_matmul"] and numerics["float32_matmul_precision"] == "highest"
    assert numerics["candidates_per_forward"] == 1 and numerics["sdpa_backend"] == "math"
    assert all(k.startswith("transformers.models.qwen3_5.") for k in oracle["kernels"].values())
    exact_model = load_export(export, dtype="float32", device="cpu")
    task = load_tasks(resolve_inputs([JEVBENCH_EASY]))[0][0]
    prepared = prepare_request(exact_model, task.request)
    entry = oracle["requests"][0]
    assert entry["id"] == f"easy/{task.id}" and entry["tokens_sha256"] == hash_tokens(prepared.tokens)
    exact = [spec.score(exact_model, ids) for ids in prepared.tokens[0]]  # each candidate alone, float64 head
    assert entry["scores"][task.qid] == pytest.approx(exact, abs=1e-5)
    in_bf16 = [spec.score(stored, ids) for ids in prepared.tokens[0]]
    assert max(abs(a - b) for a, b in zip(in_bf16, exact)) > 1e-4  # the oracle is not the bf16 arithmetic
    assert report["oracle"]["complete"] and report["requests_compared"] == 3


def test_exact_numerics_unbind_the_kernels_and_put_everything_back(monkeypatch):
    import functools

    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    original = qwen.torch_chunk_gated_delta_rule

    @functools.wraps(original)
    def bound(*args, **kwargs):  # a stand-in for a hub kernel wrapping Transformers' torch code
        return original(*args, **kwargs)

    monkeypatch.setattr(qwen, "torch_chunk_gated_delta_rule", bound)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with oracle_module.exact_numerics() as (numerics, kernels):
            assert qwen.torch_chunk_gated_delta_rule is original
            assert torch.get_float32_matmul_precision() == "highest" and not numerics["allow_tf32_matmul"]
            assert kernels["torch_chunk_gated_delta_rule"].startswith("transformers.models.qwen3_5.")
        assert qwen.torch_chunk_gated_delta_rule is bound and torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_report_has_the_gate_agreement_and_accuracy(first_run):
    out, report = first_run
    configs = report["configurations"]
    assert list(configs) == ["B", "default", "fp8-all"] and configs["B"]["passes"] is True
    assert report["configuration_options"] == {"default": {}, "fp8-all": {"fp8": "all"}}
    assert configs["fp8-all"]["mean_abs_dp"] != configs["default"]["mean_abs_dp"]  # its own model, quantized
    for c in configs.values():
        assert c["n_requests"] == 3 and 0 < c["max_abs_dp"] < 0.05 and c["p99_abs_dp"] <= c["max_abs_dp"]
        agreement = c["decision_agreement"]
        assert agreement["n_questions"] == 3 and agreement["agreement"] == 1 - agreement["disagreements"] / 3
        assert c["accuracy"]["n"] == 3 and c["accuracy"]["accuracy"] == c["accuracy"]["correct"] / 3
    assert report["oracle_accuracy"]["n"] == 3
    assert report["hf_openjev"] == hf_openjev.__version__
    markdown = (out / "fidelity_export.md").read_text()
    assert "| `default` | 3 |" in markdown and "agreement with the oracle" in markdown
    assert (out / "fidelity_export.png").stat().st_size > 0
    assert json.loads((out / "fidelity_export.json").read_text())["configurations"]["B"]["passes"] is True


def test_a_sabotaged_configuration_fails_the_gate(export, tasks, tmp_path, monkeypatch):
    import hf_openjev.fast_path as fast_path

    real = fast_path.score_fast

    def noisy(model, token_requests, options=None):  # every fast-path score pushed off by a fixed pattern
        flat, caches = real(model, token_requests, options)
        return [s + (0.8 if i % 2 else -0.8) for i, s in enumerate(flat)], caches

    monkeypatch.setattr(fast_path, "score_fast", noisy)
    options = tmp_path / "exact-tails.json"
    options.write_text(json.dumps({"share_tails": True}))
    report = check_fidelity(model=export, out=tmp_path / "out", data=[tasks], configs=[str(options)],
                            oracle=first_oracle(export, tasks, tmp_path), progress=False)
    sabotaged = report["configurations"]["exact-tails"]
    assert report["configurations"]["B"]["passes"] is True
    assert sabotaged["passes"] is False and any("mean |dp|" in r for r in sabotaged["gate_reasons"])
    assert "`exact-tails` fails" in (tmp_path / "out" / "fidelity_export.md").read_text()


def test_default_is_the_models_own_and_packed_the_packages(export, tasks, tmp_path, monkeypatch):
    """A shape with defaults of its own (the 2B's; here the tiny shape registered as a member): ``default`` answers
    with them, a configuration's options change them only where named, ``packed`` is the package's defaults."""
    from hf_openjev import family
    from hf_openjev.fast_options import MEMBER_DEFAULTS, PACKED_2B

    config = json.loads((export / "config.json").read_text())
    shape = family.shape_of(type("Config", (), config.get("text_config", config)))
    member = family.FamilyMember("Open-Jev-Tiny", "none/tiny", shape, 1.0, tied=False)
    monkeypatch.setattr(family, "MEMBERS", (*family.MEMBERS, member))
    monkeypatch.setitem(MEMBER_DEFAULTS, member.name, dict(PACKED_2B, packed_candidates=False, shared_prefix=False))
    (tmp_path / "nograph.json").write_text(json.dumps({"cuda_graphs": False}))
    report = check_fidelity(model=export, out=tmp_path / "out", data=[tasks], progress=False,
                            configs=f"default,packed,{tmp_path / 'nograph.json'}")
    own = {"packed_candidates": False, "shared_prefix": False}
    assert report["configuration_options"] == {"default": own, "packed": {}, "nograph": {**own, "cuda_graphs": False}}


def first_oracle(export, tasks, tmp_path) -> Path:
    """An oracle of the tasks, built once per test (cheap: three tiny requests)."""
    out = tmp_path / "oracle-first"
    check_fidelity(model=export, out=out, data=[tasks], configs=[], progress=False)
    return out / "oracle_export.json"


def test_the_oracle_resumes_after_a_crash_and_appends_new_tasks(export, tasks, tmp_path, monkeypatch):
    real = oracle_module.score_oracle_request
    calls = []

    def crash_on_second(model, rid, kind, prepared):
        calls.append(rid)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(model, rid, kind, prepared)

    monkeypatch.setattr(oracle_module, "score_oracle_request", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        check_fidelity(model=export, out=tmp_path, data=[tasks], configs=[], limit=2, progress=False)
    kept = json.loads((tmp_path / "oracle_export.json").read_text())
    assert [e["id"] for e in kept["requests"]] == [calls[0]] and not kept["complete"]
    calls.clear()
    monkeypatch.setattr(oracle_module, "score_oracle_request", lambda *a: calls.append(a[1]) or real(*a))
    check_fidelity(model=export, out=tmp_path, data=[tasks], configs=[], progress=False)
    resumed = json.loads((tmp_path / "oracle_export.json").read_text())
    assert len(calls) == 2 and resumed["complete"] and resumed["n_done"] == 3  # the first one was not scored again
    assert resumed["requests"][0] == kept["requests"][0]


def test_a_gzipped_oracle_is_read_as_its_plain_json_and_a_corrupt_one_named(export, tasks, tmp_path, monkeypatch,
                                                                            capsys):
    """--oracle X.json.gz (as committed in data/bench/): the oracle of X.json, nothing scored again, the run's own
    oracle_<name>.json written as plain JSON; a cut .gz: one line naming the file, before anything loads."""
    plain = first_oracle(export, tasks, tmp_path)
    packed = tmp_path / "oracle_export.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes(), compresslevel=9, mtime=0))
    monkeypatch.setattr(oracle_module, "score_oracle_request", lambda *a: pytest.fail("the oracle was scored again"))
    report = check_fidelity(model=export, out=tmp_path / "out", data=[tasks], configs=[], oracle=packed,
                            progress=False)
    own = json.loads((tmp_path / "out" / "oracle_export.json").read_text())  # plain JSON
    assert own["requests"] == json.loads(plain.read_text())["requests"] and report["requests_compared"] == 3
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(packed.read_bytes()[:-20])
    capsys.readouterr()
    refuse_loading(monkeypatch)
    code = main(["fidelity", "--model", str(export), "--data", str(tasks), "--out", str(tmp_path / "out2"),
                 "--oracle", str(broken), "--configs", "default", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{broken} is not a valid gzip file" in err, err


def test_an_oracle_of_another_checkpoint_is_refused_before_any_scoring(export, tasks, tmp_path, monkeypatch):
    path = first_oracle(export, tasks, tmp_path)
    other = json.loads(path.read_text())
    other["weights_sha256"] = other["stored_weights_sha256"] = "0" * 64  # both fingerprints of other weights
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps(other))
    monkeypatch.setattr("hf_openjev.fidelity_check.run.answer_items",
                        lambda *a, **k: pytest.fail("scored before the oracle was checked"))
    with pytest.raises(UsageError, match="other weights"):
        check_fidelity(model=export, out=tmp_path / "a", data=[tasks], oracle=foreign, progress=False)
    other = json.loads(path.read_text())
    other["requests"][0]["tokens_sha256"] = "f" * 64  # the same task id, other token ids
    foreign.write_text(json.dumps(other))
    with pytest.raises(UsageError, match="other token ids"):
        check_fidelity(model=export, out=tmp_path / "b", data=[tasks], oracle=foreign, progress=False)


@pytest.mark.parametrize("extra, message", [
    (["--configs", "default,turbo"], "unknown configuration 'turbo'"),
    (["--configs", "missing.json"], "no such options file"),
    (["--configs", "BAD_JSON"], "unknown fast-path option"),
    (["--oracle", "nowhere.json"], "no such file"),
    (["--oracle-device", "offload"], "needs a CUDA GPU"),
    (["--data", "absent.jsonl"], "no such file or directory"),
    (["--workload", "BAD_SHAPES"], "is not an id / kind / prefix_tokens / suffix_tokens shape"),
])
def test_bad_options_are_refused_before_anything_loads(export, tasks, tmp_path, monkeypatch, capsys, extra,
                                                       message):
    refuse_loading(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps({"turbo": True}))
    (tmp_path / "shapes.json").write_text(json.dumps({"requests": [{"id": "r", "kind": "noul", "prefix_tokens": 3,
                                                                     "suffix_tokens": [1, 2]}]}))
    extra = [e.replace("BAD_JSON", "bad.json").replace("BAD_SHAPES", "shapes.json") for e in extra]
    data = [] if "--data" in extra or "--workload" in extra else ["--data", str(tasks)]
    if "offload" in extra and torch.cuda.is_available():
        pytest.fail("this case is written for a machine without CUDA")
    code = main(["fidelity", "--model", str(export), *data, "--out", "out", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_workload_is_the_benchmarks_request_for_request():
    """The package's workload gives the ids the committed oracles were built on (their per-request token hashes),
    so the command and the benchmark score the same requests."""
    bench = load_recipe("bench_jevbench")
    ours = build_workload(bench.SHAPES_FILE, vocab=bench.VOCAB, seed=0)
    oracle = read_committed_oracle("mid")
    assert len(ours) == len(oracle["requests"]) == 231
    assert [hash_tokens(p.tokens) for _, p in ours] == [r["tokens_sha256"] for r in oracle["requests"]]
    assert [p.tokens for _, p in build_workload(bench.SHAPES_FILE, vocab=bench.VOCAB, seed=1, limit=2)] != \
           [p.tokens for _, p in ours[:2]]


def test_the_command_on_a_workload(export, tmp_path, capsys):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"requests": [
        {"id": "w-choice", "kind": "choice", "prefix_tokens": 40, "suffix_tokens": [3, 5, 2]},
        {"id": "w-noul", "kind": "noul", "prefix_tokens": 30, "suffix_tokens": [4]}]}))
    code = main(["fidelity", "--model", str(export), "--workload", str(shapes), "--seed", "3", "--out",
                 str(tmp_path / "out"), "--name", "wl", "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "B: max |dp|" in printed and "default: max |dp|" in printed
    oracle = json.loads((tmp_path / "out" / "oracle_wl.json").read_text())
    expected = build_workload(shapes, vocab=1100, seed=3)
    assert [e["id"] for e in oracle["requests"]] == ["w-choice", "w-noul"]
    assert [e["tokens_sha256"] for e in oracle["requests"]] == [hash_tokens(p.tokens) for _, p in expected]
    report = json.loads((tmp_path / "out" / "fidelity_wl.json").read_text())
    assert report["configurations"]["default"]["accuracy"] is None and report["oracle_accuracy"] is None


LAYERS = {i: 10 * GB for i in range(8)}  # 80 GB of fp32 layers, 2 GB of embeddings and norms


@pytest.mark.parametrize("gpus, kind", [([], "cpu"), ([100 * GB], "cuda"), ([50 * GB, 50 * GB], "multi-gpu"),
                                        ([40 * GB], "offload")])
def test_the_oracle_goes_where_it_fits(gpus, kind):
    placement = choose_oracle_placement(requested="auto", layer_bytes=LAYERS, other_bytes=2 * GB,
                                        activations=GB, gpu_free=gpus, host_free=200 * GB)
    assert placement.kind == kind and placement.fp32_bytes == 82 * GB and kind in placement.describe()
    if kind in ("multi-gpu", "offload"):
        assert {f"layers.{i}" for i in range(8)} <= set(placement.device_map)
        assert placement.device_map["embed_tokens"] == 0
    if kind == "offload":
        assert placement.offloaded_bytes == 10 * GB * list(placement.device_map.values()).count("cpu") > 0


def test_a_placement_that_cannot_run_is_refused_in_one_line():
    common = dict(layer_bytes=LAYERS, other_bytes=2 * GB, activations=GB, host_free=200 * GB)
    with pytest.raises(ValueError, match="do not fit GPU 0"):
        choose_oracle_placement(requested="cuda", gpu_free=[40 * GB], **common)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        choose_oracle_placement(requested="offload", gpu_free=[], **common)
    with pytest.raises(ValueError, match="host has"):
        choose_oracle_placement(requested="cpu", gpu_free=[], **{**common, "host_free": 10 * GB})


def test_the_device_map_keeps_layers_in_order_within_each_budget():
    device_map = plan_device_map({0: 5, 1: 5, 2: 5}, 2, [12, 10], offload=False)
    assert [device_map[f"layers.{i}"] for i in range(3)] == [0, 0, 1]  # GPU 0: 12 - 2 of embeddings = two layers
    assert plan_device_map({0: 5, 1: 5, 2: 5}, 2, [12, 4], offload=False) is None
    offloaded = plan_device_map({0: 5, 1: 5, 2: 5}, 2, [12], offload=True)
    assert [offloaded[f"layers.{i}"] for i in range(3)] == [0, 0, "cpu"]


def test_the_estimate_grows_with_the_work_and_the_streamed_bytes():
    gpu = choose_oracle_placement(requested="auto", layer_bytes=LAYERS, other_bytes=2 * GB, activations=GB,
                                  gpu_free=[100 * GB], host_free=200 * GB)
    offload = choose_oracle_placement(requested="auto", layer_bytes=LAYERS, other_bytes=2 * GB, activations=GB,
                                      gpu_free=[40 * GB], host_free=200 * GB)
    small = estimate_oracle_seconds(gpu, tokens=1000, sequences=10)
    assert 0 < small < estimate_oracle_seconds(gpu, tokens=2000, sequences=10)
    assert estimate_oracle_seconds(offload, tokens=1000, sequences=10) > small


def test_the_benchmarks_oracle_is_reused_on_an_export_of_its_random_weights(tmp_path, monkeypatch):
    """recipes/oracle.py's file (today's ORACLE_FORMAT) and recipes/random_export.py's export of the same seeded
    weights: the fingerprints agree, nothing is scored again, and B's row is the benchmark's own B against it."""
    from test_oracle_recipe import run_oracle

    from hf_openjev.fidelity_check import entries_from_responses, items_from_workload
    from hf_openjev.fidelity_check.gate import compare_with_oracle, select_requests

    assert run_oracle(["--shape", "tiny", "--limit", "2", "--out", str(tmp_path)]) == 0
    bench_oracle = tmp_path / "oracle_tiny.json"
    export = load_recipe("random_export").write_random_export("tiny", tmp_path / "random-tiny")
    monkeypatch.setattr(oracle_module, "score_oracle_request", lambda *a: pytest.fail("the oracle was scored again"))
    report = check_fidelity(model=export, out=tmp_path / "out", workload=SHAPES, limit=2, oracle=bench_oracle,
                            configs="default", name="tiny", progress=False)
    oracle = json.loads(bench_oracle.read_text())
    assert report["oracle_sha256_check"]["run"] == oracle["weights_sha256"]
    bench = load_recipe("bench_jevbench")
    model = bench.build_model("tiny", seed=0, device="cpu")
    work = bench.build_workload(bench.SHAPES_FILE, vocab=bench.VOCAB, seed=0, limit=2)
    items = items_from_workload(work)
    b_entries = entries_from_responses(items, [r for _, r in bench.run_pass(model, work, fast=False)])
    b = compare_with_oracle(select_requests(oracle["requests"], [i.id for i in items]), b_entries)
    assert report["configurations"]["B"]["max_abs_dp"] == b.max_abs_dp > 0
    assert report["configurations"]["B"]["mean_abs_dp"] == b.mean_abs_dp


def test_named_configurations_and_options_files(tmp_path):
    from hf_openjev.family import MEMBERS, text_config_of
    from hf_openjev.fast_options import MEMBER_DEFAULTS, FastPathOptions
    from hf_openjev.fidelity_check.configs import options_of, parse_configs

    (tmp_path / "B.json").write_text("{}")
    (tmp_path / "big-packs.json").write_text(json.dumps({"max_sequences": 32}))
    configs = parse_configs(f"default, aligned,fp8-no-gdn,{tmp_path / 'big-packs.json'},packed")
    assert list(configs) == ["default", "aligned", "fp8-no-gdn", "big-packs", "packed"]
    assert configs["default"] == {} and configs["aligned"] == {"share_tails": False}
    tiny = types.SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4)
    assert options_of(configs["default"], tiny) == FastPathOptions()  # no member: the package's defaults
    assert options_of(configs["fp8-no-gdn"], tiny).fp8 == "no-gdn"
    assert options_of(configs["big-packs"], tiny).max_sequences == 32
    two_b = text_config_of(next(m for m in MEMBERS if m.name == "Open-Jev-2B"))
    assert options_of(configs["default"], two_b) == FastPathOptions.from_mapping(MEMBER_DEFAULTS["Open-Jev-2B"])
    assert options_of(configs["packed"], two_b) == FastPathOptions()  # the 2B packed: the package's defaults
    assert options_of(configs["aligned"], two_b).packed_candidates is False  # a change over the 2B's own
    assert options_of(None, two_b) is None  # B1
    with pytest.raises(ValueError, match="reserved for the reference path"):
        parse_configs([str(tmp_path / "B.json")])
    with pytest.raises(ValueError, match="given twice"):
        parse_configs("default,default")


def test_a_warmed_up_configuration_keeps_its_second_pass(export, tasks, monkeypatch):
    import hf_openjev.scoring as scoring
    from hf_openjev.eval.tasks import load_tasks, resolve_inputs
    from hf_openjev.fidelity_check.requests import answer_items, items_from_tasks
    from hf_openjev.model import load_export

    model = load_export(export, dtype="float32", device="cpu")
    items, _ = items_from_tasks(model, load_tasks(resolve_inputs([tasks]))[0][:2])
    real, calls = scoring.score_prepared, []

    def counted(*args, **kwargs):
        calls.append(args[1][0])
        result = real(*args, **kwargs)
        result.seconds = float(len(calls))  # marks which call answered (the response's inference_seconds)
        return result

    monkeypatch.setattr(scoring, "score_prepared", counted)
    responses = answer_items(model, items, fast=False, warm_up=True, progress=False)
    assert calls == [items[0].prepared, items[1].prepared] * 2
    assert [r["metadata"]["inference_seconds"] for r in responses] == [3.0, 4.0]  # the second pass's answers
    once = answer_items(model, items, fast=False, progress=False)
    assert [r["metadata"]["inference_seconds"] for r in once] == [5.0, 6.0]


def test_a_device_map_names_every_module_of_the_backbone(export, spec):
    """The map multi-gpu and offload load with (here every entry on the CPU, the one device a CPU test has):
    Transformers accepts its module names, and the model scores as the plain fp32 load does."""
    from hf_openjev.fidelity_check.placement import OraclePlacement, fp32_sizes, load_oracle_model
    from hf_openjev.model import load_export

    layer_bytes, other_bytes = fp32_sizes(export)
    assert sorted(layer_bytes) == [0, 1, 2, 3] and other_bytes > 0
    device_map = plan_device_map(layer_bytes, other_bytes, [10**12], offload=False)
    placement = OraclePlacement("multi-gpu", sum(layer_bytes.values()) + other_bytes, "test",
                                device_map={k: "cpu" for k in device_map})
    mapped, plain = load_oracle_model(export, placement), load_export(export, dtype="float32", device="cpu")
    modules = {n for n, _ in plain.backbone.named_children() if n != "layers"}
    assert set(device_map) == modules | {f"layers.{i}" for i in range(len(plain.backbone.layers))}  # all placed
    ids = list(range(1000, 1040))
    assert mapped.dtype == torch.float32 and spec.score(mapped, ids) == pytest.approx(spec.score(plain, ids), abs=1e-6)
    from hf_openjev.reference import score_reference

    assert score_reference(mapped, [ids]) == pytest.approx(score_reference(plain, [ids]), abs=1e-6)


def test_the_commands_help_imports_neither_torch_nor_transformers():
    import subprocess
    import sys

    code = ("import sys\nfrom hf_openjev.cli import build_parser\nhelp_text = build_parser('fidelity').format_help()\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.split() == ["False", "False"]
    help_text = subprocess.run([sys.executable, "-m", "hf_openjev", "fidelity", "--help"], capture_output=True,
                               text=True, check=True, timeout=120).stdout
    assert "--oracle-device" in help_text and "fp8-no-gdn" in help_text and "--workload" in help_text


def test_tasks_the_contract_rejects_all_leave_a_one_line_error(export, tmp_path):
    row = json.loads(JEVBENCH_EASY.read_text().splitlines()[0])
    row["state"] = "word " * 20000  # far over the export's max_length in tokens
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(UsageError, match="no request to compare: the contract rejects all 1 task"):
        check_fidelity(model=export, out=tmp_path / "out", data=[path], progress=False)


def test_a_limited_run_does_not_replace_a_full_report_unless_told(first_run, export, tasks, tmp_path, monkeypatch,
                                                                   capsys):
    """Issue 36: `fidelity --limit` into an --out holding a full report silently overwrote it. Now it is refused
    before anything loads unless --overwrite; a limited report records its limit and may be replaced."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(first_run[0], out)
    full = {p.name: p.read_bytes() for p in out.iterdir()}
    with monkeypatch.context() as patch:
        refuse_loading(patch)
        with pytest.raises(UsageError, match=r"already holds the full report fidelity_export.json of 3 requests, "
                                             r"which this --limit 1 run would replace; pass --overwrite"):
            check_fidelity(model=export, out=out, data=[tasks], configs=[], limit=1, progress=False)
        code = main(["fidelity", "--model", str(export), "--data", str(tasks), "--out", str(out), "--limit", "2",
                     "--configs", "default", "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == full
    assert json.loads(full["fidelity_export.json"])["limit"] is None  # a full report says so
    monkeypatch.setattr(oracle_module, "score_oracle_request", lambda *a: pytest.fail("the oracle was scored again"))
    check_fidelity(model=export, out=out, data=[tasks], configs=[], limit=1, overwrite=True, progress=False)
    assert json.loads((out / "fidelity_export.json").read_text())["limit"] == 1
    assert json.loads((out / "oracle_export.json").read_text())["n_done"] == 3  # the oracle keeps every entry
    check_fidelity(model=export, out=out, data=[tasks], configs=[], limit=2, progress=False)  # limited over limited
    assert json.loads((out / "fidelity_export.json").read_text())["requests_compared"] == 2


@pytest.mark.slow
def test_a_cut_run_keeps_the_configurations_it_finished_and_the_next_run_reuses_them(export, tasks, tmp_path,
                                                                                     monkeypatch):
    """A run cut while answering a configuration used to lose every answer (nothing was written before the report).
    Now B's answers survive the cut, the next run into the same --out answers only what is missing, and its report
    is the report of an uncut run."""
    import hf_openjev.fidelity_check.run as run_module

    oracle = first_oracle(export, tasks, tmp_path)
    uncut = check_fidelity(model=export, out=tmp_path / "uncut", data=[tasks], configs="default,aligned",
                           oracle=oracle, progress=False)
    real, answered, cut = run_module._answer, [], ["aligned"]

    def cut_at_aligned(model, items, *, desc, **kwargs):
        answered.append(desc)
        if desc in cut:
            raise KeyboardInterrupt  # a time limit, Ctrl-C
        return real(model, items, desc=desc, **kwargs)

    monkeypatch.setattr(run_module, "_answer", cut_at_aligned)
    out, logged = tmp_path / "out", []
    with pytest.raises(KeyboardInterrupt):
        check_fidelity(model=export, out=out, data=[tasks], configs="default,aligned", oracle=oracle, progress=False,
                       log=logged.append)
    # the finished configuration's verdict was logged before the cut, as the report states it
    from hf_openjev.fidelity_check.report import describe_verdict

    final = describe_verdict("default", {**uncut["configurations"]["default"], "decision_agreement": None,
                                         "accuracy": None})
    assert [line for line in logged if line.startswith("default: ")] == \
        [final + " (against the oracle given; the report follows at the end)"], logged
    kept = json.loads((out / "answers_export.json").read_text())
    assert answered == ["B: reference bf16", "default", "aligned"] and list(kept["configurations"]) == ["B", "default"]
    answered.clear()
    cut.clear()
    report = check_fidelity(model=export, out=out, data=[tasks], configs="default,aligned", oracle=oracle,
                            progress=False)
    assert answered == ["aligned"] and report["answers_reused"] == ["B", "default"]
    for name in ("B", "default", "aligned"):
        ours, theirs = report["configurations"][name], uncut["configurations"][name]
        assert ours["per_request_max_abs_dp"] == theirs["per_request_max_abs_dp"] and ours["passes"] == theirs["passes"]
    answered.clear()
    changed = tmp_path / "aligned.json"  # the same name, other options: answered again
    changed.write_text(json.dumps({"share_tails": False, "final_row_mlp": False}))
    report = check_fidelity(model=export, out=out, data=[tasks], configs=[str(changed)], oracle=oracle,
                            progress=False)
    assert answered == ["aligned"] and report["answers_reused"] == ["B"]
    answered.clear()
    monkeypatch.setenv("HF_OPENJEV_COMMIT", "0000001")  # another commit of this package: its fast path answers
    report = check_fidelity(model=export, out=out, data=[tasks], configs="default", oracle=oracle, progress=False)
    assert answered == ["default"] and report["answers_reused"] == ["B"]  # B is stock Transformers: reused
    assert report["git_commit"] == "0000001" and "Git commit: `0000001`" in (out / "fidelity_export.md").read_text()


def test_stored_fp8_answers_skip_loading_the_fp8_model(first_run, export, tasks, tmp_path, monkeypatch):
    import shutil

    import hf_openjev.fidelity_check.run as run_module

    out = tmp_path / "out"
    shutil.copytree(first_run[0], out)  # its answers_export.json holds B, default and fp8-all
    real, modes = run_module._load_bf16, []
    monkeypatch.setattr(run_module, "_load_bf16", lambda model, fp8, log, **kw: modes.append(fp8) or real(
        model, fp8, log, **kw))
    monkeypatch.setattr(run_module, "_answer", lambda *a, **k: pytest.fail("a configuration was answered again"))
    report = check_fidelity(model=export, out=out, data=[tasks], configs="default,fp8-all", progress=False)
    assert modes == ["off"] and report["answers_reused"] == ["B", "default", "fp8-all"]
    assert report["configurations"]["fp8-all"]["per_request_max_abs_dp"] == \
        first_run[1]["configurations"]["fp8-all"]["per_request_max_abs_dp"]


def test_an_unreadable_answers_file_is_refused_in_one_line_before_anything_loads(export, tasks, tmp_path,
                                                                                 monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "answers_export.json").write_text('{"format": "something else", "configurations": {}}')
    refuse_loading(monkeypatch)
    code = main(["fidelity", "--model", str(export), "--data", str(tasks), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "answers_export.json is not a hf-openjev-fidelity-answers/1 file; delete it" in err, err
    (out / "answers_export.json").write_text('{"format": ')
    code = main(["fidelity", "--model", str(export), "--data", str(tasks), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is not valid JSON" in err and "delete it to answer every configuration again" in err, err


def test_the_answer_store_keeps_other_requests_under_the_same_key_and_replaces_them_under_another(tmp_path):
    from types import SimpleNamespace

    from hf_openjev.fidelity_check.answers import AnswerStore

    def item(rid, sha="t"):
        return SimpleNamespace(id=rid, tokens_sha256=sha)

    def entry(rid, p, sha="t"):
        return {"id": rid, "kind": "noul", "probabilities": {"q": p}, "tokens_sha256": sha}

    path = tmp_path / "answers_x.json"
    key, other = {"options": {"a": 1}}, {"options": {"a": 2}}
    store = AnswerStore(path)
    store.record("c", key, [entry("r1", 0.1), entry("r2", 0.2)])
    store.record("c", key, [entry("r2", 0.3), entry("r3", 0.4)])  # a --limit run, say: r1 kept
    again = AnswerStore(path)  # read back from the file
    assert again.reuse("c", key, [item("r3"), item("r1")]) == [entry("r3", 0.4), entry("r1", 0.1)]
    assert again.reuse("c", key, [item("r1"), item("r4")]) is None  # one request missing
    assert again.reuse("c", key, [item("r1", "other ids")]) is None  # other token ids under the same id
    assert again.reuse("c", other, [item("r1")]) is None and again.reuse("d", key, [item("r1")]) is None
    again.record("c", other, [entry("r1", 0.5)])
    assert AnswerStore(path).configurations["c"] == {"key": other, "entries": [entry("r1", 0.5)]}


def test_b1_is_the_reference_path_one_candidate_per_forward_judged_like_a_configuration(export, tasks, tmp_path,
                                                                                        monkeypatch):
    """B1 measures the gate itself: B again with other padding (one candidate per forward), judged against B."""
    import hf_openjev.fidelity_check.run as run_module
    from hf_openjev.fidelity_check.configs import parse_configs

    assert parse_configs("B1,default")["B1"] is None
    oracle = first_oracle(export, tasks, tmp_path)
    real, calls = run_module.answer_items, []

    def recorded(model, items, *, fast, batch_size=32, **kwargs):
        calls.append((kwargs.get("desc"), fast, batch_size))
        return real(model, items, fast=fast, batch_size=batch_size, **kwargs)

    monkeypatch.setattr(run_module, "answer_items", recorded)
    report = check_fidelity(model=export, out=tmp_path, data=[tasks], configs="B1", oracle=oracle, progress=False)
    assert calls == [("B: reference bf16", False, 32), ("B1", False, 1)]
    assert report["configuration_options"] == {"B1": {"reference_path": "one candidate per forward"}}
    assert report["configurations"]["B1"]["passes"] in (True, False)  # judged against B like any configuration
    assert "`B1`" in (tmp_path / "fidelity_export.md").read_text()

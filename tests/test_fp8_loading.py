"""Loading for the FP8 fast path (CPU): ``load_export(..., fp8=MODE)`` builds the model on the CPU, swaps its
projections for ``Fp8Linear`` there (an FP8 export's own e4m3 bits; a bf16 export's weights quantized) and only then
moves it to its device, so the device never holds the bf16 weights; the fast path then answers exactly as a model
loaded normally and patched with the same mode. The pipeline, ``hf-openjev serve --fp8`` and ``hf-openjev eval
--fp8`` load that way, and refuse FP8 with the reference path before loading anything.

The CPU has no second device, so "before it moves" is observed where it happens: the loader is asked for the CPU,
and ``JevModel.to`` finds the FP8 modules already in place (the target is the meta device, which also shows that
everything, the e4m3 buffers included, moves with ``.to``). The GPU test at the end measures the peak itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from conftest import random_token_requests as _requests
from export_tensors import bits as _bits
from export_tensors import stored_tensors as _tensors
from serve_cli_args import forbid_loading, serve_parser

import hf_openjev
from hf_openjev.checkpoint.fp8_scheme import resolve_fp8_targets
from hf_openjev.errors import CheckpointError, UsageError
from hf_openjev.fast_options import FastPathOptions
from hf_openjev.fast_path import score_fast
from hf_openjev.fp8 import swap as fp8_swap
from hf_openjev.fp8.linear import Fp8Linear
from hf_openjev.fp8.quantize import quantize_export
from hf_openjev.fp8.swap import fp8_modules, quantize_model_fp8
from hf_openjev.model import JevModel, load_export
from hf_openjev.ops.fp8_linear import FP8_DTYPE
from hf_openjev.patches import apply_patches, read_options
from hf_openjev.scoring import answer_requests
from hf_openjev.serve import cli as serve_cli

SWAPPED = {"all": 25, "no-gdn": 16}  # Fp8Linear modules of the tiny model per mode
FP8_EFFECT = 1e-3  # |Δp| that FP8 itself moves at least one probability of the tiny model by (checked below)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


@pytest.fixture(scope="module")
def fp8_export(tiny_checkpoint, tmp_path_factory):
    return quantize_export(tiny_checkpoint.export, tmp_path_factory.mktemp("fp8-load") / "all",
                           progress=False).out_dir


def _fp8_layers(model) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.backbone.named_modules() if isinstance(m, Fp8Linear)}




def _record_moves(monkeypatch) -> list[tuple[str, int]]:
    """Every ``JevModel.to`` call as (where to, how many Fp8Linear the model holds at that moment)."""
    moves = []
    original = JevModel.to

    def recording(self, *args, **kwargs):
        moves.append((str(args[0] if args else kwargs.get("device")), len(_fp8_layers(self))))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JevModel, "to", recording)
    return moves


# --- load_export(..., fp8=MODE) ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, mode", [("fp8", "all"), ("bf16", "all"), ("fp8", "no-gdn")])
def test_fp8_loading_builds_on_the_cpu_and_moves_the_fp8_model(kind, mode, fp8_export, tiny_checkpoint,
                                                               monkeypatch):
    import hf_openjev.fp8.loading
    import hf_openjev.model

    model_module, loader = ((hf_openjev.fp8.loading, "load_fp8_backbone") if kind == "fp8"
                            else (hf_openjev.model, "load_backbone"))
    asked = []
    real_loader = getattr(model_module, loader)
    monkeypatch.setattr(model_module, loader, lambda *a, device, **k: asked.append(device) or real_loader(
        *a, device=device, **k))
    moves = _record_moves(monkeypatch)
    path = fp8_export if kind == "fp8" else tiny_checkpoint.export
    model = load_export(path, dtype="bfloat16", device="meta", fp8=mode)
    assert asked == ["cpu"]  # built on the host, not on the target device
    assert moves == [("meta", SWAPPED[mode])]  # one move, of the model already in FP8
    assert fp8_modules(model) == resolve_fp8_targets(mode) and read_options(model).fp8 == mode
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.device.type == "meta" for t in tensors)  # Fp8Linear's buffers moved with the rest
    for layer in _fp8_layers(model).values():
        assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.dtype == torch.float32
    assert model.head.weight.dtype == torch.float32 and model.dtype == torch.bfloat16


def test_fp8_loading_serves_the_exports_own_bits_like_patching_a_normal_load(fp8_export, tiny_checkpoint,
                                                                             monkeypatch):
    lean = load_export(fp8_export, dtype="float32", device="cpu", fp8="all")
    stored = _tensors(fp8_export)
    layers = _fp8_layers(lean)
    assert len(layers) == SWAPPED["all"]
    for name, layer in layers.items():
        assert torch.equal(_bits(layer.weight), _bits(stored[f"{name}.weight"])), name
        assert torch.equal(layer.weight_scale, stored[f"{name}.weight_scale"]), name
    bf16_lean = load_export(tiny_checkpoint.export, dtype="float32", device="cpu", fp8="all")
    for name, layer in _fp8_layers(bf16_lean).items():  # a bf16 export: quantized on the CPU, the same bits
        assert torch.equal(_bits(layer.weight), _bits(stored[f"{name}.weight"])), name

    def no_swap(*args, **kwargs):
        raise AssertionError("apply_patches swapped a projection of a model loaded with the same fp8 mode")

    with monkeypatch.context() as patch:
        patch.setattr(fp8_swap, "_from_source", no_swap)
        patch.setattr(fp8_swap, "quantize_linear", no_swap)
        assert quantize_model_fp8(lean, "all") == 0
        apply_patches(lean, FastPathOptions(fp8="all"))
    assert all(_fp8_layers(lean)[name] is layer for name, layer in layers.items())  # the same modules

    normal = load_export(fp8_export, dtype="float32", device="cpu")
    apply_patches(normal, FastPathOptions(fp8="all"))
    requests = _requests(lean)
    got, _ = score_fast(lean, requests)
    want, _ = score_fast(normal, requests)
    assert len(got) == 9 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-6


def test_after_fp8_loading_a_wider_mode_swaps_the_rest_and_a_narrower_one_is_refused(fp8_export):
    narrow = load_export(fp8_export, dtype="float32", device="cpu", fp8="no-gdn")
    assert len(_fp8_layers(narrow)) == SWAPPED["no-gdn"]
    apply_patches(narrow, FastPathOptions(fp8="all"))  # the GDN's projections: from the export's bits
    assert len(_fp8_layers(narrow)) == SWAPPED["all"] and fp8_modules(narrow) == resolve_fp8_targets("all")
    wide = load_export(fp8_export, dtype="float32", device="cpu", fp8="all")
    for mode in ("no-gdn", "off"):
        with pytest.raises(ValueError, match="already FP8 .* cannot be turned off or narrowed"):
            apply_patches(wide, FastPathOptions(fp8=mode))


def test_from_pretrained_passes_fp8_on(fp8_export):  # pipeline(..., model_kwargs={"fp8": ...}, device_map=...)
    model = JevModel.from_pretrained(str(fp8_export), dtype="float32", device_map="cpu", fp8="no-gdn")
    assert len(_fp8_layers(model)) == SWAPPED["no-gdn"] and read_options(model).fp8 == "no-gdn"


def test_bad_fp8_loads_are_refused_before_anything_is_read(tmp_path):
    missing = tmp_path / "no-export"
    with pytest.raises(CheckpointError):  # what a load of this directory meets first otherwise
        load_export(missing)
    with pytest.raises(UsageError, match="fp8 must be one of 'off', 'all', 'no-gdn', got 'on'"):
        load_export(missing, fp8="on")
    with pytest.raises(UsageError, match="pass device='cuda:N' instead of a device_map"):
        load_export(missing, device={"": "cpu"}, fp8="all")


# --- the pipeline -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, fast, swapped", [({"fp8": "no-gdn"}, True, 16),
                                                    ({"fast_options": FastPathOptions(fp8="all")}, True, 25),
                                                    ({"fp8": "all"}, False, 0)])
def test_a_pipeline_for_the_fast_path_quantizes_a_cpu_model_before_moving_it(options, fast, swapped,
                                                                            tiny_checkpoint, monkeypatch):
    from transformers import pipeline

    hf_openjev.register_pipeline()
    model = load_export(tiny_checkpoint.export, dtype="float32", device="cpu")
    moves = _record_moves(monkeypatch)
    pipeline("jev-decision", model=model, device="meta", fast=fast, **options)
    assert moves == [("meta", swapped)]  # the reference path (fast=False): fp8 does not apply, nothing swapped


# --- hf-openjev serve --fp8 -------------------------------------------------------------------------------------------

def test_serve_fp8_flag_reaches_serve(monkeypatch, capsys):
    from hf_openjev.serve import startup

    seen = {}
    monkeypatch.setattr(startup, "serve", lambda model_dir, **kw: seen.update(kw) or 0)
    assert serve_cli.run(serve_parser().parse_args(["--model", "/x", "--fp8", "no-gdn", "--devices", "cpu,cpu"])) == 0
    assert seen["fp8"] == "no-gdn" and seen["devices"] == "cpu,cpu" and seen["fast"] is None
    serve_cli.run(serve_parser().parse_args(["--model", "/x"]))
    assert seen["fp8"] == "off"
    with pytest.raises(SystemExit) as info:
        serve_parser().parse_args(["--model", "/x", "--fp8", "on"])
    assert info.value.code == 2 and "invalid choice: 'on'" in capsys.readouterr().err


def test_serve_refuses_fp8_with_the_reference_path_before_anything_else(tmp_path, monkeypatch, capsys):
    forbid_loading(monkeypatch, "--fp8 check")
    args = serve_parser().parse_args(["--model", str(tmp_path / "no-export"), "--fp8", "all", "--reference",
                                       "--port", "0"])  # not even the export directory is checked first
    assert serve_cli.run(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-openjev serve: error: --fp8 all is a fast-path option but --reference")
    assert "\n" not in err
    assert "drop --reference to run FP8" in err and "drop --fp8" in err


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _max_gap(a: dict, b: dict) -> float:
    """The largest |Δp| between two responses' answers (``noul``, or every label's probability)."""
    gaps = []
    for qid, answer in a["answers"].items():
        other = b["answers"][qid]
        if answer["type"] == "noul":
            gaps.append(abs(answer["noul"] - other["noul"]))
        else:
            gaps += [abs(p - other["probabilities"][label]) for label, p in answer["probabilities"].items()]
    return max(gaps)


@pytest.mark.slow
def test_serve_fp8_answers_from_fp8_replicas(fp8_export, tmp_path):
    """``hf-openjev serve --devices cpu,cpu --fp8 all`` in a subprocess: both replicas load in FP8, requests sent one
    at a time are answered on the fast path as the same model loaded here answers them (to the fp32 noise of
    another process's thread count, which FP8's rounding may amplify a little), and not as the bf16 weights do."""
    from test_server import assert_same_answers, make_request

    port = _free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hf_openjev.cli", "serve", "--model", str(fp8_export),
                                 "--port", str(port), "--devices", "cpu,cpu", "--dtype", "float32", "--fp8", "all"],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server did not come up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        requests = [make_request(i) for i in range(3)]
        responses = [httpx.post(url + "/v1/systemone", json=r, timeout=60) for r in requests]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [r.status_code for r in responses] == [200] * 3, log_path.read_text()
    assert all(r.json()["metadata"]["method"] == "fast" for r in responses)
    lean = load_export(fp8_export, dtype="float32", device="cpu", fp8="all")
    apply_patches(lean, FastPathOptions(fp8="all"))
    bf16 = load_export(fp8_export, dtype="float32", device="cpu")
    apply_patches(bf16, FastPathOptions())
    fp8_effect = 0.0
    for request, response in zip(requests, responses):
        want = answer_requests(lean, [request], fast=True)[0]
        assert_same_answers(response.json(), want, tol=1e-4)
        fp8_effect = max(fp8_effect, _max_gap(want, answer_requests(bf16, [request], fast=True)[0]))
    assert fp8_effect > 10 * 1e-4  # FP8 shows in the answers: the comparison above can fail
    text = log_path.read_text()
    assert "fp8 all: FP8 projections on the fast path" in text and "does not pass the fidelity gate" in text
    for n in (1, 2):  # each replica loaded in FP8 (on the CPU here, as it would be before moving to its GPU)
        assert f"replica {n} of 2 loaded on cpu with fp8 all (25 FP8 projections)" in text
    assert "Traceback" not in text


# --- hf-openjev eval --fp8 --------------------------------------------------------------------------------------------

def _few_tasks(tmp_path, n=3):
    from repo_data import JEVBENCH_EASY

    if not JEVBENCH_EASY.is_file():
        pytest.skip("the JevBench sample is not available")
    rows = [json.loads(line) for line in JEVBENCH_EASY.read_text(encoding="utf-8").splitlines() if line.strip()]
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:n]), encoding="utf-8")
    return path, rows[:n]


def test_eval_fp8_scores_the_fp8_model_and_keeps_its_results_apart(fp8_export, tmp_path):
    from hf_openjev.eval import metrics as M
    from hf_openjev.eval.evaluate import EvalInputError, evaluate
    from hf_openjev.eval.tasks import task_from_row

    data, rows = _few_tasks(tmp_path)
    out = tmp_path / "out"
    cpu = {"device": "cpu", "dtype": "float32", "progress": False, "batch_size": 16}
    summary = evaluate(model=fp8_export, data=[data], out_dir=out, fp8="all", **cpu)
    assert summary["counts"]["scored"] == 3 and summary["model"]["fp8"] == "all"
    assert json.loads((out / "run.json").read_text())["fp8"] == "all"
    assert "FP8 projections `all`" in (out / "report.md").read_text()
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    tasks = [task_from_row(r, tier="few", file=str(data), line=i + 1) for i, r in enumerate(rows)]
    lean = load_export(fp8_export, dtype="float32", device="cpu", fp8="all")
    bf16 = load_export(fp8_export, dtype="float32", device="cpu")
    for model, close in ((lean, True), (bf16, False)):  # one batch, as the run scored it
        apply_patches(model, read_options(model))  # the fp8 mode it was loaded with, else bf16
        answers = answer_requests(model, [t.request for t in tasks], fast=True)
        gaps = [abs(record["probabilities"][label] - p)
                for task, record, answer in zip(tasks, records, answers)
                for label, p in M.distribution(task.kind, answer["answers"][task.qid], task.labels).items()]
        assert (max(gaps) <= 1e-6) if close else (max(gaps) > FP8_EFFECT), (close, max(gaps))
    with pytest.raises(EvalInputError, match="another model, FP8 mode, dtype or fast-path options .*fp8 all"):
        evaluate(model=fp8_export, data=[data], out_dir=out, **cpu)  # bf16 answers never join FP8 ones


def test_eval_fp8_misuse_is_refused_before_any_work(fp8_export, tmp_path, capsys):
    import argparse

    from hf_openjev.eval import cli as eval_cli
    from hf_openjev.eval.evaluate import evaluate

    missing = tmp_path / "no-data.jsonl"  # nothing is read: the data would be refused otherwise
    loaded = load_export(fp8_export, dtype="float32", device="cpu")
    with pytest.raises(UsageError, match="fp8='all' is set up when evaluate loads an export directory"):
        evaluate(model=loaded, data=[missing], out_dir=tmp_path / "o", fp8="all")
    with pytest.raises(UsageError, match="fp8 must be one of 'off', 'all', 'no-gdn', got 'on'"):
        evaluate(model=fp8_export, data=[missing], out_dir=tmp_path / "o", fp8="on")
    with pytest.raises(UsageError, match="fp8 all is a fast-path option but fast=False"):
        evaluate(model=fp8_export, data=[missing], out_dir=tmp_path / "o", fp8="all", fast=False)
    parser = argparse.ArgumentParser()
    eval_cli.add_arguments(parser)
    args = parser.parse_args(["--model", str(fp8_export), "--data", str(missing), "--out", str(tmp_path / "o"),
                              "--fp8", "no-gdn", "--no-fast"])
    assert eval_cli.run(args) == 2
    err = capsys.readouterr().err
    assert "--fp8 no-gdn is a fast-path option but --no-fast asks for the reference path" in err
    assert not (tmp_path / "o").exists()


# --- on the H200 (pytest -m gpu) --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_loading_never_holds_the_bf16_weights_on_the_gpu(fp8_export):
    """The GPU's peak while loading is the FP8 model it ends with (no bf16 copy on the way), and that is less than
    the bf16 model."""
    bf16 = load_export(fp8_export, dtype="bfloat16", device="cpu")
    bf16_bytes = sum(t.numel() * t.element_size() for t in [*bf16.parameters(), *bf16.buffers()])
    del bf16
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = load_export(fp8_export, dtype="bfloat16", device="cuda", fp8="all")
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    assert all(t.is_cuda for t in [*model.parameters(), *model.buffers()])
    assert peak <= held + 2**20 and held < bf16_bytes, (peak, held, bf16_bytes)

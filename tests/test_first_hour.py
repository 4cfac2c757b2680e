"""Issue 20, "the first hour of a new user": the mistakes a new user makes end in one clear line.

No flash-linear-attention advice on CPU; a CUDA device without CUDA, a busy port, a published package or a mistyped
path where an export is expected give a one-line error (exit 2 on the command line, a ``ValueError`` from the
pipeline); eval fails loudly when nothing was scored, says when it resumes and advances its bar per task; request
errors keep the contract's wording and add a detail naming the question and field.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import pytest
import torch
from repo_data import JEVBENCH_EASY as EASY
from repo_data import repo_path
from starlette.testclient import TestClient

import hf_openjev
from hf_openjev.contract import parse_request
from hf_openjev.devices import check_device
from hf_openjev.errors import CheckpointError, RequestError, UsageError
from hf_openjev.family import MEMBERS
from hf_openjev.log_filter import _DropKernelInstallAdvice
from hf_openjev.model import load_export

FLA_ADVICE = ("`chunk_gated_delta_rule` is falling back to its reference PyTorch implementation because "
              "`flash-linear-attention` is not installed. This is correct but much slower; install "
              "`flash-linear-attention` for the optimized kernel.")
NOUL = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "yes?"}}}


def _cli(argv) -> int:
    from hf_openjev import cli

    return cli.main([str(a) for a in argv])


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def no_loading(monkeypatch):
    """Loading the model (or starting uvicorn) fails the test: every check must come first."""
    import uvicorn

    import hf_openjev.eval.evaluate  # noqa: F401 - imported before patching, so that it binds the real loader

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded (or the server started) before the check")

    monkeypatch.setattr("hf_openjev.model.load_export", refuse)
    monkeypatch.setattr("hf_openjev.eval.evaluate.load_export", refuse)
    monkeypatch.setattr(uvicorn.Server, "run", refuse)


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"hf-openjev {command}: error: "), err
    assert "Traceback" not in err, err
    return lines[-1]


# -- 1. no flash-linear-attention advice -------------------------------------------------------------------------

def test_a_cpu_run_prints_no_flash_linear_attention_advice(tiny_checkpoint):
    code = ("import hf_openjev\nfrom transformers import pipeline\n"
            f"jev = pipeline('jev-decision', model={str(tiny_checkpoint.export)!r}, device='cpu', dtype='float32')\n"
            f"print(jev({NOUL!r})['answers']['q']['type'])\n")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "noul"  # a forward ran: the warning fires on the first GDN forward
    assert "flash-linear-attention" not in out.stderr, out.stderr


def test_the_filter_drops_that_advice_only(tiny_model):
    keep = _DropKernelInstallAdvice()

    def record(message):
        return logging.LogRecord("transformers.integrations.hub_kernels", logging.WARNING, __file__, 1, message,
                                 None, None)

    assert not keep.filter(record(FLA_ADVICE))
    assert keep.filter(record(FLA_ADVICE.replace("flash-linear-attention", "flash-attention")))
    assert keep.filter(record("some other warning"))
    # installed by the loaders (tiny_model was loaded), once however many loads
    hub = logging.getLogger("transformers.integrations.hub_kernels")
    assert sum(isinstance(f, _DropKernelInstallAdvice) for f in hub.filters) == 1


# -- 2. CUDA without CUDA ----------------------------------------------------------------------------------------

def test_check_device(no_cuda):
    for ok in (None, "cpu", torch.device("cpu"), -1, {"": "cpu"}):
        check_device(ok)
    for bad in ("cuda", "cuda:0", 0, torch.device("cuda", 1), {"": "cuda"}):
        with pytest.raises(UsageError, match="CUDA is not available on this machine"):
            check_device(bad)
    with pytest.raises(UsageError, match="unknown device 'gpu'"):
        check_device("gpu")
    assert issubclass(UsageError, ValueError)


def test_load_export_on_cuda_without_cuda(tiny_checkpoint, no_cuda):
    with pytest.raises(ValueError, match=r"^device 'cuda' was requested but CUDA is not available"):
        load_export(tiny_checkpoint.export, device="cuda")


def test_pipeline_on_cuda_without_cuda(tiny_checkpoint, tiny_model, no_cuda, monkeypatch):
    import transformers.pipelines as tp

    monkeypatch.setattr("hf_openjev.model.load_export",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded before the device check")))
    with pytest.raises(ValueError, match="CUDA is not available on this machine"):
        tp.pipeline("jev-decision", model=str(tiny_checkpoint.export), device="cuda")
    with pytest.raises(ValueError, match="CUDA is not available on this machine"):  # a loaded model: the class checks
        tp.pipeline("jev-decision", model=tiny_model, device="cuda")
    assert tiny_model.device.type == "cpu"


def test_eval_and_serve_on_cuda_without_cuda_exit_2(tiny_checkpoint, tmp_path, no_cuda, no_loading, capsys):
    export = tiny_checkpoint.export
    assert _cli(["eval", "--model", export, "--data", EASY, "--out", tmp_path / "o", "--device", "cuda"]) == 2
    assert "CUDA is not available" in _one_line_error(capsys, "eval")
    assert _cli(["serve", "--model", export, "--device", "cuda", "--port", "0"]) == 2
    assert "CUDA is not available" in _one_line_error(capsys, "serve")
    assert _cli(["demo", "--cache-dir", tiny_checkpoint.root, "--device", "cuda"]) == 2  # through hf_openjev.cli
    assert "CUDA is not available" in _one_line_error(capsys, "demo")


# -- 2. a busy port, a package or a mistyped path where an export is expected -------------------------------------

def test_serve_reports_a_busy_port_before_loading(tiny_checkpoint, no_loading, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert _cli(["serve", "--model", tiny_checkpoint.export, "--device", "cpu", "--port", port]) == 2
    assert f"port {port} on 127.0.0.1 is already in use" in _one_line_error(capsys, "serve")


def test_a_package_or_a_missing_path_where_an_export_is_expected(tiny_checkpoint, tmp_path, no_loading, capsys):
    import transformers.pipelines as tp

    package, missing = tiny_checkpoint.package, tmp_path / "exprot"
    said_package = f"{package} is not a complete merged Open-Jev export: it is a published Open-Jev package"
    said_missing = f"{missing} is not a directory (it does not exist)"
    for model, said in ((package, said_package), (missing, said_missing)):
        with pytest.raises(CheckpointError) as info:
            tp.pipeline("jev-decision", model=str(model))
        assert said in str(info.value)
        assert _cli(["eval", "--model", model, "--data", EASY, "--out", tmp_path / "o", "--device", "cpu"]) == 2
        assert said in _one_line_error(capsys, "eval")
        assert _cli(["serve", "--model", model, "--device", "cpu", "--port", "0"]) == 2
        assert said in _one_line_error(capsys, "serve")
    with pytest.raises(CheckpointError, match=r"--package .* --out EXPORT_DIR` and pass EXPORT_DIR"):
        tp.pipeline("jev-decision", model=str(package))
    with pytest.raises(CheckpointError, match="it looks like a Qwen3.5 base model"):
        tp.pipeline("jev-decision", model=str(tiny_checkpoint.base))


def _documented_section(pointer: str) -> str:
    """The text of the section a pointer such as ``GET_CHECKPOINT_DOCS`` names: a document, a space, a quoted
    heading (a missing document or heading fails the test)."""
    path, heading = pointer.split(" ", 1)
    text = repo_path(path).read_text(encoding="utf-8")
    marker = f"## {heading.strip(chr(34))}\n"
    assert marker in text, f"{path} has no heading {marker.strip()!r}"
    return text.split(marker, 1)[1].split("\n## ", 1)[0]


def test_a_missing_checkpoint_points_to_the_section_saying_how_to_download_one(tiny_checkpoint, tmp_path):
    """Issue 36 item 11: "download it first" names the section giving the repo ids and the download command."""
    from hf_openjev.export.merge import merge_lora

    pointer = 'docs/checkpoints.md "Getting a checkpoint"'

    with pytest.raises(CheckpointError, match="not a Hub repo id") as info:
        load_export("open-jev/Open-Jev-2B")
    assert pointer in str(info.value)
    for base, package in ((tmp_path / "no-base", tiny_checkpoint.package), (tiny_checkpoint.base, tmp_path / "no-pkg")):
        with pytest.raises(CheckpointError, match="does not exist") as info:
            merge_lora(base, package, tmp_path / "out")
        assert pointer in str(info.value)
    section = _documented_section(pointer)
    assert "hf download" in section and "--revision" in section
    for member in MEMBERS:
        assert member.base in section


# -- 4. eval does not hide failure --------------------------------------------------------------------------------

def _rows(n):
    return [json.loads(line) for line in EASY.read_text(encoding="utf-8").splitlines() if line.strip()][:n]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_eval_with_no_valid_task_exits_2(tiny_checkpoint, tmp_path, capsys):
    bad = _write(tmp_path / "bad.jsonl", [dict(_rows(1)[0], state=42)])
    rc = _cli(["eval", "--model", tiny_checkpoint.export, "--data", bad, "--out", tmp_path / "o", "--device", "cpu",
               "--dtype", "float32", "--no-progress"])
    assert rc == 2
    line = _one_line_error(capsys, "eval")
    assert "no task was scored: all 1 task(s) are invalid" in line
    assert "state must be text, a JSON object, or an array (state is a number)" in line  # the detail, too


def test_eval_resume_says_so_and_starts_the_bar_there(tiny_checkpoint, tmp_path, capsys):
    from hf_openjev.eval.evaluate import evaluate

    out = tmp_path / "o"
    opts = {"model": tiny_checkpoint.export, "out_dir": out, "device": "cpu", "dtype": "float32"}
    evaluate(data=[_write(tmp_path / "easy.jsonl", _rows(3))], progress=False, **opts)
    capsys.readouterr()
    evaluate(data=[_write(tmp_path / "easy.jsonl", _rows(5))], progress=True, **opts)
    err = capsys.readouterr().err
    assert "hf-openjev eval: resuming: 3 of 5 tasks done" in err
    assert " 3/5 [" in err and " 0/2 [" not in err


def test_eval_bar_advances_per_task(tiny_checkpoint, tmp_path, monkeypatch):
    import tqdm.auto

    from hf_openjev.eval.evaluate import evaluate

    updates = []

    class Bar(tqdm.auto.tqdm):
        def update(self, n=1):
            updates.append(n)
            return super().update(n)

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    rows = _rows(24)
    evaluate(model=tiny_checkpoint.export, data=[_write(tmp_path / "easy.jsonl", rows)], out_dir=tmp_path / "o",
             batch_size=24, device="cpu", dtype="float32", progress=True)
    assert sum(updates) == 24
    assert len([n for n in updates if n]) >= 3 and max(updates) < 24  # one batch, several forwards of 32 sequences


def test_reliability_legend_covers_no_bar(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from hf_openjev.eval.report import plot_reliability

    figures = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), original(self, *a, **k))[1])
    bins = [{"lo": k / 10, "hi": (k + 1) / 10, "n": 5, "confidence": k / 10 + 0.05, "accuracy": 1.0}
            for k in range(10)]  # every bar full height: any legend inside the axes covers one
    plot_reliability({"reliability": bins, "overall": {"n": 50, "ece": 0.5}}, tmp_path / "r.png")
    [fig] = figures
    fig.canvas.draw()
    top = fig.axes[0]
    legend = top.get_legend().get_window_extent()
    assert legend.y0 >= top.get_window_extent().y1 - 0.5  # above the axes, under the title
    assert (tmp_path / "r.png").stat().st_size > 0


# -- 5. messages that name the problem ----------------------------------------------------------------------------

DETAILS = [
    ({"urgency": {"type": "score", "instructions": "how urgent?"}}, "Score requires an array",
     "question 'urgency': criteria is missing; a score question needs an array of 2 to 10 levels"),
    ({"team": {"type": "choice", "instructions": "who?", "criteria": ["a", "b"]}}, "Choice requires an object",
     "question 'team': criteria is an array; a choice question needs an object"),
    ({"team": {"type": "choice", "criteria": {"a": None}}},
     "instructions and descriptions must be text, an object, or an array", "question 'team': instructions is missing"),
    ({"team": {"type": "choice", "instructions": "i", "criteria": {"a": 3}}},
     "instructions and descriptions must be text, an object, or an array",
     "question 'team': the description of option 'a' is a number"),
    ({"n": {"type": "noul", "instructions": "i", "criteria": {"true": "y"}}},
     "Noul criteria must contain true and false descriptions", "question 'n': criteria has keys ['true']"),
    ({"n": {"instructions": "i"}}, "question type must be choice, score, or noul", "question 'n': type is missing"),
    ({"s": {"type": "score", "instructions": "i", "criteria": ["low"]}}, "Score requires 2 to 10 descriptive levels",
     "question 's': criteria has 1 levels"),
]


@pytest.mark.parametrize("questions,message,detail", DETAILS)
def test_request_errors_keep_the_message_and_name_the_field(questions, message, detail):
    with pytest.raises(RequestError) as info:
        parse_request({"state": "s", "questions": questions})
    err = info.value
    assert err.message == message and err.status == 422  # the contract's wording
    assert str(err) == f"{message} ({err.detail})"  # an uncaught one names the question, the field and the value
    assert err.detail.startswith(detail), err.detail


def test_an_unknown_model_names_the_served_ones():
    with pytest.raises(RequestError) as info:
        parse_request({"model": "gpt-4", **NOUL}, served_models=("open-jev/x", "open-jev", "jev-latest"))
    assert info.value.message == "requested model is not loaded"
    assert str(info.value) == f"requested model is not loaded ({info.value.detail})"
    assert info.value.detail == ("model 'gpt-4' is not served here; served: 'open-jev/x', 'open-jev', 'jev-latest' "
                                 "(or leave model out)")


def test_the_server_adds_the_detail_without_changing_the_message(tiny_model):
    from hf_openjev.serve.app import create_app

    with TestClient(create_app(tiny_model)) as client:
        bad = {"state": "s", "questions": {"urgency": {"type": "score", "instructions": "how urgent?"}}}
        r = client.post("/v1/systemone", json=bad)
        body = r.json()
        assert r.status_code == 422 and set(body) == {"error", "detail"}
        assert body["error"] == body["detail"][0]["msg"] == "Score requires an array"
        assert body["detail"][0]["loc"] == ["body", "questions", "urgency"]
        assert body["detail"][0]["ctx"]["reason"].startswith("question 'urgency': criteria is missing")
        r = client.post("/v1/systemone", json={"model": "gpt-4", **NOUL})
        entry = r.json()["detail"][0]
        assert r.json()["error"] == entry["msg"] == "requested model is not loaded"
        for name in tiny_model.served_model_names:
            assert repr(name) in entry["ctx"]["reason"]


def test_the_pipeline_error_carries_the_detail(jev_cpu):
    with pytest.raises(RequestError) as info:
        jev_cpu({"state": "s", "questions": {"team": {"type": "choice", "instructions": "i", "criteria": ["a"]}}})
    assert info.value.message == "Choice requires an object"
    assert info.value.detail.startswith("question 'team': criteria is an array")
    assert str(info.value) == f"Choice requires an object ({info.value.detail})"


@pytest.fixture(scope="module")
def jev_cpu(tiny_model):
    import transformers.pipelines as tp

    assert hf_openjev  # registers the task
    return tp.pipeline("jev-decision", model=tiny_model, device="cpu")


# -- eval --limit, --no-progress, the pipeline's missing model and bad dtype -----------------------------------------

def test_eval_limit_is_checked_with_the_eval_usage_before_loading(tmp_path, no_loading, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cli(["eval", "--model", tmp_path / "missing", "--data", tmp_path / "missing.jsonl", "--limit", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: hf-openjev eval " in err
    assert err.strip().splitlines()[-1] == "hf-openjev eval: error: argument --limit: must be at least 1, got 0"


def test_eval_no_progress_hides_every_bar_the_loading_one_included(tiny_checkpoint, tmp_path, capsys):
    data = _write(tmp_path / "easy.jsonl", _rows(3))
    rc = _cli(["eval", "--model", tiny_checkpoint.export, "--data", data, "--out", tmp_path / "o", "--device", "cpu",
               "--dtype", "float32", "--no-progress", "--limit", "2"])
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("2 tasks scored")
    assert "Loading weights" not in captured.err and "it/s]" not in captured.err, captured.err
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # restored for whatever runs next


def test_eval_no_progress_without_limit_hides_the_loading_bar(tiny_checkpoint, tmp_path, capsys):
    data = _write(tmp_path / "easy.jsonl", _rows(1))
    rc = _cli(["eval", "--model", tiny_checkpoint.export, "--data", data, "--out", tmp_path / "o", "--device", "cpu",
               "--dtype", "float32", "--no-progress"])
    assert rc == 0
    assert "Loading weights" not in capsys.readouterr().err


def test_pipeline_without_a_model_says_to_pass_one():
    from transformers import pipeline

    with pytest.raises(UsageError) as info:
        pipeline("jev-decision")
    message = str(info.value)
    assert "\n" not in message and "model=" in message


def test_pipeline_bad_dtype_is_refused_before_anything_loads(tiny_checkpoint, monkeypatch, caplog):
    from transformers import pipeline

    from hf_openjev.errors import UnknownDtypeError

    def refuse(*args, **kwargs):
        raise AssertionError("the export was read before the dtype was checked")

    monkeypatch.setattr("hf_openjev.model.load_export", refuse)
    monkeypatch.setattr("hf_openjev.model.load_tokenizer", refuse)
    with pytest.raises(UnknownDtypeError) as info:
        pipeline("jev-decision", model=str(tiny_checkpoint.export), device="cpu", dtype="bf16")
    message = str(info.value)
    assert "\n" not in message and "'bfloat16', 'float16', 'float32' or 'auto'" in message
    assert "Falling back" not in caplog.text

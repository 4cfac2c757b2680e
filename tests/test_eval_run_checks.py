"""What eval and export check before loading, and how they end on an expected condition (issue 28, findings 7 and
9): hf_openjev.eval.run_checks, the dtype, FP8 mode and fast-path options in the resume fingerprint, a torn record
repaired on resume, a full disk as one line."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from repo_data import JEVBENCH_EASY as EASY

import hf_openjev.cli as cli
from hf_openjev.errors import UsageError
from hf_openjev.eval import evaluate as ev
from hf_openjev.eval.evaluate import EvalInputError, evaluate
from hf_openjev.eval.run_checks import drop_torn_records

CPU = {"device": "cpu", "progress": False}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _few(tmp_path: Path, n: int = 3) -> Path:
    rows = [line for line in EASY.read_text(encoding="utf-8").splitlines() if line.strip()][:n]
    path = tmp_path / "few.jsonl"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("loaded before the options were checked")

    monkeypatch.setattr(ev, "load_export", refuse)
    monkeypatch.setattr("hf_openjev.checkpoint.manifest.read_manifest", refuse)


@pytest.mark.parametrize("options, error, message", [
    ({"batch_size": 0}, UsageError, r"batch_size \(--batch-size\) must be a positive integer"),
    ({"dtype": "bf16"}, UsageError, r"unknown dtype 'bf16'"),
    ({"out_dir": "FILE"}, EvalInputError, r"is a file; pass a directory"),
    ({"out_dir": "FILE/sub"}, EvalInputError, r"is a file, so the directory cannot be created"),
])
def test_bad_options_are_refused_before_anything_loads(options, error, message, tiny_checkpoint, tmp_path,
                                                       no_loading):
    (tmp_path / "FILE").write_text("not a directory")
    kwargs = {"out_dir": tmp_path / "out", "batch_size": 16, "dtype": "float32", **options}
    if isinstance(kwargs["out_dir"], str):
        kwargs["out_dir"] = tmp_path / kwargs["out_dir"]
    with pytest.raises(error, match=message):
        evaluate(model=tiny_checkpoint.export, data=[_few(tmp_path)], **CPU, **kwargs)
    assert not (tmp_path / "out").exists()


def test_the_cli_answers_bad_options_with_one_line(tiny_checkpoint, tmp_path, no_loading, capsys):
    (tmp_path / "FILE").write_text("x")
    base = ["eval", "--model", str(tiny_checkpoint.export), "--data", str(_few(tmp_path)), "--device", "cpu"]
    assert cli.main(base + ["--out", str(tmp_path / "FILE")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-openjev eval: error: --out ") and "is a file" in err and "\n" not in err
    with pytest.raises(SystemExit) as info:
        cli.main(base + ["--batch-size", "0"])
    assert info.value.code == 2 and "--batch-size: must be at least 1, got 0" in capsys.readouterr().err


def test_a_full_disk_is_one_line_in_eval_and_export(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "summary.json"))

    monkeypatch.setattr(ev, "write_outputs", full)
    argv = ["eval", "--model", str(tiny_checkpoint.export), "--data", str(_few(tmp_path, 2)), "--out",
            str(tmp_path / "out"), "--device", "cpu", "--dtype", "float32", "--no-progress"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the loading bar
    assert last.startswith("hf-openjev eval: error: the disk is full writing ") and "Traceback" not in err

    import hf_openjev.export.shard_writer as shard_writer

    monkeypatch.setattr(shard_writer.ShardWriter, "write", full)
    argv = ["export", "--base", str(tiny_checkpoint.base), "--package", str(tiny_checkpoint.package), "--out",
            str(tmp_path / "export"), "--no-progress"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("hf-openjev export: error: the disk is full")
    assert "Traceback" not in err
    assert not (tmp_path / "export").exists() and not list(tmp_path.glob(".export.*"))
    with pytest.raises(OSError):  # any other OSError is not an expected condition: it is not hidden
        monkeypatch.setattr(shard_writer.ShardWriter, "write",
                            lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
        cli.main(argv)


def test_a_torn_record_is_dropped_on_resume_and_the_file_stays_valid_jsonl(tiny_model, tmp_path):
    data = _few(tmp_path, 3)
    out = tmp_path / "out"
    evaluate(model=tiny_model, data=[data], out_dir=out, **CPU)
    results = out / "results.jsonl"
    lines = results.read_text(encoding="utf-8").splitlines()
    results.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2], encoding="utf-8")  # torn
    summary = evaluate(model=tiny_model, data=[data], out_dir=out, **CPU)
    assert summary["counts"]["scored_this_run"] == 1 and summary["counts"]["resumed"] == 2
    text = results.read_text(encoding="utf-8")
    assert text.endswith("\n") and all(isinstance(json.loads(line), dict) for line in text.splitlines())
    assert len(text.splitlines()) == 3


def test_drop_torn_records_keeps_a_clean_file_untouched_and_drops_glued_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n{"b": 2}\n', encoding="utf-8")
    before = path.stat().st_mtime_ns
    assert drop_torn_records(path) == 0 and path.stat().st_mtime_ns == before
    path.write_text('{"a": 1}\n{"b": \n{"c": 3}\n{"d"', encoding="utf-8")  # an older run's torn line, and a new one
    assert drop_torn_records(path) == 2
    assert path.read_text(encoding="utf-8") == '{"a": 1}\n{"c": 3}\n'


def test_the_fingerprint_holds_the_dtype_also_of_a_loaded_model(tiny_model, tiny_checkpoint, tmp_path):
    data = _few(tmp_path, 2)
    out = tmp_path / "out"
    evaluate(model=tiny_model, data=[data], out_dir=out, **CPU)  # a loaded fp32 model
    run = json.loads((out / "run.json").read_text(encoding="utf-8"))
    assert run["dtype"] == "float32" and "fp8" not in run
    resumed = evaluate(model=tiny_checkpoint.export, data=[data], out_dir=out, dtype="float32", **CPU)
    assert resumed["counts"]["scored_this_run"] == 0  # the same model, dtype and mode: resumed
    with pytest.raises(EvalInputError, match=r"another model, FP8 mode, dtype or fast-path options .*dtype float32"):
        evaluate(model=tiny_checkpoint.export, data=[data], out_dir=out, dtype="auto", **CPU)  # bfloat16


def test_the_fingerprint_holds_the_fp8_mode_of_a_loaded_model(tiny_model):
    from hf_openjev.eval.evaluate import loaded_model_settings, model_fingerprint
    from hf_openjev.fp8.swap import quantize_model_fp8

    copy = __import__("copy").deepcopy(tiny_model)
    assert loaded_model_settings(copy) == ("off", "float32")
    quantize_model_fp8(copy, "all")
    fp8, dtype = loaded_model_settings(copy)
    assert fp8 == "all"
    assert model_fingerprint(copy.manifest, fp8, dtype) != model_fingerprint(copy.manifest, "off", dtype)


class _FullDisk:
    """A file opened for writing on a full disk: created, but every write raises ENOSPC."""

    def __init__(self, path, mode):
        self._file = open(path, mode)  # noqa: SIM115 - closed by __exit__, as the real one

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device", self._file.name)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def test_a_resume_on_a_full_disk_leaves_no_repair_file(tiny_model, tmp_path, monkeypatch):
    """Issue 36: each resume on a full disk left a .results.jsonl.repair-<pid>, kept after the successful one."""
    import hf_openjev.eval.run_checks as run_checks

    data = _few(tmp_path, 3)
    out = tmp_path / "out"
    evaluate(model=tiny_model, data=[data], out_dir=out, **CPU)
    results = out / "results.jsonl"
    lines = results.read_text(encoding="utf-8").splitlines()
    results.write_text("\n".join(lines[:2]) + "\n" + lines[2][:10], encoding="utf-8")  # torn by the full disk
    (out / ".results.jsonl.repair-999999").write_bytes(b'{"a"')  # an earlier repair that was killed
    monkeypatch.setattr(run_checks, "open", _FullDisk, raising=False)
    for _attempt in range(2):
        with pytest.raises(OSError) as info:
            evaluate(model=tiny_model, data=[data], out_dir=out, **CPU)
        assert info.value.errno == errno.ENOSPC
        assert list(out.glob(".results.jsonl.repair-*")) == []
    monkeypatch.undo()
    summary = evaluate(model=tiny_model, data=[data], out_dir=out, **CPU)
    assert summary["counts"]["scored_this_run"] == 1 and summary["counts"]["resumed"] == 2
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    assert all(isinstance(json.loads(line), dict) for line in results.read_text(encoding="utf-8").splitlines())


@pytest.mark.parametrize("options, fast, message", [
    ({"fp8": "all"}, None, "--fast-options: fp8 has its own option: --fp8 MODE"),
    ({"cuda_graphs": False}, False, "--fast-options are the fast path's options but fast=False"),
    ({"nope": 1}, None, "--fast-options: unknown fast-path option"),
])
def test_fast_options_are_checked_before_anything_loads(options, fast, message, tiny_checkpoint, tmp_path,
                                                        no_loading):
    with pytest.raises(UsageError, match=message):
        evaluate(model=tiny_checkpoint.export, data=[_few(tmp_path)], out_dir=tmp_path / "out", fast=fast,
                 fast_options=options, **CPU)
    assert not (tmp_path / "out").exists()


def test_fast_options_select_the_fast_path_and_enter_the_fingerprint(tiny_checkpoint, tmp_path, monkeypatch,
                                                                     capsys):
    """``--fast-options`` on the CPU (whose default is the reference path): the run takes the fast path with those
    options, run.json names them, the same options resume and other ones are refused."""
    from hf_openjev.fast_options import FastPathOptions

    seen = []
    real = ev.prepare_path
    monkeypatch.setattr(ev, "prepare_path", lambda model, fast, options=None: seen.append((fast, options)) or real(
        model, fast, options))
    data, out = _few(tmp_path, 2), tmp_path / "out"
    argv = ["eval", "--model", str(tiny_checkpoint.export), "--data", str(data), "--out", str(out), "--device", "cpu",
            "--dtype", "float32", "--no-progress", "--fast-options", '{"min_shared_tokens": 7}']
    assert cli.main(argv) == 0
    assert seen == [(True, FastPathOptions(min_shared_tokens=7))]
    assert json.loads((out / "run.json").read_text(encoding="utf-8"))["fast_options"] == {"min_shared_tokens": 7}
    assert cli.main(argv) == 0 and len(seen) == 1  # the same options: every task resumed, no model work
    capsys.readouterr()
    assert cli.main(argv[:-1] + ['{"min_shared_tokens": 8}']) == 2
    err = capsys.readouterr().err.strip()
    assert "fast-path options" in err and 'options {"min_shared_tokens": 7}' in err and "\n" not in err
    with pytest.raises(SystemExit) as info:  # a bad value: argparse's one line
        cli.main(argv[:-1] + ['{"min_shared_tokens": 0}'])
    assert info.value.code == 2 and "min_shared_tokens must be a positive integer" in capsys.readouterr().err


def test_fast_options_sit_over_a_members_own_defaults(tiny_checkpoint, tiny_model, tmp_path, monkeypatch):
    """A shape with defaults of its own (the 2B's; here the tiny shape registered as a member): the options named
    change only themselves, for an export directory and for a loaded model alike."""
    from hf_openjev import family
    from hf_openjev.fast_options import MEMBER_DEFAULTS, FastPathOptions

    member = family.FamilyMember("Open-Jev-Tiny", "none/tiny", family.shape_of(
        family.text_model_of(tiny_model).config), 1.0, tied=False)
    monkeypatch.setattr(family, "MEMBERS", (*family.MEMBERS, member))
    monkeypatch.setitem(MEMBER_DEFAULTS, member.name, {"packed_candidates": False})
    seen = []
    monkeypatch.setattr(ev, "prepare_path", lambda model, fast, options=None: seen.append(options) or 1 / 0)
    for i, model in enumerate((tiny_checkpoint.export, tiny_model)):
        with pytest.raises(ZeroDivisionError):
            evaluate(model=model, data=[_few(tmp_path, 2)], out_dir=tmp_path / f"out{i}", fast_options={
                "min_shared_tokens": 7}, **CPU)
    assert seen == [FastPathOptions(packed_candidates=False, min_shared_tokens=7)] * 2


def test_the_fingerprint_holds_the_options_that_differ_from_the_defaults(tiny_model):
    """Options at their default values (or the FP8 mode, fingerprinted on its own) leave the digest as it was;
    another value changes it and is named in run.json."""
    from hf_openjev.eval.evaluate import model_fingerprint
    from hf_openjev.fast_options import FastPathOptions

    manifest = tiny_model.manifest
    plain = model_fingerprint(manifest, "off", "float32")
    assert model_fingerprint(manifest, "off", "float32", FastPathOptions()) == plain
    assert model_fingerprint(manifest, "off", "float32", FastPathOptions(share_tails=FastPathOptions().share_tails)) \
        == plain
    changed = model_fingerprint(manifest, "off", "float32", FastPathOptions(min_shared_tokens=7))
    assert changed["fingerprint"] != plain["fingerprint"] and changed["fast_options"] == {"min_shared_tokens": 7}
    fp8 = model_fingerprint(manifest, "all", "float32", FastPathOptions(fp8="all"))
    assert fp8 == model_fingerprint(manifest, "all", "float32") and "fast_options" not in fp8

"""Warm-up before serving: the shape file, one forward per shape, the server's ``--warm-up`` (CPU; the graph
capture itself is checked with ``-m gpu`` in test_cuda_graphs.py)."""

from __future__ import annotations

import json

import pytest
import torch
from live_server import run_lifespan_without_a_socket

from hf_openjev import load_export
from hf_openjev.cli import main as cli_main
from hf_openjev.errors import InputFileError
from hf_openjev.fast_options import FastPathOptions
from hf_openjev.serve import warmup

torch.set_num_threads(1)


def _write(tmp_path, data, name="shapes.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_the_jevbench_manifest_is_a_shape_file():
    from pathlib import Path

    shapes = warmup.load_shapes(Path(__file__).resolve().parents[1] / "data/bench/jevbench231-shapes.json")
    assert len(shapes) == 231 and shapes[0] == (36, [37, 33, 34, 36, 39])  # exact shapes (real tokenizer)
    estimated = warmup.load_shapes(Path(__file__).resolve().parents[1] / "data/bench/jevbench231-shapes-estimated.json")
    assert len(estimated) == 231 and estimated[0] == (38, [43, 37, 40, 42, 42])  # the 4-characters-a-token estimate


@pytest.mark.parametrize("data,match", [
    ("{not json", "cannot read a JSON file"),
    ({"requests": []}, "at least one request"),
    ([{"prefix_tokens": 3, "suffix_tokens": [2]}], "expected"),
    ({"requests": [{"prefix_tokens": 3}]}, "request 0 needs"),
    ({"requests": [{"prefix_tokens": 3, "suffix_tokens": [2]}, {"prefix_tokens": -1, "suffix_tokens": [2]}]},
     "request 1 needs"),
    ({"requests": [{"prefix_tokens": 3, "suffix_tokens": [2, 0]}]}, "suffix_tokens >= 1"),
])
def test_a_bad_shape_file_is_refused_with_what_is_wrong(tmp_path, data, match):
    with pytest.raises(InputFileError, match=match):
        warmup.load_shapes(_write(tmp_path, data))
    with pytest.raises(InputFileError, match="cannot read"):
        warmup.load_shapes(tmp_path / "missing.json")


def test_warm_up_runs_one_request_per_shape_with_its_token_counts(tiny_checkpoint, monkeypatch):
    from hf_openjev import fast_path

    model = load_export(tiny_checkpoint.export, dtype=torch.float32, device="cpu")
    seen = []
    real = fast_path.score_fast

    def spy(model, requests_tokens, options):
        seen.append((requests_tokens, options.to_dict(changed_only=True)))  # what differs from the defaults
        return real(model, requests_tokens, options)

    monkeypatch.setattr(fast_path, "score_fast", spy)
    too_long = model.max_length  # prefix + longest suffix > max_length: skipped, as the server would refuse it
    shapes = [(5, [3, 4]), (0, [7]), (too_long, [1]), (70, [2, 2, 9])]
    report = warmup.warm_up(model, shapes, FastPathOptions(share_tails=False), progress=False)
    assert report["requests"] == 3 and report["skipped_too_long"] == 1 and report["graphs"] is None  # CPU
    assert len(seen) == 3 and all(options == {"share_tails": False} for _, options in seen)
    for (requests_tokens, _), (prefix, suffixes) in zip(seen, [shapes[0], shapes[1], shapes[3]]):
        [[candidates]] = requests_tokens
        assert [len(c) for c in candidates] == [prefix + n for n in suffixes]
        assert all(c[:prefix] == candidates[0][:prefix] for c in candidates)  # one shared prefix per request
        assert all(0 <= t < model.config.vocab_size for c in candidates for t in c)


def test_warm_up_scores_inside_warming_up_so_no_replay_answers(tiny_checkpoint, monkeypatch):
    """The warm-up discards its scores: its forwards run inside patches.warming_up (captures, no answering
    replays), and the graph cache answers again afterwards. (A graph cache set on a CPU model; score_fast spied.)"""
    from hf_openjev import fast_path
    from hf_openjev.family import text_model_of
    from hf_openjev.patches import apply_patches
    from hf_openjev.patches.cuda_graphs import PackGraphs

    model = load_export(tiny_checkpoint.export, dtype=torch.float32, device="cpu")
    record = apply_patches(model)
    record.graphs = PackGraphs(text_model_of(model))
    answering = []
    monkeypatch.setattr(fast_path, "score_fast", lambda model, requests, options: answering.append(
        record.graphs.answering))
    warmup.warm_up(model, [(3, [2, 4]), (0, [5])], progress=False)
    assert answering == [False, False] and record.graphs.answering is True


def test_compile_threads_score_the_same_requests_in_a_compile_ahead_pass_first(tiny_checkpoint, monkeypatch):
    """warm_up(compile_threads=N): a compile-ahead pass over the same requests (the same ids), inside
    patches.compiling_ahead, then the warm-up pass; its report is kept. (A graph cache set on a CPU model, the
    compile block stood in for: a CPU has no Triton.)"""
    import contextlib

    from hf_openjev import fast_path
    from hf_openjev.family import text_model_of
    from hf_openjev.ops import parallel_compile
    from hf_openjev.patches import apply_patches
    from hf_openjev.patches.cuda_graphs import PackGraphs

    @contextlib.contextmanager
    def block(threads):
        yield {"threads": threads, "untuned": 0, "failures": []}

    monkeypatch.setattr(parallel_compile, "compiling_in_parallel", block)
    model = load_export(tiny_checkpoint.export, dtype=torch.float32, device="cpu")
    record = apply_patches(model)
    record.graphs = PackGraphs(text_model_of(model))
    scored = []
    monkeypatch.setattr(fast_path, "score_fast", lambda model, requests, options: scored.append(
        (record.graphs.probing_ahead, requests)))
    report = warmup.warm_up(model, [(3, [2, 4]), (0, [5])], progress=False, compile_threads=8)
    assert [ahead for ahead, _ in scored] == [True, True, False, False]
    assert [r for _, r in scored[:2]] == [r for _, r in scored[2:]]  # the same requests, ids and all
    assert report["compile_ahead"]["threads"] == 8 and report["compile_ahead"]["seconds"] >= 0
    assert warmup.warm_up(model, [(3, [2])], progress=False)["compile_ahead"] is None  # the default: 0, none
    scored.clear()
    with pytest.raises(ValueError, match="compile_threads"):
        warmup.warm_up(model, [(3, [2])], progress=False, compile_threads=-4)
    assert scored == []  # refused before any forward


def test_warm_up_sets_the_model_up_for_the_fast_path_with_its_options(tiny_checkpoint):
    from hf_openjev.patches import patch_record

    model = load_export(tiny_checkpoint.export, dtype=torch.float32, device="cpu")
    assert patch_record(model) is None
    report = warmup.warm_up(model, [(3, [2, 4])], FastPathOptions(max_sequences=1), progress=False)
    assert report["requests"] == 1 and patch_record(model).options == FastPathOptions(max_sequences=1)
    warmup.warm_up(model, [(3, [2])], progress=False)  # no options: the ones the model is patched with
    assert patch_record(model).options == FastPathOptions(max_sequences=1)


def test_serve_warm_up_file_is_checked_before_the_model_loads(tmp_path, monkeypatch):
    from hf_openjev import model as model_module

    monkeypatch.setattr(model_module, "load_export", lambda *a, **k: pytest.fail("loaded before the file check"))
    bad = _write(tmp_path, {"requests": [{"prefix_tokens": 1}]})
    assert cli_main(["serve", "--model", str(tmp_path), "--warm-up", str(bad)]) == 2


def test_serve_warms_up_on_the_fast_path_only(tiny_checkpoint, tmp_path, monkeypatch, caplog):
    import uvicorn

    from hf_openjev.serve import startup

    shapes = _write(tmp_path, {"requests": [{"prefix_tokens": 4, "suffix_tokens": [3, 5]}]})
    calls = []
    monkeypatch.setattr(warmup, "warm_up", lambda model, s, options=None, **_: calls.append(s) or  # serve imports
                        {"requests": len(s), "skipped_too_long": 0, "seconds": 0.0, "graphs": None})  # it when called
    monkeypatch.setattr(uvicorn.Server, "run", run_lifespan_without_a_socket)
    with caplog.at_level("INFO", logger="hf_openjev.serve.server"):
        assert startup.serve(tiny_checkpoint.export, device="cpu", fast=True, warm_up_shapes=shapes) == 0
        assert calls == [[(4, [3, 5])]] and "warm-up: 1 requests" in caplog.text
        assert startup.serve(tiny_checkpoint.export, device="cpu", fast=None, warm_up_shapes=shapes) == 0
    assert len(calls) == 1 and "warm-up skipped: the reference path" in caplog.text  # CPU default: reference


def test_serve_proves_the_tokenizer_shortcuts_while_loading_not_on_the_first_request(tiny_checkpoint, monkeypatch):
    """The clean-cut and byte-floor proofs take seconds with the real tokenizer: /health is 503 meanwhile."""
    import uvicorn

    from hf_openjev import scoring
    from hf_openjev.serve import startup

    proved = []
    monkeypatch.setattr(scoring, "prove_tokenizer_shortcuts", lambda model: proved.append(model.tokenizer))
    monkeypatch.setattr(uvicorn.Server, "run", run_lifespan_without_a_socket)
    assert startup.serve(tiny_checkpoint.export, device="cpu") == 0
    assert len(proved) == 1 and proved[0] is not None


def test_prove_tokenizer_shortcuts_caches_both_proofs_for_the_models_tokenizer(tiny_checkpoint):
    import hf_openjev
    from hf_openjev.scoring import prove_tokenizer_shortcuts
    from hf_openjev.tokenizer import tokenizer_analysis as ta

    model = hf_openjev.load_export(tiny_checkpoint.export, dtype="float32", device="cpu")  # a tokenizer of its own
    assert model.tokenizer not in ta._token_floors and model.tokenizer not in ta._clean_cut_finders
    prove_tokenizer_shortcuts(model)
    assert model.tokenizer in ta._token_floors and model.tokenizer in ta._clean_cut_finders

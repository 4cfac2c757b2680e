"""hf_openjev.tokenizer.tokenizer_analysis: the clean-cut and byte-floor analysis cached on disk by the tokenizer's
fingerprint, so that a new process (a new tokenizer object) reads it instead of walking the vocabulary again."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, normalizers

from hf_openjev.checkpoint.tiny import build_tiny_tokenizer
from hf_openjev.tokenizer import token_floor, tokenizer_analysis
from hf_openjev.tokenizer.prefix_cuts import find_clean_cut
from hf_openjev.tokenizer.tokenizer_analysis import (
    analyse_tokenizer,
    analysis_path,
    prove_clean_cuts,
    prove_token_floor,
    tokenizer_fingerprint,
)


def _fresh_copy(tok) -> Tokenizer:
    """The same tokenizer as a new object: what a new process loads (nothing in this process's memory)."""
    return Tokenizer.from_str(tok.backend_tokenizer.to_str() if hasattr(tok, "backend_tokenizer") else tok.to_str())


def _refuse_analysis(monkeypatch):
    """Walking the vocabulary or the tokenizer's rules fails the test: the answer must come from the disk."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("the tokenizer was analysed again")

    monkeypatch.setattr(tokenizer_analysis, "_compute", refuse)
    monkeypatch.setattr(token_floor, "_class_maxima", refuse)


def test_a_new_process_reads_the_analysis_from_the_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_OPENJEV_CACHE", str(tmp_path))  # the cache root, as for the Qwen tokenizer
    tok = build_tiny_tokenizer()
    first = analyse_tokenizer(tok)  # the first process computes and writes...
    files = list((tmp_path / "tokenizer-analysis").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["floor_maxima"] == list(first.floor_maxima)
    _refuse_analysis(monkeypatch)
    copy = _fresh_copy(tok)  # ...a later one reads
    assert analyse_tokenizer(copy) == first and first.unclean is None
    floor = prove_token_floor(copy)
    assert floor is not None and floor("1" * 4000) == prove_token_floor(tok)("1" * 4000)
    assert prove_clean_cuts(copy) is find_clean_cut


def test_the_fingerprint_tells_tokenizers_apart(tmp_path):
    tok = _fresh_copy(build_tiny_tokenizer())
    other = _fresh_copy(build_tiny_tokenizer())
    other.normalizer = normalizers.Lowercase()
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(other)
    assert analyse_tokenizer(tok, cache_dir=tmp_path).floor_maxima is not None
    refused = analyse_tokenizer(other, cache_dir=tmp_path)
    assert refused.floor_maxima is None and "normalizer Lowercase" in refused.unclean
    assert len(list((tmp_path / "tokenizer-analysis").glob("*.json"))) == 2


@pytest.mark.parametrize("content", [
    "{torn", '{"format": 0, "unclean": null, "floor_maxima": [1], "floor_nfc": false}',
    '{"format": 1, "unclean": null, "floor_maxima": [1, 1, 1, 1, 1], "floor_nfc": false}',  # before clean splits
    '{"format": 2, "unclean": null, "unsplit": null, "floor_maxima": [0, "x"], "floor_nfc": false}',
    '{"format": 2, "unclean": null, "floor_maxima": [1, 1, 1, 1, 1], "floor_nfc": false}',  # no unsplit
    '{"format": 2, "unclean": null, "unsplit": 0, "floor_maxima": [1, 1, 1, 1, 1], "floor_nfc": false}'])
def test_a_torn_or_stale_file_is_recomputed_and_rewritten(tmp_path, content):
    tok = _fresh_copy(build_tiny_tokenizer())
    path = analysis_path(tokenizer_fingerprint(tok), tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    analysis = analyse_tokenizer(tok, cache_dir=tmp_path)
    assert analysis.floor_maxima is not None and analysis.floor_maxima != (1, 1, 1, 1, 1)
    assert analysis.unsplit is None  # the toy tokenizer's splits are proven
    assert json.loads(path.read_text()) == analysis.to_json()


def test_an_unwritable_cache_is_skipped(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    analysis = analyse_tokenizer(_fresh_copy(build_tiny_tokenizer()), cache_dir=blocker)
    assert analysis.floor_maxima is not None and analysis.unclean is None


def test_a_tokenizer_that_cannot_be_serialized_is_analysed_without_the_disk(tmp_path):
    analysis = analyse_tokenizer(object(), cache_dir=tmp_path)
    assert analysis.floor_maxima is None and analysis.unclean.startswith("not a fast tokenizer")
    assert not (tmp_path / "tokenizer-analysis").exists()


def test_a_loaded_export_tokenizer_is_fingerprinted_by_its_file_and_what_was_added_since(tmp_path, monkeypatch):
    from hf_openjev.checkpoint.files import load_tokenizer

    build_tiny_tokenizer().save_pretrained(str(tmp_path / "export"))
    first, second = load_tokenizer(tmp_path / "export"), load_tokenizer(tmp_path / "export")
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(second)
    assert analyse_tokenizer(first, cache_dir=tmp_path / "cache").unclean is None
    _refuse_analysis(monkeypatch)
    assert analyse_tokenizer(second, cache_dir=tmp_path / "cache").unclean is None  # read from the disk
    monkeypatch.undo()
    third = load_tokenizer(tmp_path / "export")
    third.add_tokens(["two words"])  # changes the cuts' verdict: another fingerprint, analysed afresh
    assert tokenizer_fingerprint(third) != tokenizer_fingerprint(first)
    assert "contains a space" in analyse_tokenizer(third, cache_dir=tmp_path / "cache").unclean


DIRECT_TEXTS = ["", " ", "hello world", "  leading and trailing  ", "<|im_start|>user\nhi<|im_end|>\n", "日本語 🙂 cafe\u0301",
                "'s 'll n't 12345 3.14", "\r\n\r\n\t tabs", "Question: which? " * 40, "<think>\n\n</think>\n\n"]


@pytest.mark.parametrize("which", ["qwen3.5", "toy"])
def test_the_backend_called_directly_gives_the_tokenizers_ids(request, which):
    """JevModel.encode / encode_many read the Rust backend directly (direct_backend): the ids of
    ``tokenizer(text, add_special_tokens=False)`` on texts with added tokens, whitespace runs, CJK, marks, digits."""
    from hf_openjev.tokenizer.tokenizer_analysis import direct_backend

    model = request.getfixturevalue("qwen_tiny_model" if which == "qwen3.5" else "tiny_model")
    tokenizer = model.tokenizer
    assert direct_backend(tokenizer) is tokenizer.backend_tokenizer
    expected = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in DIRECT_TEXTS]
    assert [model.encode(text) for text in DIRECT_TEXTS] == expected
    assert model.encode_many(DIRECT_TEXTS) == expected


def test_the_tokenizers_own_call_where_the_backend_alone_would_differ(qwen_tiny_model, monkeypatch):
    """Truncation or padding left set on the backend, split special tokens, a class with its own call: the
    tokenizer's call, and so its ids."""
    from hf_openjev.tokenizer.tokenizer_analysis import direct_backend

    model = qwen_tiny_model
    tokenizer, backend = model.tokenizer, model.tokenizer.backend_tokenizer
    text = "<|im_start|>user\n" + "a longer text than five tokens " * 3
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    try:
        backend.enable_truncation(5)  # a user's own call with truncation=True, max_length=5 leaves this set
        assert direct_backend(tokenizer) is None and model.encode(text) == whole
        backend.no_truncation()
        backend.enable_padding(length=200)
        assert direct_backend(tokenizer) is None and model.encode(text) == whole
    finally:
        backend.no_truncation()
        backend.no_padding()
    monkeypatch.setattr(tokenizer, "split_special_tokens", True)
    assert direct_backend(tokenizer) is None
    assert model.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"] != whole  # split, as asked
    monkeypatch.setattr(tokenizer, "split_special_tokens", False)
    backend.encode_special_tokens = False

    class OwnCall(type(tokenizer)):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "__class__", OwnCall)
    assert direct_backend(tokenizer) is None and model.encode(text) == whole

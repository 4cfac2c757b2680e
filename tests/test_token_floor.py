"""The byte-level token floor (hf_openjev.tokenizer.token_floor): a true lower bound on random texts, refused where its
conditions fail, and the early verdicts it gives tokenize_candidates for texts without clean cuts (digits, CJK);
the per-request token budget (max_total_tokens) stops tokenizing at the limit."""

from __future__ import annotations

import random
import re
import time

import pytest
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from hf_openjev.checkpoint.tiny import build_tiny_tokenizer
from hf_openjev.contract import MSG_TOO_MANY_TOKENS, parse_request, tokenize_candidates
from hf_openjev.errors import RequestError
from hf_openjev.tokenizer.token_floor import BYTE_CLASSES, count_byte_classes
from hf_openjev.tokenizer.tokenizer_analysis import prove_token_floor

ALPHABET = ["a", "Zz", " ", "  ", "1", "2024", "日本", "é", "e\u0301", "\n", "\t", "!!", "<|im_start|>", "🙂",
            "x" * 30]


def _encode(tok):
    encode = getattr(tok, "encode")
    return lambda text: list(encode(text, add_special_tokens=False)) if hasattr(tok, "backend_tokenizer") \
        else encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("make", [build_tiny_tokenizer, lambda: _trained(normalizers.NFC())])
def test_floor_never_exceeds_the_real_count(make):
    tok = make()
    floor, encode = prove_token_floor(tok), _encode(tok)
    assert floor is not None
    rng = random.Random(1)
    for _ in range(300):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 200)))
        assert floor(text) <= len(encode(text)), text


def _trained(normalizer=None, alphabet=True):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if alphabet else [])
    tok.train_from_iterator(["1234567890 hello 日本語 " * 20], trainer=trainer)
    return tok


def test_floor_is_refused_where_it_cannot_be_proven():
    assert prove_token_floor(_trained(normalizers.Lowercase())) is None  # a normalizer that may change bytes
    assert prove_token_floor(_trained(alphabet=False)) is None  # bytes missing from the vocabulary
    assert prove_token_floor(object()) is None
    assert count_byte_classes(b"12ab \x01\xc3\xa9") == (2, 2, 1, 1, 2)


def _noul(state: str):
    return parse_request({"state": state, "questions": {"q": {"type": "noul", "instructions": "?"}}})


@pytest.mark.parametrize("state", ["7" * (4 * 1024 * 1024), "日本語" * (1024 * 1024 // 2)])
def test_over_long_text_without_spaces_is_refused_without_tokenizing_it(state):
    """No clean cut anywhere: before, the whole 4 MiB text went to the tokenizer (seconds); now its bytes bound it."""
    tok = build_tiny_tokenizer()
    seen = []

    def encode(text):
        seen.append(len(text))
        return tok.encode(text, add_special_tokens=False)

    start = time.perf_counter()
    with pytest.raises(RequestError) as info:
        tokenize_candidates(_noul(state), encode, chat_prefix="<|im_start|>user\n", chat_suffix="<|im_end|>\n",
                            max_length=4096, token_floor=prove_token_floor(tok))
    assert time.perf_counter() - start < 0.5
    assert seen == []
    assert int(re.match(r"question q: (\d+) tokens exceeds max_length=4096", info.value.message).group(1)) > 4096


def test_over_long_digits_are_refused_fast_through_the_model(tiny_model):
    from hf_openjev.scoring import prepare_request

    request = {"state": "1" * (4 * 1024 * 1024), "questions": {"q": {"type": "noul", "instructions": "?"}}}
    start = time.perf_counter()
    with pytest.raises(RequestError, match=r"^question q: \d+ tokens exceeds max_length=4096"):
        prepare_request(tiny_model, request)
    assert time.perf_counter() - start < 1.0  # the whole text takes seconds to tokenize on a CPU


def test_request_token_budget_stops_tokenizing_at_the_limit():
    tok = build_tiny_tokenizer()
    calls = []

    def encode(text):
        calls.append(text)
        return tok.encode(text, add_special_tokens=False)

    criteria = {f"option {i}": "a description " * 20 for i in range(200)}
    parsed = parse_request({"state": "state " * 200, "questions": {"c": {"type": "choice", "instructions": "?",
                                                                          "criteria": criteria}}})
    with pytest.raises(RequestError) as info:
        tokenize_candidates(parsed, encode, chat_prefix="", chat_suffix="", max_length=4096, max_total_tokens=5000)
    error = info.value
    assert error.status == 413 and error.message.startswith(MSG_TOO_MANY_TOKENS)
    count = int(re.search(r"at least (\d+) input tokens > max_request_tokens=5000$", error.message).group(1))
    assert count > 5000 and len(calls) < 20  # stopped a few candidates past the budget, not at 200
    assert "'c'" in error.detail
    within = tokenize_candidates(parsed, encode, chat_prefix="", chat_suffix="", max_length=4096,
                                 max_total_tokens=10**7)
    assert len(within[0]) == 200


@pytest.mark.parametrize("size", [(1 << 16) - 1, 1 << 16, (1 << 16) + 7,
                                  pytest.param(3 * 1024 * 1024 + 5, marks=pytest.mark.slow)])
def test_the_gil_free_byte_count_of_long_data_equals_the_translate_count(size):
    """From 64 KiB on the classes are counted by torch.bincount (the GIL released); below, by translate/count."""
    from hf_openjev.tokenizer.token_floor import _CLASS_OF

    data = bytes(torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(size), dtype=torch.uint8))
    expected = tuple(data.translate(_CLASS_OF).count(i) for i in range(len(BYTE_CLASSES)))
    assert count_byte_classes(data) == expected and sum(expected) == size


def test_long_data_is_counted_by_torch_and_short_data_is_not(monkeypatch):
    """The GIL-free path is the one taken from 64 KiB on (torch.bincount releases the GIL; translate does not)."""
    calls = []
    original = torch.bincount
    monkeypatch.setattr(torch, "bincount", lambda *a, **k: calls.append(a[0].numel()) or original(*a, **k))
    count_byte_classes(b"7" * ((1 << 16) - 1))
    assert calls == []
    count_byte_classes(b"7" * (1 << 16))
    assert calls == [1 << 16]

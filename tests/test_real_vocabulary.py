"""The tiny checkpoint on the real Qwen3.5 vocabulary (``build_tiny_checkpoint(..., tokenizer="qwen3.5")``): the
contract's rendering and special tokens, the clean-cut prefix proofs and the server's tokenization run on the real
tokenizer and give the official tokenizer's golden ids (tests/data/qwen35_golden_ids.json)."""

from __future__ import annotations

import json
import random

import pytest
from conftest import QWEN_CHAT_PREFIX, QWEN_CHAT_SUFFIX, golden_ids
from starlette.testclient import TestClient

from hf_openjev.contract import parse_request
from hf_openjev.errors import RequestError
from hf_openjev.scoring import answer_requests, tokenize_request
from hf_openjev.tokenizer.prefix_cuts import find_clean_cut
from hf_openjev.tokenizer.qwen_tokenizer import QWEN35_EMBEDDING_ROWS
from hf_openjev.tokenizer.tokenizer_analysis import prove_clean_cuts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _request(case: dict) -> dict:
    return {k: v for k, v in case["request"].items() if k != "model"}  # the tiny model serves its own name


def test_the_checkpoint_has_the_real_vocabulary_at_the_tiny_width(qwen_tiny_model, qwen_tiny_checkpoint):
    config = qwen_tiny_model.config
    assert config.vocab_size == QWEN35_EMBEDDING_ROWS == 248_320 and config.hidden_size == 64
    assert tuple(qwen_tiny_model.backbone.embed_tokens.weight.shape) == (248_320, 64)
    assert len(qwen_tiny_model.tokenizer) == 248_077
    base = json.loads((qwen_tiny_checkpoint.base / "tokenizer_config.json").read_text())
    assert base["tokenizer_class"] in ("PreTrainedTokenizerFast", "TokenizersBackend")  # tokenizer.json as it is
    assert (qwen_tiny_checkpoint.export / "tokenizer.json").read_bytes() == (
        qwen_tiny_checkpoint.base / "tokenizer.json").read_bytes()


def test_rendering_and_special_tokens_on_the_real_tokenizer(qwen_tiny_model):
    assert (qwen_tiny_model.chat_prefix, qwen_tiny_model.chat_suffix) == (QWEN_CHAT_PREFIX, QWEN_CHAT_SUFFIX)
    assert qwen_tiny_model.encode(QWEN_CHAT_PREFIX) == [248_045, 846, 198]
    assert qwen_tiny_model.encode(QWEN_CHAT_SUFFIX) == [248_046, 198, 248_045, 74_455, 198, 248_068, 271, 248_069, 271]


def test_the_models_tokenization_gives_the_golden_ids(qwen_tiny_model):
    for case in golden_ids():
        prepared = tokenize_request(qwen_tiny_model, parse_request(_request(case)))
        assert prepared.tokens == case["ids"]


def test_clean_cuts_are_proven_and_hold_on_the_real_tokenizer(qwen_tiny_model):
    assert prove_clean_cuts(qwen_tiny_model.tokenizer) is find_clean_cut
    rng = random.Random(0)
    words = ["naïve", "café", "नमस्ते", "दुनिया", "人力资源部", "Привет,", "مرحبا", "x=1;", "'s", "don't", "🙂", "(a)",
             "1e+16", "\"β\":", "\n\n", "\t", "--", "ــ", "e\u0301", "...", "<think>", "<|im_end|>"]
    for _ in range(40):
        text = QWEN_CHAT_PREFIX + " ".join(rng.choice(words) for _ in range(30)) + QWEN_CHAT_SUFFIX
        full = qwen_tiny_model.encode(text)
        cut = find_clean_cut(text, 1)
        while cut is not None:
            assert full[:len(qwen_tiny_model.encode(text[:cut]))] == qwen_tiny_model.encode(text[:cut]), (text, cut)
            cut = find_clean_cut(text, cut + 1)


def test_an_over_long_candidate_is_rejected_through_a_clean_prefix(qwen_tiny_model):
    state = "Über naïve café नमस्ते दुनिया 人力资源部 " * (qwen_tiny_model.max_length // 2)
    parsed = parse_request({"state": state, "questions": {"q": {"type": "noul", "instructions": "Late?"}}})
    full = len(qwen_tiny_model.encode(QWEN_CHAT_PREFIX + parsed.questions[0].prompts[0] + QWEN_CHAT_SUFFIX))
    assert full > qwen_tiny_model.max_length
    with pytest.raises(RequestError) as info:
        tokenize_request(qwen_tiny_model, parsed)
    count = int(str(info.value).split(": ")[1].split(" tokens")[0])
    assert qwen_tiny_model.max_length < count < full  # a clean prefix's count settled it


def test_the_server_tokenizes_with_the_real_tokenizer(qwen_tiny_model):
    from hf_openjev.serve.app import create_app

    cases = golden_ids()
    with TestClient(create_app(qwen_tiny_model)) as client:
        for case in cases:
            response = client.post("/v1/systemone", json=_request(case))
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["usage"]["input_tokens"] == sum(len(seq) for q in case["ids"] for seq in q)
            assert list(body["answers"]) == list(case["request"]["questions"])
            want = answer_requests(qwen_tiny_model, [_request(case)], fast=False)[0]
            assert body["usage"] == want["usage"]

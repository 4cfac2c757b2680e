"""hf_openjev.scoring: prepare (validate + tokenize) -> score -> answer, shared by pipeline, eval and server."""

from __future__ import annotations

import pytest
import torch
from conftest import QWEN_CHAT_PREFIX, QWEN_CHAT_SUFFIX, spec_prompts, spec_softmax

from hf_openjev import InferenceError, JevModel, RequestError
from hf_openjev.checkpoint.tiny import TINY_MODEL_ID, TINY_TEMPERATURE
from hf_openjev.reference import score_reference
from hf_openjev.scoring import (
    PreparedRequest,
    answer_requests,
    build_answer,
    prepare_request,
    score_prepared,
    use_fast_path,
)

A = {"state": "The parcel is late.", "questions": {
    "c": {"type": "choice", "instructions": "Which?", "criteria": {"x": None, "y": "why not"}},
    "n": {"type": "noul", "instructions": "Late?"}}}
B = {"model": "jev-latest", "state": ["a", {"b": 1}], "questions": {
    "s": {"type": "score", "instructions": {"rate": "it"}, "criteria": ["lo", "mid", "hi"]}}}


def _tokens(model, request):
    return [[model.encode(QWEN_CHAT_PREFIX + p + QWEN_CHAT_SUFFIX) for p in prompts]
            for prompts in spec_prompts(request).values()]


def test_prepare_request_tokenizes_every_candidate(tiny_model):
    prepared = prepare_request(tiny_model, A)
    assert isinstance(prepared, PreparedRequest)
    assert prepared.tokens == _tokens(tiny_model, A)
    assert [len(q) for q in prepared.tokens] == [2, 1]
    assert prepared.sequences == [seq for q in prepared.tokens for seq in q]
    assert prepared.input_tokens == sum(len(s) for s in prepared.sequences)
    assert prepared.parsed.model is None
    assert [q.id for q in prepared.parsed.questions] == ["c", "n"]
    # the chat halves wrap every candidate, and no BOS is added
    first = prepared.tokens[0][0]
    assert first[: len(tiny_model.encode(QWEN_CHAT_PREFIX))] == tiny_model.encode(QWEN_CHAT_PREFIX)
    assert first[-len(tiny_model.encode(QWEN_CHAT_SUFFIX)):] == tiny_model.encode(QWEN_CHAT_SUFFIX)
    assert tiny_model.tokenizer.decode(first) == QWEN_CHAT_PREFIX + spec_prompts(A)["c"][0] + QWEN_CHAT_SUFFIX


def test_prepare_request_rejects_without_model_work(tiny_model):
    handle = tiny_model.backbone.register_forward_pre_hook(lambda *_: pytest.fail("forward ran"))
    try:
        with pytest.raises(RequestError, match=r"^requested model is not loaded \(model 'other' is not served here"):
            prepare_request(tiny_model, {"model": "other", **A})
        with pytest.raises(RequestError, match=r"^request requires state \(the request has no state field\)$"):
            prepare_request(tiny_model, {"questions": A["questions"]})
    finally:
        handle.remove()


def test_use_fast_path_defaults_to_reference_on_cpu(tiny_model):
    assert use_fast_path(tiny_model, None) is False
    assert use_fast_path(tiny_model, False) is False
    assert use_fast_path(tiny_model, True) is True


def test_score_prepared_keeps_requests_questions_and_candidates_apart(tiny_model):
    prepared = [prepare_request(tiny_model, A), prepare_request(tiny_model, B)]
    result = score_prepared(tiny_model, prepared, fast=False, batch_size=2)
    assert [[len(q) for q in r] for r in result.scores] == [[2, 1], [3]]
    flat = score_reference(tiny_model, prepared[0].sequences + prepared[1].sequences, batch_size=1)
    got = [s for r in result.scores for q in r for s in q]
    assert max(abs(x - y) for x, y in zip(got, flat)) < 1e-5
    assert len({round(s, 5) for s in got}) == 6
    assert result.prefix_cache == [{"enabled": False, "mode": "none", "shared_tokens": 0}] * 2
    assert result.seconds > 0


def test_score_prepared_wraps_failures(tiny_model, monkeypatch):
    prepared = [prepare_request(tiny_model, A)]

    def boom(*_a, **_k):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr("hf_openjev.reference.score_reference", boom)
    with pytest.raises(InferenceError) as info:
        score_prepared(tiny_model, prepared, fast=False)
    assert str(info.value) == "model inference failed: kernel exploded" and info.value.status == 500

    monkeypatch.setattr("hf_openjev.reference.score_reference", lambda *_a, **_k: [0.0, float("inf"), 1.0])
    with pytest.raises(InferenceError, match="^the model produced a non-finite score$"):
        score_prepared(tiny_model, prepared, fast=False)


def test_build_answer_from_known_scores(tiny_model):
    prepared = prepare_request(tiny_model, A)
    response = build_answer(tiny_model, prepared, [[-1.0, 0.0], [1.0]], seconds=0.25,
                            prefix_cache={"enabled": False, "mode": "none", "shared_tokens": 0}, method="reference",
                            extra_metadata={"queue_seconds": 0.5})
    p = spec_softmax([-1.0, 0.0], TINY_TEMPERATURE)
    assert response == {
        "model": TINY_MODEL_ID,
        "answers": {
            "c": {"type": "choice", "choice": "y", "probabilities": {"x": p[0], "y": p[1]},
                  "confidence": (p[1] - 0.5) / 0.5},
            "n": {"type": "noul", "noul": 0.5973836777434065},  # docs/contract.md §5 worked example
        },
        "usage": {"input_tokens": prepared.input_tokens, "output_tokens": 0},
        "metadata": {"method": "reference", "temperature": TINY_TEMPERATURE, "candidate_sequences": 3,
                     "inference_seconds": 0.25, "max_length": 4096, "base_revision": "",
                     "prefix_cache": {"enabled": False, "mode": "none", "shared_tokens": 0}, "queue_seconds": 0.5},
    }


def test_answer_requests_validates_all_before_scoring(tiny_model, monkeypatch):
    calls = []
    monkeypatch.setattr("hf_openjev.reference.score_reference", lambda *a, **k: calls.append(1) or [])
    with pytest.raises(RequestError, match=r"^questions must be an object \(request \[2\]: questions is") as info:
        answer_requests(tiny_model, [A, B, {"state": "s"}], fast=False)
    assert info.value.message == "questions must be an object"
    assert calls == []


def test_answer_requests_end_to_end(tiny_model):
    responses = answer_requests(tiny_model, [A, B], fast=False)
    assert [list(r["answers"]) for r in responses] == [["c", "n"], ["s"]]
    assert [r["usage"]["input_tokens"] for r in responses] == [
        sum(len(s) for q in _tokens(tiny_model, A) for s in q), sum(len(s) for q in _tokens(tiny_model, B) for s in q)]
    assert [r["metadata"]["candidate_sequences"] for r in responses] == [3, 3]
    assert all(r["metadata"]["method"] == "reference" for r in responses)


def test_max_length_comes_from_the_model(tiny_model):
    import dataclasses

    short = JevModel(tiny_model.backbone, tiny_model.head, tiny_model.tokenizer,
                     dataclasses.replace(tiny_model.manifest, max_length=40), method="merged")
    n = len(tiny_model.encode(QWEN_CHAT_PREFIX + spec_prompts(A)["c"][0] + QWEN_CHAT_SUFFIX))
    assert n > 40
    with pytest.raises(RequestError) as info:
        prepare_request(short, A)
    assert str(info.value) == f"question c: {n} tokens exceeds max_length=40; no silent truncation"
    assert torch.equal(short.head.weight, tiny_model.head.weight)

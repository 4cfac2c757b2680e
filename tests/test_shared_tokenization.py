"""A request's shared text tokenized once (hf_openjev.tokenizer.candidate_tokens,
contract.tokenize_candidates(split_shared=True), scoring.tokenize_request): every candidate's ids are its whole
text's, with the real Qwen3.5 tokenizer and the toy one, on random and adversarial states, questions and options; the
state is encoded once per request; a tokenizer whose splits are not proven is tokenized whole; the max_length
verdicts, messages and budgets are the whole texts'."""

from __future__ import annotations

import copy
import dataclasses
import random
import re

import pytest

from hf_openjev.contract import parse_request, tokenize_candidates
from hf_openjev.errors import RequestError
from hf_openjev.model import JevModel
from hf_openjev.scoring import _splits_for, prepare_request, tokenize_request
from hf_openjev.tokenizer.candidate_tokens import EXACT_COUNT_CHARS
from hf_openjev.tokenizer.prefix_cuts import find_clean_cut

# what states, questions and options are made of: words, trailing and leading whitespace of every kind, "\r\n" runs,
# digits, CJK, emoji, combining marks (NFC composes e + U+0301), Hangul jamo, contractions, added tokens in the text
PIECES = ["refund", "order", "Über", "cafe\u0301", "\u0301", "\u1100\u1161\u11a8", "日本語", "🙂", "👍🏽", "'s",
          "'S", "'re", "n't", "'", "12345", "7", "3.14", "...", "!!", "(", ")", "#", "--", ":", " ", "  ", "   ",
          "\n", "\n\n", " \n", "\t", "\r\n", "\r\n\r\n", "\u00a0", "\u3000", "<|im_start|>", "<|im_end|>", "<think>",
          "Question:", "Question: ", "\n\nQuestion:", "x" * 30, '"', ",", "{", "}"]
EDGES = ["", " ", "  ", "\n", "\r\n", "'s", "'s more", "'ll", "\u0301", "\u0301e", "123", "🙂", "日本", " leading",
         "\nnewline first", "trailing   ", "ends in newline\n", "\r\n\r\n", "Question:", ":", "<|im_end|>"]


def _text(rng: random.Random, most: int = 40) -> str:
    if rng.random() < 0.3:
        return rng.choice(EDGES)
    text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, most)))
    return rng.choice(EDGES) + text + rng.choice(EDGES) if rng.random() < 0.5 else text


def random_request(rng: random.Random) -> dict:
    """Up to four questions of every kind, with adversarial texts everywhere (JSON states and options too)."""
    state = _text(rng, 80) if rng.random() < 0.8 else {"ticket": _text(rng), "n": [1, 2.5, _text(rng)]}
    questions = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(["choice", "score", "noul"])
        question = {"type": kind, "instructions": _text(rng)}
        if kind == "choice":
            question["criteria"] = {_text(rng, 5) + f"#{j}": rng.choice([None, _text(rng), {"k": _text(rng)}])
                                    for j in range(rng.randint(1, 5))}
        elif kind == "score":
            question["criteria"] = [_text(rng) for _ in range(rng.randint(2, 5))]
        elif rng.random() < 0.5:
            question["criteria"] = {"true": _text(rng), "false": _text(rng)}
        questions[f"q{i}"] = question
    return {"state": state, "questions": questions}


def whole_ids(model, parsed) -> list[list[list[int]]]:
    return [[model.encode(model.chat_prefix + p + model.chat_suffix) for p in q.prompts] for q in parsed.questions]


def _split_kwargs(model, max_length: int = 10**9) -> dict:
    return dict(chat_prefix=model.chat_prefix, chat_suffix=model.chat_suffix, max_length=max_length,
                clean_cut=find_clean_cut, split_shared=True)


@pytest.fixture(params=["qwen3.5", "toy"])
def model(request):
    return request.getfixturevalue("qwen_tiny_model" if request.param == "qwen3.5" else "tiny_model")


def test_every_candidates_ids_are_its_whole_texts(model):
    assert _splits_for(model)  # both tokenizers are proven: prepare_request splits
    rng = random.Random(len(model.tokenizer))
    requests = [random_request(rng) for _ in range(150)]
    requests += [{"state": state, "questions": {"q": {"type": "choice", "instructions": question,
                                                      "criteria": {" a": None, "\nb": "\r\n  x", "c": " "}}}}
                 for state in ("", " ", "ends in spaces   ", "\r\n\r\n", "a\u0301", "🙂", "123")
                 for question in ("", "'s the one", " leading", "\nfirst", "\u0301", "42")]
    for request in requests:
        parsed = parse_request(request)
        expected = whole_ids(model, parsed)
        assert tokenize_candidates(parsed, model.encode, **_split_kwargs(model)) == expected, request
        assert prepare_request(model, request).tokens == expected, request


@pytest.fixture
def encode_calls(monkeypatch):
    """Every text JevModel.encode is called with (the wrapper keeps the model's own-tokenizer check true)."""
    calls: list[str] = []
    original = JevModel.encode

    def counting(self, text):
        calls.append(text)
        return original(self, text)

    monkeypatch.setattr(JevModel, "encode", counting)
    return calls


@pytest.fixture
def batch_calls(monkeypatch):
    """The texts of every JevModel.encode_many call, one list per call."""
    calls: list[list[str]] = []
    original = JevModel.encode_many

    def counting(self, texts):
        calls.append(list(texts))
        return original(self, texts)

    monkeypatch.setattr(JevModel, "encode_many", counting)
    return calls


def _marked_request(marker: str) -> dict:
    return {"state": {"ticket": f"where is my order {marker}? " * 20}, "questions": {
        "intent": {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b": "x", "c": None}},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high", "top"]},
        "angry": {"type": "noul", "instructions": "Angry?"}}}


def test_the_state_is_encoded_once_per_request(model, encode_calls, batch_calls):
    """A short request: the shared text and every candidate's rest in one batch call."""
    request = _marked_request("MARKER-7f3a")
    prepared = prepare_request(model, request)
    assert prepared.parsed.candidate_count == 8
    texts = encode_calls + [text for call in batch_calls for text in call]
    assert sum("MARKER-7f3a" in text for text in texts) == 1  # whole texts: once per candidate
    assert encode_calls == [] and len(batch_calls) == 1 and len(batch_calls[0]) == 8 + 1  # the rests, the shared
    assert prepared.tokens == whole_ids(model, prepared.parsed)


def test_a_request_over_the_batch_bytes_is_encoded_candidate_by_candidate(model, encode_calls, batch_calls,
                                                                            monkeypatch):
    """Past BATCH_BYTES the shared text, then each candidate's rest, one call each (the early refusals' order)."""
    from hf_openjev.tokenizer import candidate_tokens

    monkeypatch.setattr(candidate_tokens, "BATCH_BYTES", 100)
    prepared = prepare_request(model, _marked_request("MARKER-7f3a"))
    assert sum("MARKER-7f3a" in text for text in encode_calls) == 1 and batch_calls == []
    assert len(encode_calls) == 8 + 1
    assert prepared.tokens == whole_ids(model, prepared.parsed)


def test_a_request_of_one_candidate_is_tokenized_whole(model, encode_calls):
    """Nothing to share: one call, the whole text (splitting would only add a call)."""
    prepared = prepare_request(model, {"state": "s", "questions": {"q": {"type": "noul", "instructions": "?"}}})
    assert encode_calls == [model.chat_prefix + prepared.parsed.questions[0].prompts[0] + model.chat_suffix]


def _with_tokenizer(model, tokenizer) -> JevModel:
    return JevModel(model.backbone, model.head, tokenizer, dataclasses.replace(model.manifest), method="merged")


def test_a_tokenizer_whose_splits_are_not_proven_is_tokenized_whole(tiny_model, encode_calls):
    """An added token that strips the whitespace on its right: every candidate's whole text, one call each."""
    from tokenizers import AddedToken

    tokenizer = copy.deepcopy(tiny_model.tokenizer)
    tokenizer.add_tokens([AddedToken("zzq", rstrip=True)])
    other = _with_tokenizer(tiny_model, tokenizer)
    assert not _splits_for(other)
    prepared = prepare_request(other, _marked_request("MARKER-11"))
    texts = [other.chat_prefix + p + other.chat_suffix for q in prepared.parsed.questions for p in q.prompts]
    assert encode_calls == texts and len(texts) == 8


def test_a_stand_in_encode_is_tokenized_whole(tiny_model):
    """A stand-in's encode is not the tokenizer the splits were proven for."""
    other = _with_tokenizer(tiny_model, tiny_model.tokenizer)
    calls = []
    other.encode = lambda text: calls.append(text) or tiny_model.encode(text)
    prepared = prepare_request(other, _marked_request("M"))
    assert calls == [other.chat_prefix + p + other.chat_suffix for q in prepared.parsed.questions for p in q.prompts]


def _outcome(call):
    try:
        return call()
    except RequestError as exc:
        return (exc.status, exc.message)


def _same_verdict(split, whole, parsed, ids, limit: int, model) -> bool:
    """The split path's outcome is the whole path's: the same ids or the same error, except that a text of more
    than EXACT_COUNT_CHARS characters per max_length token may be refused from another lower bound: the same
    question, a count over the limit and at most the candidate's exact count."""
    refused = isinstance(split, tuple) and isinstance(whole, tuple)
    if split == whole or not refused or split[0] != 422 or whole[0] != 422:  # ids, 413s: exactly the same
        return split == whole
    pattern = r"question (.*): (\d+) tokens exceeds max_length=(\d+); no silent truncation$"
    (qid, n, _), (wqid, _, _) = re.match(pattern, split[1]).groups(), re.match(pattern, whole[1]).groups()
    k = next(i for i, q in enumerate(parsed.questions) if q.id == qid)
    j = next(j for j, seq in enumerate(ids[k]) if len(seq) > limit)  # the first candidate over the limit
    text = model.chat_prefix + parsed.questions[k].prompts[j] + model.chat_suffix
    return qid == wqid and len(text) > EXACT_COUNT_CHARS * limit and limit < int(n) <= len(ids[k][j])


def test_verdicts_messages_and_budgets_are_the_whole_texts(model):
    """At limits around the shared text's count and the candidates' counts, and request budgets around their
    sums, the split path gives the whole path's ids or its error (:func:`_same_verdict`)."""
    rng = random.Random(3)
    checked = exact = 0
    for _ in range(25):
        request = random_request(rng)
        parsed = parse_request(request)
        ids = whole_ids(model, parsed)
        shared = len(model.encode(model.chat_prefix + parsed.shared_text))
        counts = sorted({len(seq) for q in ids for seq in q} | {shared})
        total = sum(len(seq) for q in ids for seq in q)
        for limit in {shared - 1, shared, counts[-1] - 1, counts[-1], rng.choice(counts)}:
            for budget, shares in ((None, False), (total - 1, False), (total // 2, True), (total, True)):
                kwargs = dict(_split_kwargs(model, limit), max_total_tokens=budget, shares_prefixes=shares)
                split = _outcome(lambda: tokenize_candidates(parsed, model.encode, **kwargs))
                batched = _outcome(lambda: tokenize_candidates(parsed, model.encode, **kwargs,
                                                               encode_many=model.encode_many))
                assert batched == split, (limit, budget, batched, split)  # one batch call: the same outcome
                kwargs["split_shared"] = False
                whole = _outcome(lambda: tokenize_candidates(parsed, model.encode, **kwargs))
                assert _same_verdict(split, whole, parsed, ids, limit, model), (limit, budget, split, whole)
                checked += isinstance(split, tuple)
                exact += split == whole and isinstance(split, tuple)
    assert checked > 100 and exact > 50  # refusals were compared, most of them exactly


def test_an_over_long_shared_text_is_refused_from_a_prefix_without_tokenizing_the_state(tiny_model, encode_calls):
    """The shared text alone past max_length: the first question's refusal, from a clean prefix's count (a lower
    bound over the limit), the ~1 MB state never tokenized whole, and no candidate's rest tokenized."""
    request = {"state": "word " * 200_000, "questions": {"first": {"type": "noul", "instructions": "?"},
                                                        "second": {"type": "noul", "instructions": "?"}}}
    parsed = parse_request(request)
    with pytest.raises(RequestError) as info:
        tokenize_request(tiny_model, parsed)
    n = int(re.match(r"question first: (\d+) tokens exceeds max_length=4096; no silent truncation$",
                     info.value.message).group(1))
    assert 4096 < n < 200_000
    assert encode_calls and max(map(len, encode_calls)) < 200_000  # prefixes only
    assert all(text.startswith(tiny_model.chat_prefix + "Context:\n") for text in encode_calls)


def test_an_over_long_option_is_refused_from_the_shared_count_plus_a_prefix_of_its_rest(tiny_model, encode_calls):
    """A short state and an option of a megabyte: the refusal counts the shared ids plus a clean prefix of the
    candidate's rest (a lower bound over the limit, at most the whole text's count); the option is never
    tokenized whole."""
    option = "word " * 200_000
    request = {"state": "short", "questions": {"c": {"type": "choice", "instructions": "?",
                                                     "criteria": {"a": None, "b": option}}}}
    parsed = parse_request(request)
    with pytest.raises(RequestError) as info:
        tokenize_request(tiny_model, parsed)
    n = int(re.match(r"question c: (\d+) tokens exceeds max_length=4096;", info.value.message).group(1))
    assert 4096 < n < len(option) // 5 + 100  # "word " is at least one token; a prefix's count
    assert max(map(len, encode_calls)) < len(option) // 2
    assert len(parsed.questions[0].prompts[1]) > EXACT_COUNT_CHARS * 4096


def test_a_shared_text_over_max_length_counts_the_first_candidate_exactly_when_it_is_short(tiny_model):
    """Texts of at most EXACT_COUNT_CHARS characters per max_length token keep their exact count in the message."""
    parsed = parse_request({"state": "a few words of state " * 20,
                            "questions": {"q": {"type": "score", "instructions": "How?", "criteria": ["x", "y"]}}})
    first = len(whole_ids(tiny_model, parsed)[0][0])
    with pytest.raises(RequestError, match=f"^question q: {first} tokens exceeds max_length=50; no silent "):
        tokenize_candidates(parsed, tiny_model.encode, **_split_kwargs(tiny_model, 50))


def _long_state(rng: random.Random, chars: int) -> str:
    """An adversarial state of about ``chars`` characters (every piece kind, clean cuts here and there)."""
    parts, size = [], 0
    while size < chars:
        parts.append(_text(rng, 60) + rng.choice([" word", ": value", " 42", "\n\n", "日本語 ", "🙂"]))
        size += len(parts[-1])
    return "".join(parts)


@pytest.mark.parametrize("candidates", [1, 3])
def test_long_texts_tokenized_in_pieces_give_the_whole_texts_ids(model, candidates, monkeypatch):
    """A state of tens of thousands of characters is tokenized in pieces cut at clean cuts, in one batch call (the
    tokenizer's threads): every candidate's ids are still its whole text's, for a one-candidate request (tokenized
    whole) and for a shared state."""
    batches = []
    encode_many = model.encode_many
    monkeypatch.setattr(type(model), "encode_many",
                        lambda self, texts: batches.append(list(texts)) or encode_many(texts), raising=True)
    monkeypatch.setattr(type(model), "max_length", property(lambda self: 10**6))  # the tiny models refuse > 4,096
    rng = random.Random(candidates)
    for _ in range(3):
        state = _long_state(rng, 30_000)
        criteria = {f"option {j}": _text(rng) for j in range(candidates)}
        request = {"state": state, "questions": {"q": {"type": "choice", "instructions": _text(rng),
                                                       "criteria": criteria}}}
        parsed = parse_request(request)
        prepared = prepare_request(model, request)
        assert prepared.tokens == whole_ids(model, parsed)
    assert batches and all(len(batch) >= 2 for batch in batches)
    assert all("".join(batch) for batch in batches)  # pieces, each a slice of one text


def test_pieces_end_at_clean_cuts_and_join_to_the_text():
    from hf_openjev.tokenizer.candidate_tokens import cut_into_pieces

    rng = random.Random(7)
    for _ in range(50):
        text = _long_state(rng, rng.randint(1, 40_000))
        pieces = cut_into_pieces(text, find_clean_cut, size=1000)
        assert "".join(pieces) == text and all(pieces)
        for piece in pieces[:-1]:  # each ends before a clean cut: a printable non-space, then the next piece's space
            end = sum(len(p) for p in pieces[: pieces.index(piece) + 1])
            assert text[end] == " " and "!" <= text[end - 1] <= "~"
        assert len(text) <= 2000 or len(pieces) > 1 or find_clean_cut(text, 1000, 2000) is None

"""Clean cuts (hf_openjev.tokenizer.prefix_cuts) and the early max_length verdict they allow
(contract.tokenize_candidates): the prefix property and the split property (encode(text) == encode(text[:c]) +
encode(text[c:])) on random texts for every known pre-tokenizer pattern, the tokenizers they refuse, and that a
verdict is the full tokenization's while a 4 MiB over-long state is refused in milliseconds."""

from __future__ import annotations

import random
import re
import time

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from hf_openjev.checkpoint.tiny import build_tiny_tokenizer
from hf_openjev.contract import EXACT_COUNT_CHARS, parse_request, tokenize_candidates
from hf_openjev.errors import RequestError
from hf_openjev.tokenizer.prefix_cuts import (
    GPT2_PATTERN,
    KNOWN_PATTERNS,
    LLAMA3_PATTERN,
    QWEN2_PATTERN,
    QWEN35_PATTERN,
    explain_unclean,
    explain_unsplit,
    find_clean_cut,
)
from hf_openjev.tokenizer.tokenizer_analysis import prove_clean_cuts, prove_clean_splits

CORPUS = ["The customer's order isn't here; they'd like a refund (order #12345) by Friday!!",
          "Über naïve café — 日本語のテキスト, emoji 🙂 and numbers 0123456789.",
          '{"key": "value", "items": [1, 2, 3], "nested": {"a": true, "b": null}}',
          "  indented\n\tlines\r\n\n  with   runs of    spaces...  and ---- dashes ====",
          "Context:\nQuestion: Proposed answer: Is this proposed answer correct? Answer Yes or No."]
# pieces random texts are made of: words, contractions, digits, punctuation runs, whitespace runs of every kind,
# combining marks (NFC composes e + U+0301), Hangul jamo, CJK, emoji, special tokens written in the text
PIECES = ["refund", "order", "Über", "cafe\u0301", "\u1100\u1161\u11a8", "日本語", "🙂", "'s", "'re", "n't", "'",
          "12345", "7", "...", "!!", "(", ")", "#", "--", "==", " ", "  ", "   ", "\n", "\n\n", " \n", "\t", "\r\n",
          "<|im_start|>", "<|im_end|>", "x" * 40, " " * 30, "e\u0301\u0301", "\u00a0", ":", "\"", ","]


def _tokenizer(pre_tokenizer, *, normalizer=None, added=("<|im_start|>", "<|im_end|>"), vocab_size=400, **bpe):
    tok = Tokenizer(models.BPE(**bpe))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(added), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 8, trainer=trainer)
    return tok


def _split(pattern):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


PATTERNS = {"gpt2": GPT2_PATTERN, "llama3": LLAMA3_PATTERN, "qwen2": QWEN2_PATTERN, "qwen3.5": QWEN35_PATTERN}
assert set(PATTERNS.values()) == KNOWN_PATTERNS
CLEAN = {
    **{f"split-{name}": (lambda p=p: _tokenizer(_split(p), normalizer=normalizers.NFC()))
       for name, p in PATTERNS.items()},
    "byte-level-gpt2": lambda: _tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "byte-level-prefix-space": lambda: _tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=True)),
}


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(5, 120)))


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_every_clean_cut_keeps_the_first_tokens(name):
    tok = CLEAN[name]()
    assert explain_unclean(tok) is None
    cuts = 0
    for text, whole, c in _clean_cuts_of_random_texts(tok, name):
        head = _ids(tok, text[:c])
        assert whole[:len(head)] == head, (text[:c], text[c:c + 20])
        cuts += 1
    assert cuts > 500


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _clean_cuts_of_random_texts(tok, seed, texts: int = 150):
    """(text, its ids, c) for every clean cut ``c`` of ``texts`` random texts."""
    rng = random.Random(seed)
    for _ in range(texts):
        text = _random_text(rng)
        whole = _ids(tok, text)
        c = find_clean_cut(text, 1)
        while c is not None:
            yield text, whole, c
            c = find_clean_cut(text, c + 1)


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_every_clean_cut_splits_the_ids(name):
    """encode(text) == encode(text[:c]) + encode(text[c:]) at every clean cut (what tokenizing a request's shared
    text once relies on), texts that start or end with spaces and newlines included."""
    tok = CLEAN[name]()
    assert explain_unsplit(tok) is None and prove_clean_splits(tok)
    cuts = 0
    for text, whole, c in _clean_cuts_of_random_texts(tok, name):
        assert _ids(tok, text[:c]) + _ids(tok, text[c:]) == whole, (text[:c][-20:], text[c:c + 20])
        cuts += 1
    assert cuts > 500


def test_an_added_token_that_strips_the_space_after_it_breaks_the_split_and_is_refused():
    """``rstrip`` takes the cut's space into the token before it: the prefix property holds, the split does not."""
    tok = _tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False))
    tok.add_tokens([AddedToken("Question:", rstrip=True, normalized=False)])
    text = "Context:\nthe state\n\nQuestion: Which one?"
    c = find_clean_cut(text, text.index("Question:") + 9)
    whole, head = (tok.encode(t, add_special_tokens=False).ids for t in (text, text[:c]))
    assert whole[:len(head)] == head and head + tok.encode(text[c:], add_special_tokens=False).ids != whole
    assert explain_unclean(tok) is None and prove_clean_cuts(tok) is find_clean_cut
    assert "strips the whitespace on its right" in explain_unsplit(tok) and prove_clean_splits(tok) is False


def test_other_cuts_do_break_the_property():
    """The property is not trivial: cutting anywhere else changes the prefix's tokens in some texts."""
    tok = CLEAN["split-qwen3.5"]()
    rng = random.Random(1)
    broken = 0
    for _ in range(100):
        text = _random_text(rng)
        whole = tok.encode(text, add_special_tokens=False).ids
        for c in range(1, len(text)):
            head = tok.encode(text[:c], add_special_tokens=False).ids
            broken += whole[:len(head)] != head
    assert broken > 100


@pytest.mark.parametrize("make, reason", [
    (lambda: _tokenizer(pre_tokenizers.Metaspace()), "pre-tokenizer Metaspace"),
    (lambda: _tokenizer(_split(r"\S+\s*")), "is not a known one"),
    (lambda: _tokenizer(pre_tokenizers.ByteLevel(use_regex=False)), "without its regex"),
    (lambda: _tokenizer(pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(use_regex=False),
                                                 pre_tokenizers.Split(Regex(QWEN35_PATTERN), "isolated")])),
     "byte-level step before"),
    (lambda: _tokenizer(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN35_PATTERN), "merged_with_next"),
                                                 pre_tokenizers.ByteLevel(use_regex=False)])), "isolated"),
    (lambda: _tokenizer(pre_tokenizers.ByteLevel(), normalizer=normalizers.Lowercase()), "normalizer Lowercase"),
    (lambda: _tokenizer(pre_tokenizers.ByteLevel(), normalizer=normalizers.NFKC()), "normalizer NFKC"),
    (lambda: _tokenizer(pre_tokenizers.ByteLevel(), added=("<|im_start|>", "end of turn")), "contains a space"),
    (lambda: _tokenizer(pre_tokenizers.ByteLevel(), dropout=0.1), "dropout"),
    (lambda: object(), "not a fast tokenizer"),
])
def test_unproven_tokenizers_are_tokenized_in_full(make, reason):
    tok = make()
    assert reason in explain_unclean(tok) and reason in explain_unsplit(tok)
    assert prove_clean_cuts(tok) is None and prove_clean_splits(tok) is False


def test_the_tiny_models_tokenizer_is_clean_and_the_finder_is_cached():
    tok = build_tiny_tokenizer()
    assert explain_unclean(tok) is None
    assert prove_clean_cuts(tok) is find_clean_cut is prove_clean_cuts(tok)


# ---------------------------------------------------------------------------------------------------- the verdict

def word_encode(text: str) -> list[str]:
    """A stand-in tokenizer for which every clean cut is clean by construction: runs of non-spaces and of spaces."""
    return re.findall(r"\S+|\s+", text)


def _noul(state: str):
    return parse_request({"state": state, "questions": {"q": {"type": "noul", "instructions": "?"}}})


def test_early_verdict_is_exactly_the_full_one_at_the_limit():
    """Long words (many characters per token) put the limit where only the progressive prefixes run: the verdict
    at max_length = n - 1, n, n + 1 is the full tokenization's, and accepted candidates keep their full ids."""
    rng = random.Random(0)
    checked = 0
    for _ in range(60):
        state = " ".join("w" * rng.randint(20, 400) for _ in range(rng.randint(50, 400)))
        parsed = _noul(state)
        text = parsed.questions[0].prompts[0]
        n = len(word_encode(text))
        for limit in (n - 1, n, n + 1, n // 3):
            kwargs = dict(chat_prefix="", chat_suffix="", max_length=limit)
            try:
                full = tokenize_candidates(parsed, word_encode, **kwargs)
            except RequestError as exc:
                full = exc
            try:
                early = tokenize_candidates(parsed, word_encode, clean_cut=find_clean_cut, **kwargs)
            except RequestError as exc:
                early = exc
            assert isinstance(full, RequestError) == isinstance(early, RequestError) == (n > limit)
            if isinstance(full, list):
                assert early == full
            else:
                got = int(re.match(r"question q: (\d+) tokens", early.message).group(1))
                assert limit < got <= n and early.message.endswith(f" tokens exceeds max_length={limit}; no "
                                                                  "silent truncation")
                checked += len(text) > EXACT_COUNT_CHARS * limit
    assert checked > 50  # the progressive path really ran


def test_a_text_without_cuts_is_tokenized_in_full():
    from hf_openjev.contract import ParsedRequest, Question

    parsed = ParsedRequest(None, (Question("q", "noul", ("yes",), ("head " + "x" * 3000,)),))  # one cut, too early
    calls = []

    def encode(text):
        calls.append(len(text))
        return list(text)

    with pytest.raises(RequestError, match=r"^question q: \d+ tokens exceeds max_length=10;"):
        tokenize_candidates(parsed, encode, chat_prefix="", chat_suffix="", max_length=10, clean_cut=find_clean_cut)
    assert calls == [len(parsed.questions[0].prompts[0])]


def test_a_4_mib_over_long_state_is_refused_in_milliseconds(tiny_model):
    from hf_openjev.scoring import prepare_request

    request = {"state": "word " * (4 * 1024 * 1024 // 5), "questions": {"q1": {"type": "noul", "instructions": "?"}}}
    start = time.perf_counter()
    with pytest.raises(RequestError) as info:
        prepare_request(tiny_model, request)
    seconds = time.perf_counter() - start
    assert seconds < 1.0, seconds  # the whole text takes ~3-5 s to tokenize on a CPU
    n = int(re.match(r"question q1: (\d+) tokens exceeds max_length=4096; no silent truncation$",
                     info.value.message).group(1))
    assert 4096 < n < len(tiny_model.encode(request["state"][:200_000]))  # a prefix's count: far below the whole's


def test_accepted_and_moderately_long_candidates_keep_their_exact_counts(tiny_model):
    """Below EXACT_COUNT_CHARS * max_length characters nothing changes: exact counts in messages and usage."""
    from hf_openjev.scoring import prepare_request

    def full(request):
        parsed = parse_request(request, served_models=tiny_model.served_model_names)
        return tokenize_candidates(parsed, tiny_model.encode, chat_prefix=tiny_model.chat_prefix,
                                   chat_suffix=tiny_model.chat_suffix, max_length=10**9)

    ok = {"state": {"ticket": "Refund please " * 50}, "questions": {"c": {"type": "choice", "instructions": "?",
                                                                          "criteria": {"a": None, "b": "long " * 99}}}}
    assert prepare_request(tiny_model, ok).tokens == full(ok)
    long = {"state": "Über naïve café 🙂 " * 3000, "questions": {"q": {"type": "noul", "instructions": "?"}}}
    n = len(full(long)[0][0])
    assert 4096 < n and len(long["state"]) < EXACT_COUNT_CHARS * 4096
    with pytest.raises(RequestError, match=f"^question q: {n} tokens exceeds max_length=4096; no silent truncation$"):
        prepare_request(tiny_model, long)


def test_a_stand_in_encode_is_never_cut(tiny_model):
    """prepare_request uses cuts only with JevModel's own encode (the tokenizer the cuts were proven for)."""
    import dataclasses

    from hf_openjev.model import JevModel
    from hf_openjev.scoring import _clean_cut_for

    assert _clean_cut_for(tiny_model) is find_clean_cut
    other = JevModel(tiny_model.backbone, tiny_model.head, tiny_model.tokenizer,
                     dataclasses.replace(tiny_model.manifest), method="merged")
    other.encode = lambda text: list(text)
    assert _clean_cut_for(other) is None
    assert _clean_cut_for(type("StandIn", (), {"tokenizer": tiny_model.tokenizer, "encode": list})()) is None

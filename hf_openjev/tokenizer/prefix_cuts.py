"""Clean cuts: where a text can be cut so that tokenizing the part before the cut gives exactly its first tokens.

The ``max_length`` check (docs/contract.md §2 item 7) must reject a candidate iff its full tokenization is longer than
``max_length``. A 4 MiB state takes seconds to tokenize in full; a prefix of it that already has more than
``max_length`` tokens settles the verdict in milliseconds, but only if the prefix's tokens really are the
text's first tokens: in general they are not (``"hel"`` may tokenize as ``h el`` while ``"hello"`` is one
token). :func:`prove_clean_cuts` returns, for tokenizers where it can prove it, a function giving positions ``c``
where ``encode(text[:c])`` is a prefix of ``encode(text)``, so that ``len(encode(text[:c]))`` is a lower bound of
``len(encode(text))`` (:func:`hf_openjev.contract.tokenize_candidates` uses it; everything else is tokenized in full).

The cut: ``text[c] == " "`` and ``text[c - 1]`` is a printable ASCII character other than the space. Why the
pipeline of a Hugging Face fast tokenizer (added tokens, normalizer, pre-tokenizer, model per piece) treats the
part before such a cut exactly as it treats it inside the whole text, under the conditions
:func:`prove_clean_cuts` checks:

* added tokens are split out first; none of them contains a space, so no added-token match spans the cut, and the
  matches before it do not depend on what follows (a ``single_word`` token ending at ``c`` sees a space in the
  text and the end of the string in the prefix: both are word boundaries);
* the normalizer is none or NFC: the space is a starter that composes with nothing before it and blocks
  reordering, so NFC(text) = NFC(text[:c]) + NFC(text[c:]) and the two characters at the cut stay as they are;
* the pre-tokenizer splits with one of the known GPT-2 / Llama-3 / Qwen2 / Qwen3.5 patterns (:data:`KNOWN_PATTERNS`,
  or byte-level's built-in GPT-2 one). In these, a space occurs in a match only as its first character or inside
  a whitespace run, so no piece holds "non-space, space" and none spans the cut; and a match attempt that starts
  before the cut and reads past it must have consumed ``text[c - 1]`` inside a letter, mark, digit, punctuation
  or contraction run, where the next element cannot take a space: it stops (or fails) on the space exactly as
  on the end of the prefix. Lookaheads (``\\s+(?!\\S)``) only follow whitespace runs, which end before ``c - 1``.
  So the pieces before the cut are the same in both, and the last one ends at the cut;
* the model tokenizes each piece on its own (all Hugging Face models do; BPE dropout, which is random, is
  refused), and with no special tokens added the post-processor adds nothing.

Clean splits: the same cuts, under one more condition (:func:`explain_unsplit_spec`: no added token strips the
whitespace on its right), also give ``encode(text) == encode(text[:c]) + encode(text[c:])``, so a text shared by
several others (a request's ``chat_prefix + "Context:\\n" + S + "\\n\\nQuestion:"``, followed by `` " " + Q...``) is
tokenized once (:class:`hf_openjev.tokenizer.candidate_tokens.CandidateEncoder`). Why the pieces from the cut on are
the same:

* added tokens (Hugging Face's ``AddedVocabulary.find_matches``: leftmost-longest matches, scanned left to right):
  a match of the whole text that starts before ``c`` ends at or before it (it holds no space), and no token's
  content starts at ``c`` (the space), so the scan of the whole text takes exactly the prefix's matches before
  ``c``, and its matches after ``c`` are the suffix's (the same characters from ``c`` on). The options at the cut:
  ``single_word`` tests the characters beside a match; a match ending at ``c`` has the space after it in the text
  and the string's end in the prefix, a match starting after ``c`` has the same characters before it in the text
  and in the suffix (which starts with the space): every test comes out the same. ``lstrip`` takes the whitespace
  run left of a match; that run starts at ``c`` at the earliest (``text[c - 1]`` is not whitespace), in the text as
  in the suffix. ``rstrip`` would take the space at ``c`` into a match ending there: such tokens are refused.
  ``normalized`` tokens are matched the same way on the normalized pieces (below), and NFC maps no character to a
  space;
* NFC: the space has a boundary before it (canonical combining class 0, quick check yes, composes with nothing
  before it), so NFC(text) = NFC(text[:c]) + NFC(text[c:]): the normalized text is cut at the same space, after
  the same ASCII character;
* the pre-tokenizer: by the argument above, the whole text's matches before the cut are the prefix's and the last
  one ends at ``c``, so the regex scan of the whole text resumes at ``c``. The known patterns have no lookbehind,
  no anchor and no word boundary: a match attempt at ``c`` reads only ``text[c:]``, so every match from there on is
  the suffix's, shifted by ``c`` (none of them matches the empty string, so the scans step alike). Byte-level's
  ``add_prefix_space`` adds nothing to a suffix that starts with a space, and its byte-to-character map is per
  character;
* the model tokenizes each piece on its own, and with no special tokens added the post-processor adds nothing.

tests/test_prefix_cuts.py checks both properties on random texts for every known pattern, and that cuts inside
words do break them; tests/test_shared_tokenization.py checks the requests' ids with the real Qwen3.5 tokenizer.
"""

from __future__ import annotations

import json
import re

__all__ = ["GPT2_PATTERN", "KNOWN_PATTERNS", "LLAMA3_PATTERN", "QWEN2_PATTERN", "QWEN35_PATTERN", "explain_unclean",
           "explain_unclean_spec", "explain_unsplit", "explain_unsplit_spec", "find_clean_cut"]


GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
KNOWN_PATTERNS = frozenset({GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, QWEN35_PATTERN})

_CUT = re.compile(r"[!-~] ")


def find_clean_cut(text: str, start: int, end: int | None = None) -> int | None:
    """The first clean cut ``start <= c <= end`` of ``text`` (``text[c] == " "`` after a printable non-space ASCII
    character), or None; ``end`` (default: the text's end) bounds the search, so a text without spaces is not
    scanned to its end."""
    match = _CUT.search(text, max(start - 1, 0), len(text) if end is None else end + 1)
    return None if match is None else match.start() + 1


def _pre_tokenizer_problem(spec) -> str | None:
    if not isinstance(spec, dict):
        return "no pre-tokenizer (the model would see whole texts)"
    kind = spec.get("type")
    if kind == "Sequence":  # splits, then at most one byte-level step (which maps spaces to letters) at the end
        members = spec.get("pretokenizers") or []
        if any(isinstance(m, dict) and m.get("type") == "ByteLevel" for m in members[:-1]):
            return "a byte-level step before another pre-tokenizer"
        splitting = [m for m in members if not _is_plain_byte_level(m)]
        if not splitting:
            return "no splitting pre-tokenizer"
        return next((p for p in map(_pre_tokenizer_problem, splitting) if p), None)
    if kind == "ByteLevel":
        return None if spec.get("use_regex", True) else "byte-level pre-tokenizer without its regex"
    if kind == "Split":
        pattern = (spec.get("pattern") or {}).get("Regex")
        if pattern not in KNOWN_PATTERNS:
            return f"split pattern {str(pattern)[:60]!r}... is not a known one"
        if spec.get("behavior") != "Isolated" or spec.get("invert"):
            return "split behaviour other than isolated"
        return None
    return f"pre-tokenizer {kind}"


def _is_plain_byte_level(spec) -> bool:
    return isinstance(spec, dict) and spec.get("type") == "ByteLevel" and not spec.get("use_regex", True)


def _normalizer_problem(spec) -> str | None:
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "NFC":
        return None
    if kind == "Sequence":
        return next((p for p in map(_normalizer_problem, spec.get("normalizers") or []) if p), None)
    return f"normalizer {kind}"


def explain_unclean(tokenizer) -> str | None:
    """Why :func:`find_clean_cut`'s cuts are not proven clean for ``tokenizer`` (a Transformers fast tokenizer or
    a ``tokenizers.Tokenizer``), or None when they are."""
    return _explain_from_spec(tokenizer, explain_unclean_spec)


def _explain_from_spec(tokenizer, explain_spec) -> str | None:
    """``explain_spec`` of ``tokenizer``'s ``tokenizer.json`` content, or why there is none to read."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    try:
        spec = json.loads(backend.to_str())
    except Exception as exc:  # noqa: BLE001 - a slow tokenizer, a stand-in
        return f"not a fast tokenizer ({type(exc).__name__})"
    return explain_spec(spec)


def explain_unclean_spec(spec: dict) -> str | None:
    """:func:`explain_unclean` of a tokenizer given as its ``tokenizer.json`` content (parsed)."""
    model = spec.get("model") or {}
    if model.get("dropout"):
        return "BPE dropout (random tokenization)"
    for token in spec.get("added_tokens") or []:
        if " " in token.get("content", ""):
            return f"added token {token.get('content')!r} contains a space"
    return _normalizer_problem(spec.get("normalizer")) or _pre_tokenizer_problem(spec.get("pre_tokenizer"))


def explain_unsplit(tokenizer) -> str | None:
    """Why :func:`find_clean_cut`'s cuts are not proven to split ``tokenizer``'s ids (``encode(text) ==
    encode(text[:c]) + encode(text[c:])``), or None when they are (see the module docstring)."""
    return _explain_from_spec(tokenizer, explain_unsplit_spec)


def explain_unsplit_spec(spec: dict) -> str | None:
    """:func:`explain_unsplit` of a tokenizer given as its ``tokenizer.json`` content (parsed): the clean cuts'
    conditions, and no added token that strips the whitespace on its right (it would take the cut's space)."""
    problem = explain_unclean_spec(spec)
    if problem:
        return problem
    for token in spec.get("added_tokens") or []:
        if token.get("rstrip"):
            return f"added token {token.get('content')!r} strips the whitespace on its right"
    return None

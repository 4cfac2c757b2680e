"""One candidate's token ids under the ``max_length`` check (docs/contract.md §2 item 7), with a request's shared text
tokenized once: the work behind :func:`hf_openjev.contract.tokenize_candidates` (pure Python, no torch).

Every candidate text is ``chat_prefix + "Context:\\n" + S + "\\n\\nQuestion: " + Q + "\\n" + ...`` (docs/contract.md
§3): up to ``"...\\n\\nQuestion:"`` it is the same for every candidate of every question of a request, and the space
after it is a clean cut (:mod:`hf_openjev.tokenizer.prefix_cuts`). Where the tokenizer's clean cuts are proven to
split its ids (:func:`hf_openjev.tokenizer.tokenizer_analysis.prove_clean_splits`), the shared text is tokenized once
and each candidate's ids are ``shared ids + encode(the rest)``: exactly the whole text's ids, with the state (up to
megabytes) tokenized once per request instead of once per candidate. Elsewhere every candidate is tokenized whole.

The verdicts and messages are the whole text's: a candidate over ``max_length`` raises ``RequestError("question <id>:
<n> tokens exceeds max_length=<m>; no silent truncation")`` with its exact count ``<n>``, except that a text of more
than :data:`EXACT_COUNT_CHARS` characters per ``max_length`` token may be refused from a lower bound already over
the limit (:func:`count_past_limit`): the shared text's alone, or the shared ids' count plus the rest's bound.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import RequestError

__all__ = ["BATCH_BYTES", "EXACT_COUNT_CHARS", "PIECE_CHARS", "CandidateEncoder", "count_past_limit",
           "cut_into_pieces"]

EXACT_COUNT_CHARS = 16  # candidates of at most this many characters per max_length token are counted in full
PIECE_CHARS = 4096  # a text over twice this is tokenized in pieces of about this many characters, in parallel
# a request whose candidates' rests (and shared head) add up to at most this many UTF-8 bytes has them tokenized in
# one batch call, on the tokenizer's threads, before the candidate-by-candidate checks; a byte-level token covers at
# least one byte, so the work this adds past an early refusal is at most this many tokens
BATCH_BYTES = 32 * 1024


def cut_into_pieces(text: str, clean_cut: Callable[[str, int, int], int | None], size: int = PIECE_CHARS) -> list[str]:
    """``text`` cut at clean cuts into pieces of about ``size`` characters (a piece ends at the first cut at or past
    ``size`` characters from its start, searched up to twice that; the last piece takes what is left). Where the
    tokenizer splits at clean cuts (``encode(t) == encode(t[:c]) + encode(t[c:])``, applied cut after cut), the
    pieces' ids joined are the text's."""
    pieces, start = [], 0
    while len(text) - start > 2 * size:
        cut = clean_cut(text, start + size, start + 2 * size)
        if cut is None or cut <= start:
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def count_past_limit(text: str, encode: Callable[[str], list[int]], limit: int,
                     clean_cut: Callable[[str, int, int], int | None] | None,
                     token_floor: Callable[[str], int] | None = None) -> int | None:
    """A lower bound of ``len(encode(text))`` that is over ``limit``, or None when there is none to find cheaply (no
    ``clean_cut``, no cut, and no ``token_floor`` over the limit).

    First the token count of a clean prefix: prefixes end at the first cut past 8 * (limit + 1) characters, then
    past twice the previous cut, so the characters tokenized add up to less than twice the last prefix; a cut
    farther than twice the wanted length is not taken. Then ``token_floor``: a bound from the bytes over ``limit``
    settles it without tokenizing (texts with no cut nearby: digits, CJK, no spaces)."""
    want = 8 * (limit + 1)
    while clean_cut is not None and want < len(text):
        cut = clean_cut(text, want, 2 * want)  # searched up to there only
        if cut is None or cut >= len(text) or cut > 2 * want:
            break
        count = len(encode(text[:cut]))
        if count > limit:
            return count
        want = 2 * cut
    if token_floor is not None:
        floor = token_floor(text)
        if floor > limit:
            return floor
    return None


def _over_max_length(question_id, count: int, max_length: int) -> RequestError:
    return RequestError(f"question {question_id}: {count} tokens exceeds max_length={max_length}; no silent "
                        "truncation")


class CandidateEncoder:
    """The token ids of one request's candidates ``chat_prefix + prompt + chat_suffix``, one :meth:`encode` call per
    candidate, in request order.

    ``shared``: the text every prompt starts with (``"Context:\\n" + S + "\\n\\nQuestion:"``, which a space follows),
    or None: every candidate is tokenized whole. With it (only where ``encode`` is proven to split at that space:
    :func:`hf_openjev.tokenizer.tokenizer_analysis.prove_clean_splits`), ``chat_prefix + shared`` is tokenized once,
    at the first candidate (where it alone over ``max_length`` is that candidate's refusal), and each candidate's
    rest on its own; a prompt that does not start with ``shared`` is tokenized whole. ``clean_cut`` and
    ``token_floor``: the early refusals of over-long texts (:func:`count_past_limit`), or None. ``encode_many``:
    the ids of several texts in one call (a fast tokenizer's batch, which runs on several threads), given only where
    ``encode`` splits at clean cuts: a text of more than ``2 * PIECE_CHARS`` characters is then tokenized in pieces
    cut at clean cuts (:func:`cut_into_pieces`), in one ``encode_many`` call.
    """

    def __init__(self, encode: Callable[[str], list[int]], *, chat_prefix: str, chat_suffix: str, max_length: int,
                 clean_cut=None, token_floor=None, shared: str | None = None, encode_many=None):
        self._encode, self.chat_prefix, self.chat_suffix = encode, chat_prefix, chat_suffix
        self._encode_many = encode_many if clean_cut is not None else None
        self.max_length, self.clean_cut, self.token_floor = max_length, clean_cut, token_floor
        self.shared = shared or None
        self._shared_ids: list[int] | None = None
        self._batched: dict[str, list[int]] = {}  # text -> ids, from :meth:`tokenize_together`

    def tokenize_together(self, prompts) -> None:
        """With a shared text and ``encode_many``: the rests of ``prompts`` (those that start with the shared text)
        and ``chat_prefix + shared``, tokenized in one ``encode_many`` call when their UTF-8 bytes add up to at most
        :data:`BATCH_BYTES` (one call instead of one per candidate, its texts on the tokenizer's threads). The ids
        are kept for :meth:`encode`, which still checks candidate by candidate, in order: the same ids (a batch
        tokenizes each text as alone), the same verdicts and messages."""
        if self.shared is None or self._encode_many is None:
            return
        rests = (p[len(self.shared):] + self.chat_suffix for p in prompts if p.startswith(self.shared))
        texts = [*dict.fromkeys(rests), self.chat_prefix + self.shared]
        # characters first (a character is at least a byte): a megabyte state is not encoded to count its bytes
        if sum(map(len, texts)) > BATCH_BYTES or sum(len(t.encode("utf-8")) for t in texts) > BATCH_BYTES:
            return  # long texts keep their own paths: early refusals, pieces
        self._batched = dict(zip(texts, self._encode_many(texts), strict=True))

    def encode(self, question_id, prompt: str) -> list[int]:
        """The ids of ``chat_prefix + prompt + chat_suffix`` [tokens], or ``RequestError`` when they are more than
        ``max_length`` (the count is exact for texts of at most ``EXACT_COUNT_CHARS * max_length`` characters)."""
        size = len(self.chat_prefix) + len(prompt) + len(self.chat_suffix)
        early = size > EXACT_COUNT_CHARS * self.max_length  # a long text: try a lower bound first
        if self.shared is None or not prompt.startswith(self.shared):
            return self._whole(question_id, self.chat_prefix + prompt + self.chat_suffix, early)
        rest = prompt[len(self.shared):] + self.chat_suffix
        head = self._head_ids(question_id, rest, early)
        if early:
            over = count_past_limit(rest, self._encode, self.max_length - len(head), self.clean_cut, self.token_floor)
            if over is not None:
                raise _over_max_length(question_id, len(head) + over, self.max_length)
        ids = head + self._ids(rest)
        if len(ids) > self.max_length:
            raise _over_max_length(question_id, len(ids), self.max_length)
        return ids

    def _ids(self, text: str) -> list[int]:
        """``encode(text)``; a long text in pieces through ``encode_many`` (the same ids: see the class); a text
        :meth:`tokenize_together` tokenized, its ids from there."""
        batched = self._batched.get(text)
        if batched is not None:
            return list(batched)
        if self._encode_many is None or len(text) <= 2 * PIECE_CHARS:
            return list(self._encode(text))
        pieces = cut_into_pieces(text, self.clean_cut)
        if len(pieces) == 1:
            return list(self._encode(text))
        return [i for ids in self._encode_many(pieces) for i in ids]

    def _whole(self, question_id, text: str, early: bool) -> list[int]:
        """Today's path for one text: a lower bound over the limit, else the full ids, checked."""
        over = count_past_limit(text, self._encode, self.max_length, self.clean_cut, self.token_floor) if early \
            else None
        ids = self._ids(text) if over is None else None
        if ids is None or len(ids) > self.max_length:
            raise _over_max_length(question_id, over if ids is None else len(ids), self.max_length)
        return ids

    def _head_ids(self, question_id, rest: str, early: bool) -> list[int]:
        """The ids of ``chat_prefix + shared`` (tokenized at the first call, kept); over ``max_length``, the refusal
        of the candidate whose ``rest`` this is: a lower bound for a long text, else its exact count."""
        if self._shared_ids is None:
            text = self.chat_prefix + self.shared
            over = count_past_limit(text, self._encode, self.max_length, self.clean_cut, self.token_floor) if early \
                else None
            if over is not None:
                raise _over_max_length(question_id, over, self.max_length)
            ids = self._ids(text)
            if len(ids) > self.max_length:  # long texts: this lower bound; else the exact count
                count = len(ids) if early else len(ids) + len(self._encode(rest))
                raise _over_max_length(question_id, count, self.max_length)
            self._shared_ids = ids
        return self._shared_ids

"""What a request costs the path that scores it, counted in tokens.

The reference path runs every candidate's whole sequence; the fast path computes each shared prefix once
(:mod:`hf_openjev.packing.planner`: the request's common prefix, then each question's, then every candidate's own
suffix). The server's per-request cap (``--max-request-tokens``) and the batcher's slices
(:mod:`hf_openjev.serve.slices`) count the work of the path that runs:

* :func:`count_work_tokens` -- the exact count: the sum of full sequences, or the tokens of the fast path's own plan;
* :class:`WorkFloor` -- a running lower bound, candidate by candidate, that never exceeds the exact count on either
  path, so tokenization may stop as soon as the floor is over the cap (the refusal is then certain).
"""

from __future__ import annotations

from collections.abc import Sequence

from .packing.planner import common_prefix_length

__all__ = ["WorkFloor", "count_work_tokens"]


class WorkFloor:
    """A lower bound of the tokens a request's candidates cost, grown one candidate at a time.

    ``shares_prefixes=False``: every sequence in full (the reference path; the bound is exact). ``True``: the
    first sequence in full, then each candidate's tokens past its common prefix with the first candidate of its
    question (a question's first candidate: past its common prefix with the request's first sequence), at least
    one token each. Every term is a segment the fast path's prefix tree computes, and no two are the same, so the
    floor never exceeds :func:`count_work_tokens` of the same candidates.
    """

    def __init__(self, shares_prefixes: bool):
        self.shares_prefixes = bool(shares_prefixes)
        self.total = 0
        self._first: Sequence[int] | None = None
        self._question_first: dict[object, Sequence[int]] = {}

    def copy(self) -> "WorkFloor":
        """A floor that goes on from this one's count without changing it."""
        twin = WorkFloor(self.shares_prefixes)
        twin.total, twin._first, twin._question_first = self.total, self._first, dict(self._question_first)
        return twin

    def add(self, question, sequence: Sequence[int]) -> int:
        """Count one more candidate of ``question`` (any hashable key); the new total."""
        self.total += self.cost(question, sequence)
        if self._first is None:
            self._first = sequence
        self._question_first.setdefault(question, sequence)
        return self.total

    def cost(self, question, sequence: Sequence[int]) -> int:
        """What :meth:`add` would add for this candidate (nothing is counted)."""
        if not self.shares_prefixes or self._first is None:
            return len(sequence)
        head = self._question_first.get(question, self._first)
        return max(1, len(sequence) - common_prefix_length([head, sequence]))


def count_work_tokens(tokens: Sequence[Sequence[Sequence[int]]], *, fast: bool, options=None) -> int:
    """The tokens one request (``tokens[question][candidate] -> ids``) costs: on the reference path
    (``fast=False``) every sequence in full; on the fast path the tokens of its plan's packs
    (:func:`~hf_openjev.packing.planner.plan_requests` with ``options``, a
    :class:`~hf_openjev.fast_options.FastPathOptions`; default: the defaults), shared prefixes once."""
    if not fast:
        return sum(len(seq) for question in tokens for seq in question)
    from .fast_options import FastPathOptions
    from .packing.planner import plan_requests

    o = options if options is not None else FastPathOptions()
    plan = plan_requests([tokens], shared_prefix=o.shared_prefix, min_shared_tokens=o.min_shared_tokens,
                         max_sequences=o.max_sequences if o.packed_candidates else 1, max_tokens=o.max_tokens,
                         share_tails=o.share_tails)
    return sum(pack.tokens(plan) for pack in plan.packs)

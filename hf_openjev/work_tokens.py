"""The tokens of work a request makes the model run, counted once for every user: the server's per-request cap,
the batcher's slices, and the batches the eval command and the pipeline bound by tokens.

The reference path runs every candidate's whole sequence; the fast path computes each shared prefix once
(:mod:`hf_openjev.packing.planner`: the request's common prefix, then each question's, then every candidate's own
suffix). The server's per-request cap (``--max-request-tokens``) and the batcher's slices
(:mod:`hf_openjev.serve.slices`) count the work of the path that runs:

* :func:`count_work_tokens` -- the exact count: the sum of full sequences, or the tokens of the fast path's own plan;
* :class:`WorkFloor` -- a running lower bound, candidate by candidate, that never exceeds the exact count on either
  path, so tokenization may stop as soon as the floor is over the cap (the refusal is then certain).

Batches bounded by tokens as well as by count (what keeps a forward's memory in check whatever the lengths), both
over consecutive items (the order is kept, so results and progress map back):

- :func:`split_padded`: a right-padded batch of sequences costs ``rows * longest`` tokens (what the reference
  forward allocates: ids, masks, activations; the attention mask grows as ``rows * longest**2``, which the bound
  keeps at most ``max_tokens * longest``);
- :func:`split_by_tokens`: a batch of requests costs the sum of their costs (the fast path packs them without
  padding; :func:`task_cost` is one request's: the contract's ``input_tokens`` on the reference path, each
  question's shared prefix counted once on the fast path). It is a cheap estimate, not :func:`count_work_tokens`:
  it runs no planner, so it shares no request-wide prefix and knows no packing limit: the two can differ.

An item bigger than the bound alone forms a batch of its own: it is never refused here (``max_length`` bounds a
sequence, docs/contract.md §2 item 7).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence

from .packing.planner import common_prefix_length

__all__ = ["DEFAULT_BATCH_TOKENS", "WorkFloor", "check_batch_tokens", "count_work_tokens", "split_by_tokens",
           "split_padded", "task_cost"]


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
    from .packing.planner import plan_with_options

    plan = plan_with_options([tokens], options if options is not None else FastPathOptions())
    return sum(pack.tokens(plan) for pack in plan.packs)


DEFAULT_BATCH_TOKENS = 16384  # one max_length 16,384 sequence alone: fits a 24 GB device on JevBench


def check_batch_tokens(value, name: str = "batch_tokens") -> int:
    """``value`` if it is a positive integer, else a one-line ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (tokens per forward batch), got {value!r}")
    return value


def split_padded(lengths: Sequence[int], *, max_rows: int, max_tokens: int) -> list[range]:
    """Consecutive index ranges of ``lengths`` (sequence lengths) with at most ``max_rows`` rows each and a padded
    size ``rows * max(length)`` of at most ``max_tokens`` (a longer sequence alone)."""
    batches: list[range] = []
    start, longest = 0, 0
    for i, length in enumerate(lengths):
        wider = max(longest, int(length))
        if i > start and ((i - start) >= max_rows or (i - start + 1) * wider > max_tokens):
            batches.append(range(start, i))
            start, wider = i, int(length)
        longest = wider
    if start < len(lengths):
        batches.append(range(start, len(lengths)))
    return batches


def split_by_tokens(items: Iterable, cost, *, max_items: int, max_tokens: int) -> Iterator[list]:
    """``items`` in consecutive lists of at most ``max_items`` whose ``cost(item)`` sum to at most ``max_tokens``
    (a costlier item alone); lazy: an item is costed when it is reached, and a list is yielded as soon as the next
    item would not fit in it."""
    batch: list = []
    total = 0
    for item in items:
        tokens = int(cost(item))
        if batch and (len(batch) >= max_items or total + tokens > max_tokens):
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += tokens
    if batch:
        yield batch


def task_cost(prepared, path: str) -> int:
    """Tokens the backbone runs for one prepared request (a ``PreparedRequest``): on the reference path every
    candidate sequence in full (``input_tokens``); on the fast path (``path == "fast"``) the prefix shared by all
    candidates of a question once, plus each candidate's remainder."""
    if path != "fast":
        return prepared.input_tokens
    total = 0
    for question in prepared.tokens:
        shared = len(os.path.commonprefix(question)) if len(question) > 1 else 0
        total += shared + sum(len(seq) - shared for seq in question)
    return total

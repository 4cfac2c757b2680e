"""Batches bounded by tokens as well as by count: what keeps a forward's memory in check whatever the lengths.

Two measures of a batch, both over consecutive items (the order is kept, so results and progress map back):

- :func:`split_padded`: a right-padded batch of sequences costs ``rows * longest`` tokens (what the reference
  forward allocates: ids, masks, activations; the attention mask grows as ``rows * longest**2``, which the bound
  keeps at most ``max_tokens * longest``);
- :func:`split_by_tokens`: a batch of requests costs the sum of their costs (the fast path packs them without
  padding; :func:`task_cost` is one request's: the contract's ``input_tokens`` on the reference path, shared
  prefixes counted once on the fast path).

An item bigger than the bound alone forms a batch of its own: it is never refused here (``max_length`` bounds a
sequence, docs/contract.md §2 item 7).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence

__all__ = ["DEFAULT_BATCH_TOKENS", "check_batch_tokens", "split_by_tokens", "split_padded"]

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

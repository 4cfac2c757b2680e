"""A request's work in bounded slices: the batcher schedules other requests' work between them.

A request whose work (:mod:`hf_openjev.work_tokens`: every sequence in full on the reference path, shared prefixes
once on the fast path) is over ``slice_tokens`` is cut, between candidates and in candidate order, into
:class:`RequestSlice` parts of at most ``slice_tokens`` each (one part may hold more where its first
``align`` candidates alone are over it: a candidate longer than a slice runs as one). Each part is scored like a
request of its own; :func:`join_scores` puts the parts' scores back in the request's shape. The batcher
(:mod:`hf_openjev.serve.batcher`) takes one part per request per group, so a small request waits behind at most
about one slice of a heavy one, and a request whose client left or whose deadline passed stops at its next slice.

``align``: parts start at multiples of this many candidates. The reference path scores a request's sequences in
right-padded batches of ``DEFAULT_BATCH_SIZE`` (:mod:`hf_openjev.reference`); cut at those boundaries, a lone
request's parts run exactly the forwards of its unsliced run, so its answer is the same to the bit. The fast path
plans each part on its own (its shared prefix once per part): equal to the unsliced answer within the rounding of
differently shaped packs, as for requests batched together.

A slice's size is set in tokens; the time it takes depends on the device and the model (recipes/RESULTS.md has
measured rates): :data:`DEFAULT_SLICE_TOKENS` gives each device kind a default of a few hundred milliseconds for
the demo checkpoint, and ``hf-openjev serve --slice-tokens`` sets it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..packing.planner import common_prefix_length
from ..work_tokens import WorkFloor

__all__ = ["DEFAULT_SLICE_TOKENS", "RequestSlice", "default_slice_tokens", "fits_one_slice", "join_scores",
           "split_request"]

DEFAULT_SLICE_TOKENS = {"cuda": 8192, "cpu": 2048}  # tokens of work per slice, by device kind


def default_slice_tokens(device) -> int:
    """The default slice for ``device`` (a torch.device, a name such as ``"cuda:1"``, or None: the CPU's)."""
    kind = getattr(device, "type", None) or str(device or "cpu").split(":")[0]
    return DEFAULT_SLICE_TOKENS.get(kind, DEFAULT_SLICE_TOKENS["cpu"])


@dataclass
class RequestSlice:
    """Some consecutive candidates of a prepared request, scored like a request of their own; any other attribute
    is the request's (``parsed``, ...)."""

    source: object  # the prepared request
    tokens: list  # [question part][candidate] -> token ids: each question it touches, in order
    work: int  # tokens of work, as counted when it was cut (a lower bound on the fast path)

    def __getattr__(self, name):
        if name == "source":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.source, name)

    @property
    def input_tokens(self) -> int:
        return sum(len(seq) for question in self.tokens for seq in question)

    @property
    def sequences(self) -> list:
        return [seq for question in self.tokens for seq in question]


def fits_one_slice(tokens: Sequence, slice_tokens: int, *, shares_prefixes: bool) -> bool:
    """Whether :func:`split_request` would surely leave a request of ``tokens`` (``[question][candidate] -> ids``)
    whole, from a bound of its count without cutting it: every sequence in full, or, where ``shares_prefixes``,
    each question's first candidate in full and every other past the question's common prefix (at least one token
    each: :class:`~hf_openjev.work_tokens.WorkFloor` counts no more). O(candidates) slice comparisons, not
    O(tokens) like the cut: a 3,400-token choice of 6 candidates that fits is not cut to learn it."""
    bound = 0
    for question in tokens:
        if not question:
            continue
        shared = common_prefix_length(question) if shares_prefixes and len(question) > 1 else 0
        bound += max(1, len(question[0])) + sum(max(1, len(seq) - shared) for seq in question[1:])
    return bound <= slice_tokens


def split_request(prepared, slice_tokens: int, *, shares_prefixes: bool, align: int = 1) -> tuple[list, list[int]]:
    """``prepared`` cut into parts of at most ``slice_tokens`` tokens of work, at multiples of ``align`` candidates
    (``prepared.tokens[question][candidate]``), and each part's work; ``[prepared]`` itself when it fits one slice.
    Every part holds at least ``align`` candidates (or the rest); together they hold every candidate once, in
    order."""
    if slice_tokens < 1 or align < 1:
        raise ValueError("slice_tokens and align must be at least 1")
    blocks = _blocks(prepared.tokens, align)
    parts, current, floor = [], [], WorkFloor(shares_prefixes)
    for block in blocks:
        trial = floor.copy()
        for question, seq in block:
            trial.add(question, seq)
        if current and trial.total > slice_tokens:  # the block starts the next part
            parts.append((current, floor.total))
            current, trial = [], WorkFloor(shares_prefixes)
            for question, seq in block:
                trial.add(question, seq)
        floor = trial
        current.extend(block)
    if current:
        parts.append((current, floor.total))
    if len(parts) <= 1:
        return [prepared], [floor.total]
    return [RequestSlice(prepared, _nest(candidates), work) for candidates, work in parts], [w for _, w in parts]


def _blocks(tokens: Sequence, align: int) -> list[list[tuple[int, list]]]:
    """The candidates ``(question index, ids)`` in order, ``align`` at a time."""
    flat = [(qi, seq) for qi, question in enumerate(tokens) for seq in question]
    return [flat[i:i + align] for i in range(0, len(flat), align)]


def _nest(candidates: list[tuple[int, list]]) -> list[list]:
    """``[(question, ids), ...]`` in order -> ``[[ids of one question, ...], ...]``."""
    nested, last = [], None
    for question, seq in candidates:
        if question != last:
            nested.append([])
            last = question
        nested[-1].append(seq)
    return nested


def join_scores(prepared, parts_scores: Sequence) -> list[list[float]]:
    """The request's scores ``[question][candidate]`` from its parts' (each ``[question part][candidate]``, in the
    order of :func:`split_request`)."""
    flat = iter([s for part in parts_scores for question in part for s in question])
    joined = [[next(flat) for _ in question] for question in prepared.tokens]
    if next(flat, None) is not None:
        raise ValueError("the slices returned more scores than the request has candidates")
    return joined

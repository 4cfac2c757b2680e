"""The fast path's plan: the exact token prefix tree of each request, and packs of work.

Pure Python (no torch), so it is unit-tested on its own.

Tree (per request)::

    request prefix  (shared by all its candidate sequences, when >= 2)
      └ question prefix  (the rest of what a question's candidates share, when >= 2 candidates)
          └ candidate suffix  (always >= 1 token: the last token is the one that is scored)

Every state handed from a prefix to its children is taken at a multiple of ``align`` (64) tokens, so the Gated
DeltaNet chunk boundaries of each candidate stay where the unshared sequence has them. A prefix is shared only
when it is at least ``min_shared_tokens`` long (sharing a short prefix costs an extra mixer call per layer and
can lose).

``share_tails=False`` cuts every shared prefix at its last multiple of ``align``: the rest of it is computed
once per candidate. ``share_tails=True`` shares the exact common prefix: the part past its last multiple of
``align`` becomes a *tail* segment (``hands_state=False``). A tail's token-wise work (projections, MLP, norms),
its conv and its attention keys are computed once; in the Gated DeltaNet its children re-run its rows (< 64 of
them) from the state at the multiple of ``align`` before it, so their chunk boundaries do not move. A tree with
tails always runs in one pack (the children read the tail's rows); one too large for a pack is planned without.
The default (``DEFAULT_SHARE_TAILS``, with ``min_shared_tokens`` 16) is faster than aligned-only sharing on the
JevBench workload and as close to the fp32 oracle as aligned-only sharing and stock Transformers + fla in bf16,
so it passes the fidelity gate (docs/design.md "Numerics"; figures in recipes/RESULTS.md, "Fidelity").

Packs: trees are packed in order into groups of at most ``max_sequences`` candidates and ``max_tokens``
tokens. A tree too large for one pack is split: its prefixes run first (their states are kept), then its
candidates run in later packs that continue those states. A sequence longer than ``max_tokens`` runs alone;
nothing is ever truncated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

ALIGN = 64
DEFAULT_MIN_SHARED_TOKENS = 16  # with share_tails (the default); 64 suited aligned-only sharing
DEFAULT_MAX_SEQUENCES = 16
DEFAULT_MAX_TOKENS = 4096
DEFAULT_SHARE_TAILS = True


@dataclass(frozen=True)
class Segment:
    """A run of tokens computed once: a shared prefix or a candidate's suffix."""

    id: int
    tokens: tuple[int, ...]
    parent: int | None  # the segment this one continues (None: starts at position 0)
    start: int  # position of the first token = length of the parent chain
    request: int
    leaf: tuple[int, int] | None = None  # (question, candidate) for a scored candidate suffix
    hands_state: bool = True  # False for a tail: its children re-run its rows in the Gated DeltaNet

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class Pack:
    """One forward: segments in an order where every parent precedes its children."""

    segments: list[int] = field(default_factory=list)
    external: list[int] = field(default_factory=list)  # parents computed in an earlier pack
    export: list[int] = field(default_factory=list)  # segments whose state later packs continue

    def leaves(self, plan: "Plan") -> list[int]:
        return [s for s in self.segments if plan.segments[s].leaf is not None]

    def tokens(self, plan: "Plan") -> int:
        return sum(len(plan.segments[s].tokens) for s in self.segments)


@dataclass
class Plan:
    segments: list[Segment]
    packs: list[Pack]
    shared_tokens: list[int]  # per request: token positions computed once instead of per candidate

    def chain(self, segment_id: int) -> list[int]:
        """Segment ids from the root to ``segment_id`` inclusive."""
        out = []
        current: int | None = segment_id
        while current is not None:
            out.append(current)
            current = self.segments[current].parent
        return out[::-1]


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix shared by every sequence.

    The common prefix of all is that of the lexicographically smallest and largest (any sequence between them
    agrees with both up to there), found by a binary search over slice comparisons: C-speed, no per-token loop."""
    if not sequences:
        return 0
    items = [s if isinstance(s, list) else list(s) for s in sequences]
    low, high = min(items), max(items)
    lo, hi = 0, len(low)  # low[:lo] == high[:lo]; the answer is at most hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if low[lo:mid] == high[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def shareable_length(sequences: Sequence[Sequence[int]], *, align: int = ALIGN) -> int:
    """The longest shareable prefix: common, leaving every sequence >= 1 own token, cut at a multiple of align."""
    if len(sequences) < 2:
        return 0
    limit = min(common_prefix_length(sequences), min(len(s) for s in sequences) - 1)
    return max(0, limit // align * align)


def build_tree(request_index: int, questions: Sequence[Sequence[Sequence[int]]], next_id: int, *,
               shared_prefix: bool = True, min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS,
               align: int = ALIGN, share_tails: bool = DEFAULT_SHARE_TAILS) -> tuple[list[Segment], int]:
    """The segments of one request's prefix tree (ids from ``next_id``) and the shared-token count."""
    segments: list[Segment] = []

    def add(tokens, parent, start, leaf=None, hands_state=True) -> int:
        seg = Segment(next_id + len(segments), tuple(tokens), parent, start, request_index, leaf, hands_state)
        segments.append(seg)
        return seg.id

    def add_shared(tokens, parent, start: int, end: int) -> int:
        """Shared positions [start, end): an aligned part that hands on its state, then a tail (share_tails)."""
        cut = end // align * align if share_tails else end
        if cut > start:
            parent = add(tokens[start:cut], parent, start)
        if end > max(cut, start):
            parent = add(tokens[max(cut, start):end], parent, max(cut, start), hands_state=False)
        return parent

    all_sequences = [seq for question in questions for seq in question]
    if any(len(seq) == 0 for seq in all_sequences):
        raise ValueError(f"request {request_index}: every candidate sequence needs at least one token")
    cut_at = 1 if share_tails else align
    root, root_len = None, 0
    if shared_prefix:
        length = shareable_length(all_sequences, align=cut_at)
        if length >= min_shared_tokens:
            root, root_len = add_shared(all_sequences[0], None, 0, length), length
    shared = root_len * (len(all_sequences) - 1)
    for qi, candidates in enumerate(questions):
        parent, start = root, root_len
        if shared_prefix and len(candidates) >= 2:
            length = shareable_length(candidates, align=cut_at)
            if length - root_len >= min_shared_tokens:
                parent = add_shared(candidates[0], root, root_len, length)
                shared += (length - root_len) * (len(candidates) - 1)
                start = length
        for ci, seq in enumerate(candidates):
            add(seq[start:], parent, start, leaf=(qi, ci))
    return segments, shared


def _subtree_packs(tree: list[Segment], *, max_sequences: int, max_tokens: int) -> list[Pack]:
    """Split one tree that does not fit a pack: prefixes first, then candidates, each in packs within the limits.

    A segment whose parent ran in an earlier pack lists it in ``external``; a prefix is exported exactly when a
    later pack continues it. A single prefix longer than ``max_tokens`` runs alone.
    """
    packs: list[Pack] = []
    pack_of: dict[int, int] = {}  # segment id -> index of its pack
    prefixes = [s for s in tree if s.leaf is None]
    leaves = [s for s in tree if s.leaf is not None]

    def place(segments: list[Segment], fits) -> None:
        current: Pack | None = None
        for seg in segments:
            if current is None or not fits(current, seg):
                current = Pack()
                packs.append(current)
            current.segments.append(seg.id)
            pack_of[seg.id] = len(packs) - 1
            parent = seg.parent
            if parent is not None and pack_of[parent] != len(packs) - 1 and parent not in current.external:
                current.external.append(parent)

    by_id = {s.id: s for s in tree}

    def tokens(pack: Pack) -> int:
        return sum(len(by_id[i].tokens) for i in pack.segments)

    place(prefixes, lambda pack, seg: tokens(pack) + len(seg.tokens) <= max_tokens)
    place(leaves, lambda pack, seg: (len(pack.segments) < max_sequences
                                     and tokens(pack) + len(seg.tokens) <= max_tokens))
    for pack in packs:
        for parent in pack.external:
            source = packs[pack_of[parent]]
            if parent not in source.export:
                source.export.append(parent)
    for pack in packs:
        pack.export.sort()
    return packs


def plan_requests(requests: Sequence[Sequence[Sequence[Sequence[int]]]], *, shared_prefix: bool = True,
                  min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS, max_sequences: int = DEFAULT_MAX_SEQUENCES,
                  max_tokens: int = DEFAULT_MAX_TOKENS, align: int = ALIGN,
                  share_tails: bool = DEFAULT_SHARE_TAILS) -> Plan:
    """Plan the forwards for ``requests[r][q][c] -> token ids`` (one or many requests, scored together)."""
    if max_sequences < 1 or max_tokens < 1:
        raise ValueError("max_sequences and max_tokens must be at least 1")
    if min_shared_tokens < 1 or align < 1:
        raise ValueError("min_shared_tokens and align must be at least 1")
    segments: list[Segment] = []
    shared_tokens: list[int] = []
    packs: list[Pack] = []
    current = Pack()
    current_leaves = current_tokens = 0
    for r, questions in enumerate(requests):
        options = dict(shared_prefix=shared_prefix, min_shared_tokens=min_shared_tokens, align=align)
        tree, shared = build_tree(r, questions, len(segments), share_tails=share_tails, **options)
        n_leaves = sum(1 for s in tree if s.leaf is not None)
        n_tokens = sum(len(s.tokens) for s in tree)
        if (n_leaves > max_sequences or n_tokens > max_tokens) and not all(s.hands_state for s in tree):
            tree, shared = build_tree(r, questions, len(segments), share_tails=False, **options)  # split: no tails
            n_tokens = sum(len(s.tokens) for s in tree)
        segments.extend(tree)
        shared_tokens.append(shared)
        if n_leaves <= max_sequences and n_tokens <= max_tokens:
            if current.segments and (current_leaves + n_leaves > max_sequences or current_tokens + n_tokens > max_tokens):
                packs.append(current)
                current, current_leaves, current_tokens = Pack(), 0, 0
            current.segments.extend(s.id for s in tree)
            current_leaves += n_leaves
            current_tokens += n_tokens
        elif len(tree) == 1:  # one sequence longer than max_tokens: it runs alone, untruncated
            packs.append(Pack(segments=[tree[0].id]))
        else:
            packs.extend(_subtree_packs(tree, max_sequences=max_sequences, max_tokens=max_tokens))
    if current.segments:
        packs.append(current)
    return Plan(segments, packs, shared_tokens)


def plan_with_options(requests: Sequence[Sequence[Sequence[Sequence[int]]]], options) -> Plan:
    """:func:`plan_requests` as the fast path plans under ``options`` (a
    :class:`~hf_openjev.fast_options.FastPathOptions`): ``packed_candidates`` off, one sequence a pack."""
    return plan_requests(requests, shared_prefix=options.shared_prefix, min_shared_tokens=options.min_shared_tokens,
                         max_sequences=options.max_sequences if options.packed_candidates else 1,
                         max_tokens=options.max_tokens, share_tails=options.share_tails)

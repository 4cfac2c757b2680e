"""The host-side pieces of a pack's layout that need no tensors of their own to be built: the state and layout
records (:class:`SegmentState`, :class:`GdnCall`, :class:`LevelSpec`, :class:`Layout`, :class:`StateBank`,
:class:`ExternalBlocks`) and the pure steps that group levels, find anchors, index received states, chain parents,
group the Gated DeltaNet calls, gather their rows and pick the final rows. :mod:`.layout` (the fast path's steps,
on plain lists) and :mod:`.naive_layout` (its reference, the same steps on tensors) both build on them; see
:mod:`.layout` for the layout itself."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .graph_buckets import bucket_sequences, bucket_tokens


@dataclass
class SegmentState:
    """The state after a segment's whole chain, for the packs that continue it (per layer index)."""

    length: int  # tokens in the chain (the position where children start)
    gdn: dict[int, torch.Tensor] = field(default_factory=dict)  # [Hv, Dk, Dv] fp32
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # [C, K]
    key: dict[int, torch.Tensor] = field(default_factory=dict)  # [length, Hkv, D]
    value: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class GdnCall:
    """One conv + Gated DeltaNet call per layer over the levels ``first..last`` (pack rows [lo, hi)): over those
    rows in order (``rows`` None; one level, no tails), or over a gathered layout of them."""

    first: int
    last: int  # levels first..last (inclusive)
    lo: int
    hi: int  # the pack rows [lo, hi) it computes
    cu_seqlens: torch.Tensor  # [n+1] int32 over its layout
    chunk_indices: torch.Tensor  # [C, 2] for the GDN and conv kernels (CUDA)
    chunk_offsets: torch.Tensor  # [n+1] each sequence's first chunk, for the GDN kernel (CUDA)
    parent_rows: torch.Tensor  # [n] int64 rows of the initial states: of the state bank (0 = zeros), or of call
    # ``source``'s final states when that is set
    has_parents: bool  # some sequence starts from a handed-on state (not all from zeros)
    source: int | None = None  # every real sequence starts from a final state of this earlier call (dummies: its
    # row 0); the forward then reads that call's states directly, without assembling the bank
    rows: torch.Tensor | None = None  # [T'] int64 pack rows of the gathered layout (all < hi)
    keep: torch.Tensor | None = None  # [hi - lo] int64 gathered row of each of the rows [lo, hi)

    def tensors(self) -> list[torch.Tensor]:
        """The call's own device inputs (a one-level call without tails shares its level's cu_seqlens/chunks)."""
        own = [self.parent_rows]
        return own if self.rows is None else own + [self.cu_seqlens, self.chunk_indices, self.chunk_offsets, self.rows,
                                                    self.keep]

    def key(self) -> tuple:
        return (self.first, self.last, self.has_parents, self.source, tuple(self.cu_seqlens.shape),
                tuple(self.chunk_indices.shape),
                None if self.rows is None else tuple(self.rows.shape))


@dataclass
class LevelSpec:
    lo: int
    hi: int  # token slice [lo, hi) of this level
    cu_seqlens: torch.Tensor  # [n+1] int32, relative to lo
    chunk_indices: torch.Tensor  # [C, 2] for the GDN kernel (CUDA)
    chunk_offsets: torch.Tensor  # [n+1] int64 each sequence's first chunk (the GDN kernel, CUDA)
    max_seqlen: int
    has_parents: bool  # some sequence continues a prefix (attention reads its chain of keys)
    # with parents: sequence i reads prefix keys prefix_starts[i] .. + prefix_lengths[i] of [external K/V ; pack
    # K/V] in place, or of its gathered rows ``chain_index`` (one copy per distinct block) when that is set
    prefix_starts: torch.Tensor | None = None  # [n+1] int32 (entry n: the end of the last block read)
    prefix_lengths: torch.Tensor | None = None  # [n] int32, 0: no prefix (roots and dummies)
    chain_index: torch.Tensor | None = None  # [P] int64 rows of [external K/V ; pack K/V], or None: in place
    max_chain: int = 0  # a bound on prefix_lengths (FA2's max_seqlen_k)
    # one real sequence from ``lo``, no prefix: attention runs as one causal call over rows [lo, hi). Dummies come
    # after it, so they read its keys and it never reads theirs; their outputs are never read
    dense: bool = False


def group_levels(plan, pack) -> list[list[int]]:
    """The pack's segment ids by *level*, the number of their ancestors inside the pack: ``[[level 0 ids],
    [level 1 ids], ...]``, each level's ids in pack order. A segment whose parent lies in an earlier pack (or that
    has none) is at level 0."""
    segments, in_pack = plan.segments, set(pack.segments)
    by_level: dict[int, list[int]] = {}
    for seg_id in pack.segments:
        parent, level = segments[seg_id].parent, 0
        while parent is not None and parent in in_pack:
            level, parent = level + 1, segments[parent].parent
        by_level.setdefault(level, []).append(seg_id)
    return [by_level[level] for level in sorted(by_level)]


def find_anchors(plan, pack) -> dict[int, tuple[list[int], int | None]]:
    """Where each segment's Gated DeltaNet starts: ``{segment id: (tails, anchor)}``. ``tails``: the tail ancestors
    (``hands_state=False``) whose rows it re-runs, root-most first; ``anchor``: the nearest ancestor that hands a
    state on (None: it starts from zeros). A segment that continues a tail of another pack is refused
    (ValueError): a tail's children must share its pack."""
    segments, in_pack = plan.segments, set(pack.segments)
    anchors = {}
    for seg_id in pack.segments:
        tails, parent = [], segments[seg_id].parent
        while parent is not None and not segments[parent].hands_state:
            if parent not in in_pack:
                raise ValueError(f"segment {seg_id} continues tail {parent} from another pack; a tail's children "
                                 "must share its pack (plan with share_tails=False to split this tree)")
            tails.append(parent)
            parent = segments[parent].parent
        anchors[seg_id] = (tails[::-1], parent)
    return anchors


@dataclass(frozen=True)
class ExternalBlocks:
    """The prefix states a pack receives from earlier packs (``pack.external``, in that order). Their chains' K/V
    rows are concatenated into ``[Pext, Hkv, D]`` (``offset``: each block's first row; ``rows``: Pext); the
    recurrent state of ``ids[i]`` is row ``1 + i`` of every layer's state bank."""

    ids: list[int]
    offset: dict[int, int]
    length: dict[int, int]  # rows of each block: the tokens of its segment's whole chain
    rows: int


def index_external(pack, store: dict[int, SegmentState]) -> ExternalBlocks:
    """Lay out the K/V blocks of the states ``pack`` receives (``store``: earlier packs' exports)."""
    offset, length, rows = {}, {}, 0
    for seg in pack.external:
        offset[seg], length[seg] = rows, store[seg].length
        rows += length[seg]
    return ExternalBlocks(list(pack.external), offset, length, rows)


@dataclass
class Layout:
    """The pack's rows, built on the host: tokens and positions ``[T]``, level after level (each level one
    contiguous slice, its dummy sequences last), and where each segment lies."""

    level_ids: list[list[int]]  # each level's real segments, in layout order
    token_ids: list[int] = field(default_factory=list)  # [T]
    positions: list[int] = field(default_factory=list)  # [T]
    start_of: dict[int, int] = field(default_factory=dict)  # pack row of each segment's first token
    chain_rows: dict[int, list[int]] = field(default_factory=dict)  # rows of [external ; pack] K/V of each
    # segment's whole chain (its ancestors' tokens, then its own)
    levels: list[LevelSpec] = field(default_factory=list)


def parent_chain(plan, seg_id: int, layout: Layout, external: ExternalBlocks) -> list[int]:
    """The rows of ``[external K/V ; pack K/V]`` that segment ``seg_id`` attends to before its own: its parent's
    whole chain ([] for a root)."""
    parent = plan.segments[seg_id].parent
    if parent is None:
        return []
    if parent in external.offset:
        return list(range(external.offset[parent], external.offset[parent] + external.length[parent]))
    return layout.chain_rows[parent]


def group_gdn_levels(level_ids: list[list[int]], anchors: dict, *, merge: bool = True) -> list[list[int]]:
    """The levels each conv + Gated DeltaNet call runs over: ``[[level indices of call 0], ...]``. A level joins
    the open call unless one of its segments' anchors (:func:`find_anchors`) is computed in that call; ``merge``
    False gives every level its own call."""
    level_of_segment = {seg_id: index for index, ids in enumerate(level_ids) for seg_id in ids}
    groups: list[list[int]] = []
    for index, ids in enumerate(level_ids):
        starts = {anchors[seg_id][1] for seg_id in ids}
        if merge and groups and not any(level_of_segment.get(a) in groups[-1] for a in starts if a is not None):
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


class StateBank:
    """Numbers the rows of every layer's recurrent-state bank: row 0 zeros, rows 1..E the states received from
    earlier packs (``external_ids`` in order), then each Gated DeltaNet call's final states in call order, one row
    per sequence of the call (dummies included)."""

    def __init__(self, external_ids: list[int]):
        self.row_of = {seg: 1 + i for i, seg in enumerate(external_ids)}  # segment -> the bank row of its state
        self.next_row = 1 + len(external_ids)
        self.spans: list[tuple[int, int]] = []  # the rows [start, end) of each call so far

    def anchor_row(self, anchor: int | None) -> int:
        """The bank row a sequence anchored at ``anchor`` starts from (0: zeros)."""
        return 0 if anchor is None else self.row_of[anchor]

    def add_call_rows(self, sequences: list[int], parents: list[int]) -> tuple[int | None, list[int]]:
        """Number the final-state rows of a call whose real ``sequences`` come first, then its dummies (``parents``:
        the bank row each of them starts from, one per sequence, dummies' 0); return ``(source, parent_rows)``.

        When all its real sequences start from final states of one earlier call (no zero or external state among
        them: the commonest case, children of one prefix level), that call is the ``source`` and ``parent_rows``
        ``[n]`` are rows of its final states (dummies read its row 0; their outputs are never read): the forward
        then reads those states directly instead of assembling the bank. Otherwise ``parent_rows`` are bank rows."""
        start = self.next_row
        for i, seg_id in enumerate(sequences):
            self.row_of[seg_id] = start + i
        self.spans.append((start, start + len(parents)))
        self.next_row += len(parents)
        real = parents[:len(sequences)]
        for index, (lo_row, hi_row) in enumerate(self.spans[:-1]):
            if real and all(lo_row <= r < hi_row for r in real):
                return index, [r - lo_row for r in real] + [0] * (len(parents) - len(sequences))
        return None, list(parents)


def gather_call_rows(plan, sequences: list[int], anchors: dict, layout: Layout, lo: int,
                     hi: int) -> tuple[list[int], list[int], list[int]]:
    """The gathered layout of a call over the pack rows ``[lo, hi)``: ``(rows [T'], cu [n+1], keep [hi - lo])``.
    Each sequence is its tail ancestors' rows then its own (``rows``: pack rows, in that order; ``cu``: the
    sequence boundaries); ``keep[r - lo]`` is the gathered row of pack row ``r`` (rows of the levels' dummies keep
    gathered row 0, never read)."""
    segments = plan.segments
    rows, cu, keep = [], [0], [0] * (hi - lo)
    for seg_id in sequences:
        for tail in anchors[seg_id][0]:
            rows.extend(range(layout.start_of[tail], layout.start_of[tail] + len(segments[tail].tokens)))
        own = len(segments[seg_id].tokens)
        at = layout.start_of[seg_id] - lo
        keep[at: at + own] = range(len(rows), len(rows) + own)
        rows.extend(range(layout.start_of[seg_id], layout.start_of[seg_id] + own))
        cu.append(len(rows))
    return rows, cu, keep


def select_final_rows(plan, pack, layout: Layout, *, pad: bool) -> tuple[list[int], list[int]]:
    """``(leaf_ids, final_rows)``: the pack's scored segments in pack order and the pack row of each one's last
    token; when ``pad``, extra rows (row 0) up to the sequence bucket (callers keep the first ``len(leaf_ids)``)."""
    segments = plan.segments
    leaf_ids = [s for s in pack.segments if segments[s].leaf is not None]
    final_rows = [layout.start_of[s] + len(segments[s].tokens) - 1 for s in leaf_ids]
    if pad:
        final_rows += [0] * (bucket_sequences(len(final_rows)) - len(final_rows))
    return leaf_ids, final_rows


def chain_prefix_blocks(prefixes: list[list[int]], rows_before: int, *,
                        pad: bool) -> tuple[list[int], list[int], int, list[int] | None]:
    """How a level's sequences read their prefix blocks (``prefixes[i]``: rows of ``[external ; pack]`` K/V, []
    for none): ``(first row read [n], rows read [n], max_chain, chain)``. ``chain`` is None when every block is a run
    of consecutive rows (read in place), else the distinct blocks' rows gathered once (padded to its token bucket
    when ``pad``); the step ``layout.add_route_lists`` and ``naive_layout.route_prefixes`` both take."""
    blocks = [b for b in prefixes if b]
    chain: list[int] | None = None
    if all(b == list(range(b[0], b[0] + len(b))) for b in blocks):
        first = [b[0] if b else 0 for b in prefixes]
        max_chain = rows_before if pad else max(map(len, blocks))
    else:
        offset_of: dict[tuple[int, ...], int] = {}
        chain = []
        for block in map(tuple, blocks):
            if block not in offset_of:
                offset_of[block] = len(chain)
                chain.extend(block)
        first = [offset_of[tuple(b)] if b else 0 for b in prefixes]
        max_chain = max(map(len, blocks))
        if pad:  # rows past the last block are never read
            max_chain = bucket_tokens(len(chain))
            chain += [0] * (max_chain - len(chain))
    return first, [len(b) for b in prefixes], max_chain, chain


def token_runs_of(plan, pack, layout: Layout) -> tuple[tuple[int, int], ...]:
    """The token rows in layout order: (the segment's position in ``pack.segments``, or -1 for a level's dummy
    sequences of token 0, length)."""
    position = {seg_id: i for i, seg_id in enumerate(pack.segments)}
    runs, row = [], 0
    for ids, level in zip(layout.level_ids, layout.levels):
        for seg_id in ids:
            runs.append((position[seg_id], len(plan.segments[seg_id].tokens)))
            row += runs[-1][1]
        if level.hi > row:
            runs.append((-1, level.hi - row))
            row = level.hi
    return tuple(runs)

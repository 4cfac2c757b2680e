"""What one packed forward needs on the device: token layout, per-level varlen metadata, state routing.

Built on the host from a planner ``Pack`` (all host work happens here, before the forward, so the forward
itself has no host synchronisation). Layout of the pack's tokens: segments grouped by *level* (the number of
in-pack ancestors), so each level is one contiguous slice, and each layer's attention runs once per level (its
Gated DeltaNet calls may span several levels, below)::

    [ level 0 segments | level 1 segments | level 2 segments ]

State routing: per layer, a *bank* of states holds row 0 = zeros (no parent), rows 1..E = states handed in
from earlier packs (``external``), then the final states of each Gated DeltaNet call in order (one row per
sequence of the call, dummies included). A segment's initial Gated DeltaNet / conv state is ``bank[row]`` of its
*anchor*: its parent, or for a segment that continues a tail, the nearest ancestor that hands a state on. A call
whose real sequences all start from final states of one earlier call reads those directly (``GdnCall.source``),
and then no bank is assembled. For attention, a segment that continues a prefix reads that prefix's whole chain
of keys, a block of rows of ``[external K/V ; this pack's K/V]`` shared by all its children: in place when every
block of the level is a run of consecutive rows (a parent at level 0 or in an earlier pack), else gathered once
per layer (``chain_index``); never copied per candidate.

Gated DeltaNet calls (:class:`GdnCall`): consecutive levels share one conv + GDN call per layer when none of
their sequences starts from a state another of them writes. Without tails every level reads its parent level's
states, so each level is one call over its own rows. Tails (planner segments with ``hands_state=False``) hand
no state on: a segment that continues one re-runs its rows, each sequence of the call being [its tail ancestors'
rows ; its own rows] from its anchor's states (a *gathered* layout, ``keep`` picks the call's own rows out of the
result), so the tail's level and its children's read the same anchor and run as one call. Attention continues a
tail as any other parent.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from hf_openjev.ops.varlen import prepare_varlen_metadata

from .graph_buckets import bucket_sequences, bucket_tokens, pad_level

# A level of one sequence this long or longer, with no prefix, runs its attention as one dense causal call
# (ops.packed_attention.causal_attention: cuDNN on CUDA). The H200 measured cuDNN 26% faster than FA2 at 2,048
# tokens, 47% at 3,400 and slower at <= 1,024 (recipes/results/h200-2026-11-29-s7/probe7). 0 turns it off.
DENSE_ATTENTION_TOKENS = 2048


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


@dataclass
class PackContext:
    """Device-side description of one packed forward (see the module docstring)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    levels: list[LevelSpec]
    gdn_calls: list[GdnCall]
    final_rows: torch.Tensor  # [N] int64: last token of each scored candidate, in ``leaf_ids`` order
    leaf_ids: list[int]
    final_row_mlp: bool = True
    compile_elementwise: bool = False  # the layers' elementwise work through Inductor (compiled_elementwise.py)
    fused_elementwise: bool = True  # ... or through the hf_openjev ops (Triton kernels on CUDA)
    gdn_fp32: bool = False  # Gated DeltaNet kernel fed fp32 q/k/v (more precise intermediates, slower)
    n_external: int = 0
    external_gdn: dict[int, torch.Tensor] = field(default_factory=dict)  # [E, Hv, Dk, Dv]
    external_conv: dict[int, torch.Tensor] = field(default_factory=dict)  # [E, C, K]
    external_key: dict[int, torch.Tensor] = field(default_factory=dict)  # [Pext, Hkv, D]
    external_value: dict[int, torch.Tensor] = field(default_factory=dict)
    # exports: segment id -> (bank row, chain token rows of [external ; pack] K/V, chain length)
    exports: dict[int, tuple[int, torch.Tensor, int]] = field(default_factory=dict)
    exported: dict[int, SegmentState] = field(default_factory=dict)  # filled during the forward
    graph_key: tuple | None = None  # set for a padded (graph-ready) context: equal keys, equal tensor shapes
    # dtype -> the flat device buffer every tensor of ``static_tensors()`` is a view of (``move_inputs``)
    inputs: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def static_tensors(self) -> list[torch.Tensor]:
        """Every device input of the forward, in a fixed order (what a graph replay copies in)."""
        out = [self.input_ids, self.positions, self.final_rows]
        for level in self.levels:
            out += [level.cu_seqlens, level.chunk_indices, level.chunk_offsets]
            if level.has_parents:
                out += [level.prefix_starts, level.prefix_lengths]
                out += [] if level.chain_index is None else [level.chain_index]
        for call in self.gdn_calls:
            out += call.tensors()
        return out

    def record_recurrent(self, layer: int, gdn_bank: torch.Tensor, conv_bank: torch.Tensor) -> None:
        for seg, (row, _, length) in self.exports.items():
            state = self.exported.setdefault(seg, SegmentState(length))
            state.gdn[layer], state.conv[layer] = gdn_bank[row], conv_bank[row]

    def record_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        for seg, (_, chain, length) in self.exports.items():
            state = self.exported.setdefault(seg, SegmentState(length))
            state.key[layer], state.value[layer] = key.index_select(0, chain), value.index_select(0, chain)


_ALIGN_BYTES = 16  # each input starts 16-byte aligned, as its own allocation would (Triton specializes on that)


def move_inputs(ctx: PackContext, device) -> None:
    """Move the context's inputs (``static_tensors()``, built on the host) to ``device`` in one pinned, asynchronous
    copy per dtype: each becomes a view of a flat buffer (``ctx.inputs``), so that a graph replay also copies one
    buffer per dtype, not each tensor. Contexts with equal graph keys get equal buffer layouts (equal tensor
    shapes, in a fixed order). On the H200 (s9 ``host9`` -> ``flat9``, two machines) the replay's launch went from
    0.09-0.36 to 0.06-0.21 ms per request; building the context did not get cheaper (0.25-0.8 ms)."""
    device = torch.device(device)
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in ctx.static_tensors():
        groups.setdefault(tensor.dtype, []).append(tensor)
    views: dict[int, torch.Tensor] = {}
    for dtype, tensors in groups.items():
        step = max(1, _ALIGN_BYTES // tensors[0].element_size())
        offsets, size = [], 0
        for tensor in tensors:
            offsets.append(size)
            size += -(-tensor.numel() // step) * step
        host = torch.zeros(size, dtype=dtype, pin_memory=device.type == "cuda")  # pinned: an asynchronous copy
        for tensor, offset in zip(tensors, offsets):
            host[offset: offset + tensor.numel()] = tensor.reshape(-1)
        flat = ctx.inputs[dtype] = host.to(device, non_blocking=True)
        for tensor, offset in zip(tensors, offsets):
            views[id(tensor)] = flat[offset: offset + tensor.numel()].view(tensor.shape)
    for holder in (ctx, *ctx.levels, *ctx.gdn_calls):  # shared tensors (a call's and its level's) stay shared
        for f in dataclasses.fields(holder):
            value = getattr(holder, f.name)
            if isinstance(value, torch.Tensor):
                if id(value) not in views:  # it would stay on the host, and a graph replay would not copy it in
                    raise RuntimeError(f"{type(holder).__name__}.{f.name} is missing from static_tensors()")
                setattr(holder, f.name, views[id(value)])


def build_pack_context(plan, pack, store: dict[int, SegmentState], device, *, final_row_mlp: bool = True,
                       compile_elementwise: bool = False, fused_elementwise: bool = True, gdn_fp32: bool = False,
                       pad: bool = False, merge_levels: bool = True,
                       dense_attention_tokens: int = DENSE_ATTENTION_TOKENS) -> PackContext:
    """Lay out ``pack`` (a planner Pack of ``plan``) and route states; ``store`` holds earlier packs' exports.

    ``pad=True`` (packs without external states or exports only) pads every level with dummy sequences to its
    shape bucket (:mod:`.graph_buckets`) and sets ``graph_key``: contexts with equal keys have equal tensor
    shapes, so one captured CUDA graph replays them all. Dummy tokens start from zero states (or, in a call with a
    ``source``, from its first final state), read no prefix and are never scored or read by another sequence, so
    the real sequences' results do not change.

    ``merge_levels=False`` gives every level its own Gated DeltaNet call (one sequence's arithmetic does not depend
    on the other sequences of its call, so the rows are the same; tests compare the two).

    ``dense_attention_tokens``: a level of one sequence at least this long, with no prefix, gets ``dense`` (one
    dense causal attention call, ``LevelSpec.dense``); 0 never.
    """
    if dense_attention_tokens < 0:
        raise ValueError(f"dense_attention_tokens must be >= 0 (0: never), got {dense_attention_tokens}")
    if pad and (pack.external or pack.export):
        raise ValueError("only packs without external states or exports can be padded for graph replay")
    segments = plan.segments
    in_pack = set(pack.segments)
    external = list(pack.external)
    ext_row = {seg: 1 + i for i, seg in enumerate(external)}

    def level_of(seg_id: int) -> int:
        parent, level = segments[seg_id].parent, 0
        while parent is not None and parent in in_pack:
            level, parent = level + 1, segments[parent].parent
        return level

    by_level: dict[int, list[int]] = {}
    for seg_id in pack.segments:
        by_level.setdefault(level_of(seg_id), []).append(seg_id)

    # external K/V blocks, concatenated in `external` order
    ext_offset, ext_len = {}, 0
    for seg in external:
        ext_offset[seg] = ext_len
        ext_len += store[seg].length

    token_ids: list[int] = []
    positions: list[int] = []
    start_of: dict[int, int] = {}  # pack row of each segment's first token (offset by ext_len in K/V rows)
    bank_row: dict[int, int] = dict(ext_row)
    next_row = 1 + len(external)
    levels: list[LevelSpec] = []
    chain_rows: dict[int, list[int]] = {}  # rows of [external ; pack] K/V of each segment's whole chain

    def parent_chain(seg_id: int) -> list[int]:
        parent = segments[seg_id].parent
        if parent is None:
            return []
        if parent in ext_offset:
            return list(range(ext_offset[parent], ext_offset[parent] + store[parent].length))
        return chain_rows[parent]

    def gdn_start(seg_id: int) -> tuple[list[int], int | None]:
        """(the tail ancestors whose rows the segment's GDN re-runs, root-most first; the state-handing one)."""
        tails, parent = [], segments[seg_id].parent
        while parent is not None and not segments[parent].hands_state:
            if parent not in in_pack:
                raise ValueError(f"segment {seg_id} continues tail {parent} from another pack; a tail's children "
                                 "must share its pack (plan with share_tails=False to split this tree)")
            tails.append(parent)
            parent = segments[parent].parent
        return tails[::-1], parent

    def route_prefixes(spec: LevelSpec, prefixes: list[list[int]], rows_before: int) -> None:
        """Each sequence's prefix block for attention (``prefix_starts`` / ``prefix_lengths``). When every block
        is a run of consecutive rows of [external ; pack] K/V (children of a level-0 parent or of an external
        prefix: all of a two-level plan), the blocks are read there in place (``chain_index`` None, no gather);
        otherwise the distinct blocks are gathered once (``chain_index``) and shared by their sequences."""
        blocks = [b for b in prefixes if b]
        if all(b == list(range(b[0], b[0] + len(b))) for b in blocks):
            first = [b[0] if b else 0 for b in prefixes]
            # parents lie in earlier levels: below rows_before, a bound fixed by those levels' padded sizes
            spec.max_chain = rows_before if pad else max(map(len, blocks))
        else:
            offset_of: dict[tuple[int, ...], int] = {}
            chain: list[int] = []
            for block in map(tuple, blocks):
                if block not in offset_of:
                    offset_of[block] = len(chain)
                    chain.extend(block)
            first = [offset_of[tuple(b)] if b else 0 for b in prefixes]
            spec.max_chain = max(map(len, blocks))
            if pad:  # rows past the last block are never read
                spec.max_chain = bucket_tokens(len(chain))
                chain += [0] * (spec.max_chain - len(chain))
            spec.chain_index = torch.tensor(chain, dtype=torch.long)
        lengths = [len(b) for b in prefixes]
        ends = max(f + n for f, n in zip(first, lengths))
        spec.prefix_starts = torch.tensor(first + [ends], dtype=torch.int32)
        spec.prefix_lengths = torch.tensor(lengths, dtype=torch.int32)

    starts = {seg_id: gdn_start(seg_id) for seg_id in pack.segments}  # (tails re-run, anchor) per segment; refuses
    # a tail continued from another pack before any tensor is built
    level_ids: list[list[int]] = []  # each level's real segments, in layout order
    for level in sorted(by_level):
        ids = by_level[level]
        level_ids.append(ids)
        lo = len(token_ids)
        cu = [0]
        prefixes: list[list[int]] = []  # each sequence's prefix: its parent's chain of K/V rows (dummies: none)
        for seg_id in ids:
            seg = segments[seg_id]
            start_of[seg_id] = len(token_ids)
            token_ids.extend(seg.tokens)
            positions.extend(range(seg.start, seg.end))
            cu.append(len(token_ids) - lo)
            prefixes.append(parent_chain(seg_id))
            own = [ext_len + start_of[seg_id] + i for i in range(len(seg.tokens))]
            chain_rows[seg_id] = prefixes[-1] + own
        if pad:  # dummy sequences: token 0 from position 0, zero state, no prefix block
            for length in pad_level([cu[i + 1] - cu[i] for i in range(len(ids))]):
                token_ids.extend([0] * length)
                positions.extend(range(length))
                cu.append(len(token_ids) - lo)
                prefixes.append([])
        meta = prepare_varlen_metadata(cu)
        has_parents = any(segments[i].parent is not None for i in ids)
        spec = LevelSpec(lo=lo, hi=len(token_ids), cu_seqlens=meta.cu_seqlens, chunk_indices=meta.chunk_indices,
                         chunk_offsets=meta.chunk_offsets, max_seqlen=(len(token_ids) - lo) if pad else meta.max_seqlen,
                         has_parents=has_parents,
                         dense=0 < dense_attention_tokens <= cu[1] and len(ids) == 1 and not has_parents)
        if has_parents:
            route_prefixes(spec, prefixes, ext_len + lo)
        levels.append(spec)

    # Gated DeltaNet calls: a level joins the open call unless one of its anchors is computed in that call
    level_of_segment = {seg_id: index for index, ids in enumerate(level_ids) for seg_id in ids}
    groups: list[list[int]] = []
    for index, ids in enumerate(level_ids):
        anchors = {starts[seg_id][1] for seg_id in ids}
        if merge_levels and groups and not any(level_of_segment.get(a) in groups[-1] for a in anchors if a is not None):
            groups[-1].append(index)
        else:
            groups.append([index])

    call_spans: list[tuple[int, int]] = []  # the bank rows [start, end) of each call built so far

    def initial_states(parents: list[int], n_real: int) -> tuple[int | None, torch.Tensor]:
        """(source, parent_rows) of a call whose sequences start from bank rows ``parents`` (real ones first).

        When all its real sequences start from final states of one earlier call (no zero or external state among
        them: the commonest case, children of one prefix level), that call is the source and the rows are its own
        (dummies read its row 0; their outputs are never read): the forward then reads its states directly
        instead of assembling the bank. Also gives this call its bank rows (one per sequence, dummies included)."""
        nonlocal next_row
        call_spans.append((next_row, next_row + len(parents)))
        next_row += len(parents)
        real = parents[:n_real]
        for index, (lo_row, hi_row) in enumerate(call_spans[:-1]):
            if real and all(lo_row <= r < hi_row for r in real):
                local = [r - lo_row for r in real] + [0] * (len(parents) - n_real)
                return index, torch.tensor(local, dtype=torch.long)
        return None, torch.tensor(parents, dtype=torch.long)

    def gdn_call(group: list[int]) -> GdnCall:
        """Build the call of levels ``group`` and number its sequences' bank rows (real ones first, then dummies)."""
        first, last = levels[group[0]], levels[group[-1]]
        sequences = [seg_id for index in group for seg_id in level_ids[index]]
        parents = [bank_row[starts[seg_id][1]] if starts[seg_id][1] is not None else 0 for seg_id in sequences]
        gathered = len(group) > 1 or any(starts[seg_id][0] for seg_id in sequences)
        for i, seg_id in enumerate(sequences):
            bank_row[seg_id] = next_row + i
        if not gathered:  # one level over its own rows: its layout; dummies start from zeros (or the source row 0)
            parents += [0] * (first.cu_seqlens.shape[0] - 1 - len(sequences))
            source, parent_rows = initial_states(parents, len(sequences))
            return GdnCall(group[0], group[-1], first.lo, first.hi, first.cu_seqlens, first.chunk_indices,
                           first.chunk_offsets, parent_rows, any(parents), source)
        rows, cu, keep = [], [0], [0] * (last.hi - first.lo)  # level dummy rows keep gathered row 0 (never read)
        for seg_id in sequences:
            for tail in starts[seg_id][0]:
                rows.extend(range(start_of[tail], start_of[tail] + len(segments[tail].tokens)))
            own = len(segments[seg_id].tokens)
            at = start_of[seg_id] - first.lo
            keep[at: at + own] = range(len(rows), len(rows) + own)
            rows.extend(range(start_of[seg_id], start_of[seg_id] + own))
            cu.append(len(rows))
        if pad:  # dummies re-read the call's first row from zeros (or the source's row 0)
            for length in pad_level([cu[i + 1] - cu[i] for i in range(len(sequences))]):
                rows.extend([first.lo] * length)
                cu.append(len(rows))
                parents.append(0)
        source, parent_rows = initial_states(parents, len(sequences))
        meta = prepare_varlen_metadata(cu)
        return GdnCall(group[0], group[-1], first.lo, last.hi, meta.cu_seqlens, meta.chunk_indices, meta.chunk_offsets,
                       parent_rows, any(parents), source, torch.tensor(rows, dtype=torch.long),
                       torch.tensor(keep, dtype=torch.long))

    gdn_calls = [gdn_call(group) for group in groups]

    leaf_ids = [s for s in pack.segments if segments[s].leaf is not None]
    final_rows = [start_of[s] + len(segments[s].tokens) - 1 for s in leaf_ids]
    if pad:  # extra rows re-read row 0; callers keep the first len(leaf_ids) outputs
        final_rows += [0] * (bucket_sequences(len(final_rows)) - len(final_rows))
    ctx = PackContext(
        input_ids=torch.tensor(token_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        levels=levels,
        gdn_calls=gdn_calls,
        final_rows=torch.tensor(final_rows, dtype=torch.long),
        leaf_ids=leaf_ids,
        final_row_mlp=final_row_mlp,
        compile_elementwise=compile_elementwise,
        fused_elementwise=fused_elementwise,
        gdn_fp32=gdn_fp32,
        n_external=len(external),
    )
    if pad:
        ctx.graph_key = (final_row_mlp, compile_elementwise, fused_elementwise, gdn_fp32, len(final_rows), tuple(
            (level.hi - level.lo, tuple(level.cu_seqlens.shape), tuple(level.chunk_indices.shape), level.has_parents,
             level.max_chain, None if level.chain_index is None else tuple(level.chain_index.shape), level.dense)
            for level in levels), tuple(call.key() for call in gdn_calls))
    move_inputs(ctx, device)
    if external:
        first = store[external[0]]
        for layer in first.gdn:
            ctx.external_gdn[layer] = torch.stack([store[s].gdn[layer] for s in external])
            ctx.external_conv[layer] = torch.stack([store[s].conv[layer] for s in external])
        for layer in first.key:
            ctx.external_key[layer] = torch.cat([store[s].key[layer] for s in external])
            ctx.external_value[layer] = torch.cat([store[s].value[layer] for s in external])
    for seg in pack.export:
        rows = torch.tensor(chain_rows[seg], dtype=torch.long, device=device)
        ctx.exports[seg] = (bank_row[seg], rows, segments[seg].end)
    return ctx

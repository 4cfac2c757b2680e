"""A pack's layout, as the fast path builds it: which tokens run in which forward, before any kernel runs.

Segments are grouped by *level* (the number of in-pack ancestors), so each level is one contiguous slice of the
pack's rows, and each layer's attention runs once per level (its Gated DeltaNet calls may span several levels,
below)::

    [ level 0 segments | level 1 segments | level 2 segments ]

State routing: per layer, a *bank* of states holds row 0 = zeros (no parent), rows 1..E = states handed in from
earlier packs (``external``), then the final states of each Gated DeltaNet call in order (one row per sequence of
the call, dummies included). A segment's initial Gated DeltaNet / conv state is ``bank[row]`` of its *anchor*: its
parent, or for a segment that continues a tail, the nearest ancestor that hands a state on. A call whose real
sequences all start from final states of one earlier call reads those directly (``GdnCall.source``), and then no
bank is assembled. For attention, a segment that continues a prefix reads that prefix's whole chain of keys, a
block of rows of ``[external K/V ; this pack's K/V]`` shared by all its children: in place when every block of the
level is a run of consecutive rows (a parent at level 0 or in an earlier pack), else gathered once per layer
(``chain_index``); never copied per candidate.

Gated DeltaNet calls (:class:`~.layout_steps.GdnCall`): consecutive levels share one conv + GDN call per layer when
none of their sequences starts from a state another of them writes. Without tails every level reads its parent
level's states, so each level is one call over its own rows. Tails (planner segments with ``hands_state=False``)
hand no state on: a segment that continues one re-runs its rows, each sequence of the call being [its tail
ancestors' rows ; its own rows] from its anchor's states (a *gathered* layout, ``keep`` picks the call's own rows
out of the result), so the tail's level and its children's read the same anchor and run as one call. Attention
continues a tail as any other parent.

:func:`lay_out_template` lays out a pack of a new shape in one host pass of plain lists and returns its
:class:`~.layout_cache.PackTemplate`: every input of the forward (token ids, positions, each level's varlen
metadata and prefix routing, each Gated DeltaNet call's state routing and gathered layout, the final rows) is built
as a list of ints, the input layout is planned from the lists' shapes and the lists are written into the one host
byte buffer (:func:`.input_buffer.write_host_buffer`), without a tensor per input. The steps that need no tensors
(levels, anchors, received states, the GDN call groups, the gathered rows, the final rows) are
:mod:`.layout_steps`'; the others are here, on lists. ``pack_context.build_pack_context`` calls it on a
layout-cache miss.

The reference is :mod:`.naive_layout`: the same steps on tensors, one small tensor per input. The template made
here must equal ``naive_layout.record_template(*naive_layout.lay_out_pack(plan, pack, ...), plan, pack)`` byte
for byte and field by field (tests/test_layout_reference.py).
"""

from __future__ import annotations

import torch

from hf_openjev.ops.varlen import CHUNK_SIZE  # the GDN / conv chunk whose tables add_varlen_lists mirrors

from .graph_buckets import pad_level
from .input_buffer import plan_layout_of_shapes, write_host_buffer
from .layout_cache import PackTemplate
from .layout_steps import (
    GdnCall,
    Layout,
    LevelSpec,
    StateBank,
    chain_prefix_blocks,
    find_anchors,
    gather_call_rows,
    group_gdn_levels,
    group_levels,
    index_external,
    parent_chain,
    select_final_rows,
    token_runs_of,
)

INT64, INT32 = torch.int64, torch.int32
LEVEL_FIELDS = ("cu_seqlens", "chunk_indices", "chunk_offsets")
CALL_FIELDS = ("cu_seqlens", "chunk_indices", "chunk_offsets", "parent_rows", "rows", "keep")


class InputLists:
    """The forward's inputs as lists, one slot per tensor of ``PackContext.static_tensors()`` in that order:
    ``dtypes[i]``, ``values[i]`` (flat, row-major), ``shapes[i]``."""

    def __init__(self):
        self.dtypes: list[torch.dtype] = []
        self.values: list[list[int]] = []
        self.shapes: list[tuple[int, ...] | None] = []

    def add(self, dtype: torch.dtype, values: list[int], shape: tuple[int, ...] | None = None) -> int:
        """Append a slot (``shape`` None: 1-D, its length read when the layout is planned); return its index."""
        self.dtypes.append(dtype)
        self.values.append(values)
        self.shapes.append(shape)
        return len(self.values) - 1

    def shape(self, slot: int) -> tuple[int, ...]:
        shape = self.shapes[slot]
        return (len(self.values[slot]),) if shape is None else shape


def add_varlen_lists(inputs: InputLists, cu: list[int]) -> tuple[int, int, int]:
    """``ops.varlen.prepare_varlen_metadata(cu)``'s tensors as slots: ``(cu_seqlens [n+1] int32, chunk_indices
    [C, 2] int32, chunk_offsets [n+1] int64)``."""
    pairs, offsets = [], [0]
    for i in range(len(cu) - 1):
        count = (cu[i + 1] - cu[i] + CHUNK_SIZE - 1) // CHUNK_SIZE
        for j in range(count):
            pairs += (i, j)
        offsets.append(offsets[-1] + count)
    return (inputs.add(INT32, cu), inputs.add(INT32, pairs, (len(pairs) // 2, 2)), inputs.add(INT64, offsets))


def add_route_lists(inputs: InputLists, prefixes: list[list[int]], rows_before: int, *,
                    pad: bool) -> tuple[dict[str, int], int]:
    """``naive_layout.route_prefixes`` on lists: ``({field: slot}, max_chain)`` (no ``chain_index`` slot when the
    blocks are read in place)."""
    first, lengths, max_chain, chain = chain_prefix_blocks(prefixes, rows_before, pad=pad)
    ends = max(f + n for f, n in zip(first, lengths))
    slots = {"prefix_starts": inputs.add(INT32, first + [ends]), "prefix_lengths": inputs.add(INT32, lengths)}
    if chain is not None:
        slots["chain_index"] = inputs.add(INT64, chain)
    return slots, max_chain


def lay_out_level_lists(plan, ids: list[int], layout: Layout, external, inputs: InputLists, chained: set[int], *,
                        pad: bool, dense_attention_tokens: int, buckets=None) -> tuple[LevelSpec, dict[str, int]]:
    """``naive_layout.lay_out_level`` on lists: the level's rows appended to ``layout`` (``chain_rows`` only of the
    ``chained`` segments: parents and exports); ``(its LevelSpec with no tensors, {tensor field: slot})``."""
    segments = plan.segments
    lo = len(layout.token_ids)
    cu = [0]
    prefixes: list[list[int]] = []
    for seg_id in ids:
        seg = segments[seg_id]
        layout.start_of[seg_id] = start = len(layout.token_ids)
        layout.token_ids.extend(seg.tokens)
        layout.positions.extend(range(seg.start, seg.end))
        cu.append(len(layout.token_ids) - lo)
        prefixes.append(parent_chain(plan, seg_id, layout, external))
        if seg_id in chained:
            layout.chain_rows[seg_id] = prefixes[-1] + list(range(external.rows + start,
                                                                  external.rows + len(layout.token_ids)))
    if pad:
        for length in pad_level([cu[i + 1] - cu[i] for i in range(len(ids))], buckets, rows_before=lo):
            layout.token_ids.extend([0] * length)
            layout.positions.extend(range(length))
            cu.append(len(layout.token_ids) - lo)
            prefixes.append([])
    fields = dict(zip(LEVEL_FIELDS, add_varlen_lists(inputs, cu)))
    hi = len(layout.token_ids)
    has_parents = any(segments[i].parent is not None for i in ids)
    max_seqlen = (hi - lo) if pad else max(cu[i + 1] - cu[i] for i in range(len(cu) - 1))
    spec = LevelSpec(lo, hi, None, None, None, max_seqlen, has_parents,
                     dense=0 < dense_attention_tokens <= cu[1] and len(ids) == 1 and not has_parents)
    if has_parents:
        route, spec.max_chain = add_route_lists(inputs, prefixes, external.rows + lo, pad=pad)
        fields.update(route)
    return spec, fields


def build_gdn_call_lists(plan, group: list[int], layout: Layout, level_fields: list[dict[str, int]], anchors: dict,
                         bank: StateBank, inputs: InputLists, *, pad: bool) -> tuple[GdnCall, dict[str, int]]:
    """``naive_layout.build_gdn_call`` on lists: ``(the GdnCall with no tensors, {tensor field: slot})``; a one-level
    call without tails takes its level's metadata slots."""
    first, last = layout.levels[group[0]], layout.levels[group[-1]]
    sequences = [seg_id for index in group for seg_id in layout.level_ids[index]]
    parents = [bank.anchor_row(anchors[seg_id][1]) for seg_id in sequences]
    if len(group) == 1 and not any(anchors[seg_id][0] for seg_id in sequences):
        shared = {name: level_fields[group[0]][name] for name in LEVEL_FIELDS}
        parents += [0] * (inputs.shape(shared["cu_seqlens"])[0] - 1 - len(sequences))
        source, parent_rows = bank.add_call_rows(sequences, parents)
        call = GdnCall(group[0], group[-1], first.lo, first.hi, None, None, None, None, any(parents), source)
        return call, {**shared, "parent_rows": inputs.add(INT64, parent_rows)}
    rows, cu, keep = gather_call_rows(plan, sequences, anchors, layout, first.lo, last.hi)
    if pad:
        for length in pad_level([cu[i + 1] - cu[i] for i in range(len(sequences))]):
            rows.extend([first.lo] * length)
            cu.append(len(rows))
            parents.append(0)
    source, parent_rows = bank.add_call_rows(sequences, parents)
    fields = {"parent_rows": inputs.add(INT64, parent_rows)}  # the slots in GdnCall.tensors() order
    fields.update(zip(LEVEL_FIELDS, add_varlen_lists(inputs, cu)))
    fields.update(rows=inputs.add(INT64, rows), keep=inputs.add(INT64, keep))
    call = GdnCall(group[0], group[-1], first.lo, last.hi, None, None, None, None, any(parents), source, None, None)
    return call, {name: fields[name] for name in CALL_FIELDS}


def key_tail_of(inputs: InputLists, levels, calls) -> tuple:
    """``naive_layout.key_graph`` after the options' ``forward_key``, from the slots' shapes (``levels`` / ``calls``:
    ``(spec, {field: slot})``; slot 2 is the final rows)."""
    level_keys = tuple(
        (spec.hi - spec.lo, inputs.shape(f["cu_seqlens"]), inputs.shape(f["chunk_indices"]), spec.has_parents,
         spec.max_chain, inputs.shape(f["chain_index"]) if "chain_index" in f else None, spec.dense)
        for spec, f in levels)
    call_keys = tuple(
        (call.first, call.last, call.has_parents, call.source, inputs.shape(f["cu_seqlens"]),
         inputs.shape(f["chunk_indices"]), inputs.shape(f["rows"]) if "rows" in f else None)
        for call, f in calls)
    return (inputs.shape(2)[0], level_keys, call_keys)


def lay_out_template(plan, pack, store, *, pad: bool, merge_levels: bool,
                     dense_attention_tokens: int, buckets=None) -> PackTemplate:
    """The :class:`PackTemplate` of ``pack`` (a pack of ``plan``; ``store``: earlier packs' exports), from lists:
    the one its reference, ``naive_layout.record_template``, makes (see the module docstring)."""
    anchors = find_anchors(plan, pack)  # refuses a tail continued from another pack before any work
    external = index_external(pack, store)
    layout = Layout(group_levels(plan, pack))
    inputs = InputLists()
    for values in (layout.token_ids, layout.positions, None):  # slots 0-2 (final rows: filled below)
        inputs.add(INT64, values)
    chained = {plan.segments[seg_id].parent for seg_id in pack.segments}.union(pack.export)
    levels = []
    for index, ids in enumerate(layout.level_ids):
        last = index == len(layout.level_ids) - 1
        levels.append(lay_out_level_lists(plan, ids, layout, external, inputs, chained, pad=pad,
                                          dense_attention_tokens=dense_attention_tokens,
                                          buckets=buckets if last else None))
        layout.levels.append(levels[-1][0])
    bank = StateBank(external.ids)
    level_fields = [fields for _, fields in levels]
    calls = [build_gdn_call_lists(plan, group, layout, level_fields, anchors, bank, inputs, pad=pad)
             for group in group_gdn_levels(layout.level_ids, anchors, merge=merge_levels)]
    leaf_ids, inputs.values[2] = select_final_rows(plan, pack, layout, pad=pad)
    buffer = plan_layout_of_shapes([(dtype, inputs.shape(i)) for i, dtype in enumerate(inputs.dtypes)])
    position = {seg_id: i for i, seg_id in enumerate(pack.segments)}
    return PackTemplate(
        host=write_host_buffer(inputs.values, buffer), layout=buffer, token_runs=token_runs_of(plan, pack, layout),
        context_fields=(("input_ids", 0), ("positions", 1), ("final_rows", 2)),
        levels=tuple((spec, tuple(fields.items())) for spec, fields in levels),
        gdn_calls=tuple((call, tuple(fields.items())) for call, fields in calls),
        leaf_positions=tuple(position[s] for s in leaf_ids),
        exports=tuple((position[s], bank.row_of[s], tuple(layout.chain_rows[s]), plan.segments[s].end)
                      for s in pack.export),
        key_tail=key_tail_of(inputs, levels, calls) if pad else None, n_external=len(external.ids))

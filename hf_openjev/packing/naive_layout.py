"""The reference of a pack's layout: the steps of :mod:`.layout` on tensors, one small tensor per input.

Nothing in the package runs it: the fast path lays a new shape out with :func:`.layout.lay_out_template` (plain
lists written straight into the input buffer) and caches the result (:mod:`.layout_cache`). This module is the
plain, step-by-step statement of the same layout (the layout itself: :mod:`.layout`'s docstring), kept for tests
and recipes, the way fla keeps ``naive.py`` beside ``chunk.py``. What the fast one must equal:

- ``layout.lay_out_template(plan, pack, store, ...)`` equals ``record_template(*lay_out_pack(plan, pack, store,
  ...), plan, pack)``: the same input layout, the same host bytes, the same fields;
- ``pack_context.build_pack_context(...)`` (a new shape or a layout-cache hit) equals
  :func:`build_naive_pack_context` with the same arguments, tensor by tensor (values, dtypes, shapes), with the
  same graph key, leaf ids, exports and received states.

tests/test_layout_reference.py compares them on random plans. The steps run in order: levels (``group_levels``),
anchors (``find_anchors``), received states (``index_external``), the layout and each level's attention metadata
(:func:`lay_out_levels` -> :func:`lay_out_level` -> :func:`route_prefixes`), the Gated DeltaNet calls
(``group_gdn_levels``, ``StateBank``, ``gather_call_rows``, :func:`build_gdn_call`), then the inputs
(``select_final_rows``, :func:`key_graph`: :func:`lay_out_pack` up to here, then ``pack_context.move_inputs``,
``pack_context.attach_external_states``, :func:`attach_exports`); the steps without tensors are
:mod:`.layout_steps`', shared with :mod:`.layout`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hf_openjev.ops.varlen import prepare_varlen_metadata

from .graph_buckets import pad_level
from .input_buffer import fill_host_buffer, plan_input_layout
from .layout_cache import PackTemplate
from .layout_steps import (
    ExternalBlocks,
    GdnCall,
    Layout,
    LevelSpec,
    SegmentState,
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
from .pack_context import PackContext, PackOptions, attach_external_states, check_padding, move_inputs


class PrefixRoute(NamedTuple):
    """How the ``n`` sequences of a level (dummies included) read their prefix keys for attention."""

    prefix_starts: torch.Tensor  # [n+1] int32: each sequence's first row in the rows read; entry n: the end
    prefix_lengths: torch.Tensor  # [n] int32: rows read (0: no prefix)
    chain_index: torch.Tensor | None  # [P] int64 rows of [external ; pack] K/V gathered once, or None: read in place
    max_chain: int  # a bound on prefix_lengths (FA2's max_seqlen_k)


def route_prefixes(prefixes: list[list[int]], rows_before: int, *, pad: bool) -> PrefixRoute:
    """Each sequence's prefix block (``prefixes[i]``: rows of ``[external ; pack]`` K/V, [] for none) for attention.

    When every block is a run of consecutive rows (children of a level-0 parent or of an external prefix: all of a
    two-level plan), the blocks are read in place (``chain_index`` None, no gather); otherwise the distinct blocks
    are gathered once (``chain_index``) and shared by their sequences. ``rows_before``: the rows of K/V before the
    level (parents lie there), the bound ``max_chain`` takes in place when ``pad`` (fixed by the padded sizes of the
    earlier levels); when ``pad``, a gathered chain is padded to its token bucket."""
    first, lengths, max_chain, chain = chain_prefix_blocks(prefixes, rows_before, pad=pad)
    chain_index = None if chain is None else torch.tensor(chain, dtype=torch.long)
    ends = max(f + n for f, n in zip(first, lengths))
    return PrefixRoute(torch.tensor(first + [ends], dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32),
                       chain_index, max_chain)


def lay_out_level(plan, ids: list[int], layout: Layout, external: ExternalBlocks, *, pad: bool,
                  dense_attention_tokens: int, buckets=None) -> LevelSpec:
    """Append one level's segments ``ids`` to ``layout`` (tokens, positions continuing each segment's chain, its
    rows), then, when ``pad``, dummy sequences up to the level's shape bucket (token 0 from position 0, no
    prefix; ``buckets``: the pack's BucketPolicy when this is its last level, :func:`.graph_buckets.pad_level`);
    return the level's :class:`LevelSpec`: its rows ``[lo, hi)``, varlen metadata over its sequences
    and, when some sequence continues a prefix, how each reads its prefix keys (:func:`route_prefixes`)."""
    segments = plan.segments
    lo = len(layout.token_ids)
    cu = [0]
    prefixes: list[list[int]] = []  # each sequence's prefix: its parent's chain of K/V rows (dummies: none)
    for seg_id in ids:
        seg = segments[seg_id]
        layout.start_of[seg_id] = len(layout.token_ids)
        layout.token_ids.extend(seg.tokens)
        layout.positions.extend(range(seg.start, seg.end))
        cu.append(len(layout.token_ids) - lo)
        prefixes.append(parent_chain(plan, seg_id, layout, external))
        own = list(range(external.rows + layout.start_of[seg_id], external.rows + len(layout.token_ids)))
        layout.chain_rows[seg_id] = prefixes[-1] + own
    if pad:
        for length in pad_level([cu[i + 1] - cu[i] for i in range(len(ids))], buckets, rows_before=lo):
            layout.token_ids.extend([0] * length)
            layout.positions.extend(range(length))
            cu.append(len(layout.token_ids) - lo)
            prefixes.append([])
    meta = prepare_varlen_metadata(cu)
    hi = len(layout.token_ids)
    has_parents = any(segments[i].parent is not None for i in ids)
    spec = LevelSpec(lo=lo, hi=hi, cu_seqlens=meta.cu_seqlens, chunk_indices=meta.chunk_indices,
                     chunk_offsets=meta.chunk_offsets, max_seqlen=(hi - lo) if pad else meta.max_seqlen,
                     has_parents=has_parents,
                     dense=0 < dense_attention_tokens <= cu[1] and len(ids) == 1 and not has_parents)
    if has_parents:
        route = route_prefixes(prefixes, external.rows + lo, pad=pad)
        spec.prefix_starts, spec.prefix_lengths, spec.chain_index, spec.max_chain = route
    return spec


def lay_out_levels(plan, level_ids: list[list[int]], external: ExternalBlocks, *, pad: bool,
                   dense_attention_tokens: int, buckets=None) -> Layout:
    """The pack's :class:`Layout`: every level of ``level_ids`` (``group_levels``) in order
    (:func:`lay_out_level`; ``buckets`` pads the last one)."""
    layout = Layout(level_ids)
    for index, ids in enumerate(level_ids):
        layout.levels.append(lay_out_level(plan, ids, layout, external, pad=pad,
                                           dense_attention_tokens=dense_attention_tokens,
                                           buckets=buckets if index == len(level_ids) - 1 else None))
    return layout


def build_gdn_call(plan, group: list[int], layout: Layout, anchors: dict, bank: StateBank, *,
                   pad: bool) -> GdnCall:
    """The conv + Gated DeltaNet call over the levels ``group``; numbers its sequences' bank rows (``bank``).

    One level whose sequences re-run no tail: over its own rows, with its level's metadata (dummies start from
    zeros, or the source's row 0). Otherwise a gathered layout (``gather_call_rows``), padded when ``pad``
    with dummies that re-read the call's first row."""
    first, last = layout.levels[group[0]], layout.levels[group[-1]]
    sequences = [seg_id for index in group for seg_id in layout.level_ids[index]]
    parents = [bank.anchor_row(anchors[seg_id][1]) for seg_id in sequences]
    if len(group) == 1 and not any(anchors[seg_id][0] for seg_id in sequences):
        parents += [0] * (first.cu_seqlens.shape[0] - 1 - len(sequences))
        source, parent_rows = bank.add_call_rows(sequences, parents)
        return GdnCall(group[0], group[-1], first.lo, first.hi, first.cu_seqlens, first.chunk_indices,
                       first.chunk_offsets, torch.tensor(parent_rows, dtype=torch.long), any(parents), source)
    rows, cu, keep = gather_call_rows(plan, sequences, anchors, layout, first.lo, last.hi)
    if pad:
        for length in pad_level([cu[i + 1] - cu[i] for i in range(len(sequences))]):
            rows.extend([first.lo] * length)
            cu.append(len(rows))
            parents.append(0)
    source, parent_rows = bank.add_call_rows(sequences, parents)
    meta = prepare_varlen_metadata(cu)
    return GdnCall(group[0], group[-1], first.lo, last.hi, meta.cu_seqlens, meta.chunk_indices, meta.chunk_offsets,
                   torch.tensor(parent_rows, dtype=torch.long), any(parents), source,
                   torch.tensor(rows, dtype=torch.long), torch.tensor(keep, dtype=torch.long))


def key_graph(ctx: PackContext) -> tuple:
    """The graph key of a padded context: contexts with equal keys have equal tensor shapes and run the same code
    (the options' ``forward_key``, each level's shapes and attention kind, each GDN call's shapes)."""
    return (*ctx.options.forward_key(), ctx.final_rows.shape[0], tuple(
        (level.hi - level.lo, tuple(level.cu_seqlens.shape), tuple(level.chunk_indices.shape), level.has_parents,
         level.max_chain, None if level.chain_index is None else tuple(level.chain_index.shape), level.dense)
        for level in ctx.levels), tuple(call.key() for call in ctx.gdn_calls))


def attach_exports(ctx: PackContext, plan, pack, layout: Layout, bank: StateBank, device) -> None:
    """Where the forward finds each exported segment's states: its bank row, its chain's K/V rows ``[length]``
    (on ``device``) and the chain's length."""
    for seg in pack.export:
        rows = torch.tensor(layout.chain_rows[seg], dtype=torch.long, device=device)
        ctx.exports[seg] = (bank.row_of[seg], rows, plan.segments[seg].end)


def lay_out_pack(plan, pack, store: dict[int, SegmentState], options: PackOptions, *, pad: bool,
                 merge_levels: bool, buckets=None) -> tuple[PackContext, Layout, StateBank]:
    """The steps of :func:`build_naive_pack_context` up to the inputs, all on the host: ``(context with host tensors
    and its graph key when pad, its Layout, its StateBank)``; received states and exports not attached."""
    anchors = find_anchors(plan, pack)  # refuses a tail continued from another pack before any tensor is built
    external = index_external(pack, store)
    layout = lay_out_levels(plan, group_levels(plan, pack), external, pad=pad,
                            dense_attention_tokens=options.dense_attention_tokens, buckets=buckets)
    bank = StateBank(external.ids)
    gdn_calls = [build_gdn_call(plan, group, layout, anchors, bank, pad=pad)
                 for group in group_gdn_levels(layout.level_ids, anchors, merge=merge_levels)]
    leaf_ids, final_rows = select_final_rows(plan, pack, layout, pad=pad)
    ctx = PackContext(input_ids=torch.tensor(layout.token_ids, dtype=torch.long),
                      positions=torch.tensor(layout.positions, dtype=torch.long), levels=layout.levels,
                      gdn_calls=gdn_calls, final_rows=torch.tensor(final_rows, dtype=torch.long), leaf_ids=leaf_ids,
                      options=options, n_external=len(external.ids))
    if pad:
        ctx.graph_key = key_graph(ctx)
    return ctx, layout, bank


def _tensor_fields(holder, slot_of: dict[int, int]) -> tuple[tuple[str, int], ...]:
    return tuple((name, slot_of[id(value)]) for name, value in vars(holder).items()
                 if isinstance(value, torch.Tensor))


def record_template(ctx: PackContext, layout: Layout, bank: StateBank, plan, pack) -> PackTemplate:
    """The :class:`~.layout_cache.PackTemplate` of a context laid out on the host (:func:`lay_out_pack`: tensors
    not yet moved; ``layout``: its ``Layout``, ``bank``: its ``StateBank``): what ``layout.lay_out_template`` must
    equal."""
    tensors = ctx.static_tensors()
    if tensors[0] is not ctx.input_ids:
        raise RuntimeError("static_tensors() must start with input_ids; this is a bug")
    inputs = plan_input_layout(tensors)
    slot_of = {id(tensor): i for i, tensor in enumerate(tensors)}
    position = {seg_id: i for i, seg_id in enumerate(pack.segments)}
    forward = len(ctx.options.forward_key())
    return PackTemplate(
        host=fill_host_buffer(tensors, inputs, pin=False), layout=inputs, token_runs=token_runs_of(plan, pack, layout),
        context_fields=_tensor_fields(ctx, slot_of),
        levels=tuple((level, _tensor_fields(level, slot_of)) for level in ctx.levels),
        gdn_calls=tuple((call, _tensor_fields(call, slot_of)) for call in ctx.gdn_calls),
        leaf_positions=tuple(position[s] for s in ctx.leaf_ids),
        exports=tuple((position[s], bank.row_of[s], tuple(layout.chain_rows[s]), plan.segments[s].end)
                      for s in pack.export),
        key_tail=None if ctx.graph_key is None else ctx.graph_key[forward:], n_external=ctx.n_external)


def build_naive_pack_context(plan, pack, store: dict[int, SegmentState], device,
                             options: PackOptions, *, pad: bool = False,
                             merge_levels: bool = True, buckets=None) -> PackContext:
    """``pack_context.build_pack_context`` (same arguments, same result) by the tensor steps, without the layout
    cache: every step runs, every input is its own tensor until :func:`~.pack_context.move_inputs`."""
    check_padding(pack, pad)
    ctx, layout, bank = lay_out_pack(plan, pack, store, options, pad=pad, merge_levels=merge_levels,
                                     buckets=buckets)
    move_inputs(ctx, device)
    attach_external_states(ctx, store, index_external(pack, store))
    attach_exports(ctx, plan, pack, layout, bank, device)
    return ctx

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

``build_pack_context_uncached`` runs named steps, each a function below: levels (``group_levels``), anchors
(``find_anchors``), received states (``index_external``), the layout and each level's attention metadata
(``lay_out_levels`` -> ``lay_out_level`` -> ``route_prefixes``), the Gated DeltaNet calls (``group_gdn_levels``,
``StateBank``, ``gather_call_rows``, ``build_gdn_call``), then the inputs (``select_final_rows``, ``key_graph``:
``lay_out_pack`` up to here, then ``move_inputs``, ``attach_external_states``, ``attach_exports``).
``build_pack_context`` (what the fast path calls) lays out a pack of a new *shape* once, the same steps on plain
lists written straight into its input buffer (:mod:`.host_layout`), and keeps the result (:mod:`.layout_cache`): a
later pack of that shape only writes its token ids into a copy of the shape's input buffer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hf_openjev.fast_options import DENSE_ATTENTION_TOKENS, FastPathOptions
from hf_openjev.ops.varlen import prepare_varlen_metadata

from .layout_steps import (ExternalBlocks, chain_prefix_blocks, GdnCall, Layout, LevelSpec, SegmentState, StateBank, find_anchors,
                           gather_call_rows, group_gdn_levels, group_levels, index_external, parent_chain,
                           select_final_rows)
from .graph_buckets import pad_level
from .host_layout import lay_out_template
from .input_buffer import fill_host_buffer, plan_input_layout, view_inputs
from .layout_cache import TEMPLATES, fill_template, shape_key

__all__ = ["DENSE_ATTENTION_TOKENS", "GdnCall", "LevelSpec", "PackContext", "SegmentState", "build_pack_context",
           "build_pack_context_uncached", "lay_out_pack", "move_inputs"]


@dataclass
class PackContext:
    """Device-side description of one packed forward (see the module docstring)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    levels: list[LevelSpec]
    gdn_calls: list[GdnCall]
    final_rows: torch.Tensor  # [N] int64: last token of each scored candidate, in ``leaf_ids`` order
    leaf_ids: list[int]
    # what the forward does (final_row_mlp, compile_elementwise, fused_elementwise, gdn_fp32: FORWARD_FIELDS)
    options: FastPathOptions = field(default_factory=FastPathOptions)
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
    # (the one [nbytes] uint8 device buffer all of ``inputs`` lie in,) once moved: a tuple, not a tensor field (every
    # tensor field is one of ``static_tensors()``)
    input_buffer: tuple[torch.Tensor, ...] = ()

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


def move_inputs(ctx: PackContext, device) -> None:
    """Move the context's inputs (``static_tensors()``, built on the host) to ``device`` in ONE pinned, asynchronous
    copy of one byte buffer (:mod:`.input_buffer`): each input becomes a view of it, ``ctx.inputs`` holds its flat
    region per dtype and ``ctx.input_buffer`` the whole buffer, so that a graph replay also copies one buffer.
    Contexts with equal graph keys get equal buffer layouts (equal tensor shapes, in a fixed order)."""
    device = torch.device(device)
    tensors = ctx.static_tensors()
    layout = plan_input_layout(tensors)
    host = fill_host_buffer(tensors, layout, pin=device.type == "cuda")  # pinned: an asynchronous copy
    flat = host.to(device, non_blocking=True)
    ctx.inputs, views = view_inputs(flat, layout)
    ctx.input_buffer = (flat,)
    by_id = {id(tensor): view for tensor, view in zip(tensors, views)}
    for holder in (ctx, *ctx.levels, *ctx.gdn_calls):  # shared tensors (a call's and its level's) stay shared
        for f in dataclasses.fields(holder):
            value = getattr(holder, f.name)
            if isinstance(value, torch.Tensor):
                if id(value) not in by_id:  # it would stay on the host, and a graph replay would not copy it in
                    raise RuntimeError(f"{type(holder).__name__}.{f.name} is missing from static_tensors()")
                setattr(holder, f.name, by_id[id(value)])


# --- the steps of build_pack_context, in order ----------------------------------------------------------------------


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
    """The pack's :class:`Layout`: every level of ``level_ids`` (:func:`group_levels`) in order
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
    zeros, or the source's row 0). Otherwise a gathered layout (:func:`gather_call_rows`), padded when ``pad``
    with dummies that re-read the call's first row."""
    first, last = layout.levels[group[0]], layout.levels[group[-1]]
    sequences = [seg_id for index in group for seg_id in layout.level_ids[index]]
    parents = [bank.anchor_row(anchors[seg_id][1]) for seg_id in sequences]
    if len(group) == 1 and not any(anchors[seg_id][0] for seg_id in sequences):
        parents += [0] * (first.cu_seqlens.shape[0] - 1 - len(sequences))
        source, parent_rows = bank.add_call(sequences, parents)
        return GdnCall(group[0], group[-1], first.lo, first.hi, first.cu_seqlens, first.chunk_indices,
                       first.chunk_offsets, parent_rows, any(parents), source)
    rows, cu, keep = gather_call_rows(plan, sequences, anchors, layout, first.lo, last.hi)
    if pad:
        for length in pad_level([cu[i + 1] - cu[i] for i in range(len(sequences))]):
            rows.extend([first.lo] * length)
            cu.append(len(rows))
            parents.append(0)
    source, parent_rows = bank.add_call(sequences, parents)
    meta = prepare_varlen_metadata(cu)
    return GdnCall(group[0], group[-1], first.lo, last.hi, meta.cu_seqlens, meta.chunk_indices, meta.chunk_offsets,
                   parent_rows, any(parents), source, torch.tensor(rows, dtype=torch.long),
                   torch.tensor(keep, dtype=torch.long))


def key_graph(ctx: PackContext) -> tuple:
    """The graph key of a padded context: contexts with equal keys have equal tensor shapes and run the same code
    (the options' ``forward_key``, each level's shapes and attention kind, each GDN call's shapes)."""
    return (*ctx.options.forward_key(), ctx.final_rows.shape[0], tuple(
        (level.hi - level.lo, tuple(level.cu_seqlens.shape), tuple(level.chunk_indices.shape), level.has_parents,
         level.max_chain, None if level.chain_index is None else tuple(level.chain_index.shape), level.dense)
        for level in ctx.levels), tuple(call.key() for call in ctx.gdn_calls))


def attach_external_states(ctx: PackContext, store: dict[int, SegmentState], external: ExternalBlocks) -> None:
    """Stack the received states per layer: GDN ``[E, Hv, Dk, Dv]``, conv ``[E, C, K]``, K/V ``[Pext, Hkv, D]``."""
    if not external.ids:
        return
    first = store[external.ids[0]]
    for layer in first.gdn:
        ctx.external_gdn[layer] = torch.stack([store[s].gdn[layer] for s in external.ids])
        ctx.external_conv[layer] = torch.stack([store[s].conv[layer] for s in external.ids])
    for layer in first.key:
        ctx.external_key[layer] = torch.cat([store[s].key[layer] for s in external.ids])
        ctx.external_value[layer] = torch.cat([store[s].value[layer] for s in external.ids])


def attach_exports(ctx: PackContext, plan, pack, layout: Layout, bank: StateBank, device) -> None:
    """Where the forward finds each exported segment's states: its bank row, its chain's K/V rows ``[length]``
    (on ``device``) and the chain's length."""
    for seg in pack.export:
        rows = torch.tensor(layout.chain_rows[seg], dtype=torch.long, device=device)
        ctx.exports[seg] = (bank.row_of[seg], rows, plan.segments[seg].end)


def lay_out_pack(plan, pack, store: dict[int, SegmentState], options: FastPathOptions, *, pad: bool,
                 merge_levels: bool, buckets=None) -> tuple[PackContext, Layout, StateBank]:
    """The steps of :func:`build_pack_context` up to the inputs, all on the host: ``(context with host tensors and
    its graph key when pad, its Layout, its StateBank)``; received states and exports not attached."""
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


def _check_padding(pack, pad: bool) -> None:
    if pad and (pack.external or pack.export):
        raise ValueError("only packs without external states or exports can be padded for graph replay")


def build_pack_context_uncached(plan, pack, store: dict[int, SegmentState], device,
                                options: FastPathOptions | None = None, *, pad: bool = False,
                                merge_levels: bool = True, buckets=None) -> PackContext:
    """:func:`build_pack_context` without the shape cache: every step runs (the reference the cache is tested
    against)."""
    options = options if options is not None else FastPathOptions()
    _check_padding(pack, pad)
    ctx, layout, bank = lay_out_pack(plan, pack, store, options, pad=pad, merge_levels=merge_levels,
                                     buckets=buckets)
    move_inputs(ctx, device)
    attach_external_states(ctx, store, index_external(pack, store))
    attach_exports(ctx, plan, pack, layout, bank, device)
    return ctx


def build_pack_context(plan, pack, store: dict[int, SegmentState], device, options: FastPathOptions | None = None,
                       *, pad: bool = False, merge_levels: bool = True, buckets=None) -> PackContext:
    """Lay out ``pack`` (a planner Pack of ``plan``) and route states; ``store`` holds earlier packs' exports.

    ``options`` (default: the defaults) go to the context (the forward reads them) and decide ``dense`` levels: a
    level of one sequence at least ``options.dense_attention_tokens`` long, with no prefix, runs one dense causal
    attention call (``LevelSpec.dense``; 0: never).

    ``pad=True`` (packs without external states or exports only) pads every level with dummy sequences to its
    shape bucket (:mod:`.graph_buckets`) and sets ``graph_key``: contexts with equal keys have equal tensor
    shapes, so one captured CUDA graph replays them all. Dummy tokens start from zero states (or, in a call with a
    ``source``, from its first final state), read no prefix and are never scored or read by another sequence, so
    the real sequences' results do not change. ``buckets`` (a :class:`~.bucket_policy.BucketPolicy`, the
    model's: ``bucket_policy_for(config)``) pads the last level so that the pack's rows are its cheapest measured
    row count; None keeps the fixed token steps.

    ``merge_levels=False`` gives every level its own Gated DeltaNet call (one sequence's arithmetic does not depend
    on the other sequences of its call, so the rows are the same; tests compare the two).

    The layout is cached per pack shape (:mod:`.layout_cache`): a pack of a shape seen before only writes its token
    ids into a copy of that shape's input buffer; the tensors are those :func:`build_pack_context_uncached` makes.
    """
    options = options if options is not None else FastPathOptions()
    _check_padding(pack, pad)
    key = shape_key(plan, pack, store, pad=pad, merge_levels=merge_levels,
                    dense_attention_tokens=options.dense_attention_tokens, buckets=buckets)
    template = TEMPLATES.get(key)
    if template is None:  # a new shape: laid out in one pass of lists
        template = lay_out_template(plan, pack, store, pad=pad, merge_levels=merge_levels,
                                    dense_attention_tokens=options.dense_attention_tokens, buckets=buckets)
        TEMPLATES.put(key, template)
    ctx = fill_template(template, plan, pack, device, options, PackContext)
    if pack.external:
        attach_external_states(ctx, store, index_external(pack, store))
    return ctx

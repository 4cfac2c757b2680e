"""What one packed forward needs on the device (:class:`PackContext`) and its builder (:func:`build_pack_context`).

A context holds the pack's inputs (token ids, positions, each level's varlen metadata and prefix routing, each
Gated DeltaNet call's state routing, the final rows: ``static_tensors()``), all views of ONE device byte buffer
(:mod:`.input_buffer`), the states it receives from earlier packs and where the forward finds the states it hands
on. All host work happens in the builder, before the forward, so the forward itself has no host synchronisation.
What the tensors mean (levels, the state bank, anchors, tails, gathered calls): :mod:`.layout`.

``build_pack_context`` (what the fast path calls) lays out a pack of a new *shape* once, in one pass of plain
lists written straight into its input buffer (:func:`.layout.lay_out_template`), and keeps the result
(:mod:`.layout_cache`): a later pack of that shape only writes its token ids into a copy of the shape's input
buffer. Its reference, the same context by the step-by-step tensor layout, is
``naive_layout.build_naive_pack_context`` (tests only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .input_buffer import fill_host_buffer, plan_input_layout, view_inputs
from .layout import lay_out_template
from .layout_cache import TEMPLATES, fill_template, shape_key
from .layout_steps import ExternalBlocks, GdnCall, LevelSpec, SegmentState, index_external


class PackOptions(Protocol):
    """What packing reads of the fast path's options. The caller passes its
    :class:`~hf_openjev.fast_options.FastPathOptions` (packing sits below it and never imports it): the layout reads
    ``dense_attention_tokens``, the graph key starts with ``forward_key()``, and the forward reads the rest through
    ``PackContext.options``."""

    dense_attention_tokens: int

    def forward_key(self) -> tuple: ...


@dataclass
class PackContext:
    """Device-side description of one packed forward (see the module docstring)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    levels: list[LevelSpec]
    gdn_calls: list[GdnCall]
    final_rows: torch.Tensor  # [N] int64: last token of each scored candidate, in ``leaf_ids`` order
    leaf_ids: list[int]
    # what the forward does (FORWARD_FIELDS: final_row_mlp, compile_elementwise, fused_elementwise, gdn_fp32,
    # packed_attention, residual_fp32)
    options: PackOptions
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


def check_padding(pack, pad: bool) -> None:
    """Refuse to pad a pack that receives or hands on states (before any work)."""
    if pad and (pack.external or pack.export):
        raise ValueError("only packs without external states or exports can be padded for graph replay")


def build_pack_context(plan, pack, store: dict[int, SegmentState], device, options: PackOptions,
                       *, pad: bool = False, merge_levels: bool = True, buckets=None) -> PackContext:
    """Lay out ``pack`` (a planner Pack of ``plan``) and route states; ``store`` holds earlier packs' exports.

    ``options`` (the fast path's :class:`~hf_openjev.fast_options.FastPathOptions`) go to the context (the forward
    reads them) and decide ``dense`` levels: a level of one sequence at least ``options.dense_attention_tokens``
    long, with no prefix, runs one dense causal attention call (``LevelSpec.dense``; 0: never).

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
    ids into a copy of that shape's input buffer; the tensors are those ``naive_layout.build_naive_pack_context``
    makes.
    """
    check_padding(pack, pad)
    layout_options = dict(pad=pad, merge_levels=merge_levels, dense_attention_tokens=options.dense_attention_tokens,
                          buckets=buckets)
    key = shape_key(plan, pack, store, **layout_options)
    template = TEMPLATES.get(key)
    if template is None:  # a new shape: laid out in one pass of lists
        template = lay_out_template(plan, pack, store, **layout_options)
        TEMPLATES.put(key, template)
    ctx = fill_template(template, plan, pack, device, options, PackContext)
    if pack.external:
        attach_external_states(ctx, store, index_external(pack, store))
    return ctx

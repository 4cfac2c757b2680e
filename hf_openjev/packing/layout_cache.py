"""The layout of a pack cached per *shape*: what depends only on the lengths and the tree, not on the token ids.

A pack's tensors (positions, varlen metadata, chunk tables, state routing, final rows, the graph key) depend only
on its shape: each segment's length, start, place in the tree (its parent as a position in the pack or in
``pack.external``), whether it is scored or hands a state on; the received states' lengths; the exports; and the
layout options (``pad``, the bucket policy, ``merge_levels``, ``dense_attention_tokens``). :func:`shape_key` is
that tuple. The first pack of a shape is laid out on lists (:func:`.layout.lay_out_template`) into a
:class:`PackTemplate` (its inputs in one host byte buffer, :mod:`.input_buffer`); a later pack of the same shape
copies that buffer, writes its token ids into it, moves it to the device in one copy and takes the context's tensors
as views of it (:func:`fill_template`): the same tensors reach the kernels, without the per-sequence Python work.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .input_buffer import InputLayout, view_inputs

DEFAULT_CAPACITY = 4096  # shapes kept (least recently used first out); a template is a few KB


def shape_key(plan, pack, store, *, pad: bool, merge_levels: bool, dense_attention_tokens: int,
              buckets=None) -> tuple:
    """Everything a pack's layout reads besides token ids (see the module docstring): equal keys, equal layouts."""
    segments = plan.segments
    position = {seg_id: i for i, seg_id in enumerate(pack.segments)}
    received = {seg_id: i for i, seg_id in enumerate(pack.external)}

    def where(seg_id):
        if seg_id is None:
            return None
        if seg_id in position:
            return position[seg_id]
        if seg_id in received:
            return -1 - received[seg_id]
        return ("other", seg_id)  # a plan the layout refuses: never cached, the key only has to be exact

    shape = tuple((len(s.tokens), where(s.parent), s.start, s.leaf is not None, s.hands_state)
                  for s in (segments[i] for i in pack.segments))
    external = tuple((store[i].length if i in store else None, segments[i].hands_state) for i in pack.external)
    return (pad, buckets if pad else None, merge_levels, dense_attention_tokens, shape, external,
            tuple(where(i) for i in pack.export))


@dataclass(frozen=True)
class PackTemplate:
    """A laid-out pack of one shape, with its segments as positions in the pack (``pack.segments`` order)."""

    host: torch.Tensor  # [nbytes] uint8: every input of the forward (the token ids rewritten per pack)
    layout: InputLayout  # slot 0: input_ids
    token_runs: tuple[tuple[int, int], ...]  # the token rows in layout order: (pack position or -1: dummy, length)
    context_fields: tuple[tuple[str, int], ...]  # PackContext tensor field -> slot
    levels: tuple[tuple[object, tuple[tuple[str, int], ...]], ...]  # (LevelSpec on the host, its field -> slot)
    gdn_calls: tuple[tuple[object, tuple[tuple[str, int], ...]], ...]  # (GdnCall on the host, its field -> slot)
    leaf_positions: tuple[int, ...]
    exports: tuple[tuple[int, int, tuple[int, ...], int], ...]  # (position, bank row, chain K/V rows, chain length)
    key_tail: tuple | None  # the graph key after the options' forward_key (padded packs)
    n_external: int


def _with_views(skeleton, fields: tuple[tuple[str, int], ...], views: list[torch.Tensor]):
    """A shallow copy of a host LevelSpec / GdnCall whose tensor fields are the device ``views``."""
    copy = object.__new__(type(skeleton))
    copy.__dict__.update(vars(skeleton))
    for name, slot in fields:
        copy.__dict__[name] = views[slot]
    return copy


def fill_template(template: PackTemplate, plan, pack, device, options, context_type):
    """The ``context_type`` (PackContext) of ``pack`` from the template of its shape: the template's buffer with
    the pack's token ids, moved to ``device`` in one (pinned, asynchronous) copy; received states not attached."""
    segments, ids = plan.segments, pack.segments
    tokens: list[int] = []
    for pos, length in template.token_runs:
        tokens.extend(segments[ids[pos]].tokens if pos >= 0 else (0,) * length)
    device = torch.device(device)
    layout = template.layout
    host = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.copy_(template.host)
    dtype, at, _ = layout.slots[0]
    start = layout.regions[dtype][0] + at * dtype.itemsize
    host[start: start + len(tokens) * dtype.itemsize] = torch.frombuffer(array("q", tokens), dtype=torch.uint8)
    flat = host.to(device, non_blocking=True)
    regions, views = view_inputs(flat, layout)
    fields = {name: views[slot] for name, slot in template.context_fields}
    graph_key = None if template.key_tail is None else (*options.forward_key(), *template.key_tail)
    ctx = context_type(**fields, levels=[_with_views(level, f, views) for level, f in template.levels],
                       gdn_calls=[_with_views(call, f, views) for call, f in template.gdn_calls],
                       leaf_ids=[ids[p] for p in template.leaf_positions], options=options,
                       n_external=template.n_external, graph_key=graph_key, inputs=regions, input_buffer=(flat,))
    for pos, bank_row, chain, length in template.exports:
        ctx.exports[ids[pos]] = (bank_row, torch.tensor(chain, dtype=torch.long, device=device), length)
    return ctx


class TemplateCache:
    """A bounded, thread-safe map of shape keys to templates (least recently used first out)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._templates: OrderedDict[tuple, PackTemplate] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: tuple) -> PackTemplate | None:
        with self._lock:
            template = self._templates.get(key)
            if template is None:
                self.misses += 1
            else:
                self.hits += 1
                self._templates.move_to_end(key)
            return template

    def put(self, key: tuple, template: PackTemplate) -> None:
        with self._lock:
            self._templates[key] = template
            self._templates.move_to_end(key)
            while len(self._templates) > self.capacity:
                self._templates.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._templates.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._templates)


TEMPLATES = TemplateCache()  # the process's cache: build_pack_context reads and fills it

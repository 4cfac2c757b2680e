"""One flat byte buffer for every device input of a packed forward, so that it reaches the device in ONE copy.

A pack's inputs (``PackContext.static_tensors()``: token ids, positions, varlen metadata, state routing) are a few
dozen small int64/int32 tensors. They are laid out in one uint8 buffer: a region per dtype (in order of first
appearance), each region 16-byte aligned, each tensor in its region 16-byte aligned as its own allocation would be
(Triton specializes on that). The host fills the buffer (pinned on CUDA), copies it to the device once
(asynchronously) and takes every tensor as a view of the device copy; a graph replay then copies one buffer.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN_BYTES = 16


@dataclass(frozen=True)
class InputLayout:
    """Where each tensor lies: ``slots[i] = (dtype, element offset in its dtype's region, shape)``; ``regions[dtype]
    = (byte offset, elements)`` (the region's elements: the per-dtype flat buffer ``PackContext.inputs`` holds);
    ``pieces[dtype]``: the region split into each tensor then its alignment gap (``view_inputs`` splits it in one
    call), ``piece_of[i]``: slot i's piece."""

    slots: tuple[tuple[torch.dtype, int, tuple[int, ...]], ...]
    regions: dict[torch.dtype, tuple[int, int]]
    nbytes: int
    pieces: dict[torch.dtype, tuple[int, ...]]
    piece_of: tuple[int, ...]


def plan_input_layout(tensors: Sequence[torch.Tensor]) -> InputLayout:
    """The :class:`InputLayout` of ``tensors`` in this order (equal shapes and dtypes in equal order: equal layouts)."""
    return plan_layout_of_shapes([(tensor.dtype, tuple(tensor.shape)) for tensor in tensors])


def plan_layout_of_shapes(shapes: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> InputLayout:
    """The :class:`InputLayout` of tensors of these ``(dtype, shape)`` in this order, without the tensors."""
    sizes: dict[torch.dtype, int] = {}
    pieces: dict[torch.dtype, list[int]] = {}
    slots, piece_of = [], []
    for dtype, shape in shapes:
        numel = math.prod(shape)
        step = max(1, ALIGN_BYTES // dtype.itemsize)
        at = sizes.get(dtype, 0)
        slots.append((dtype, at, shape))
        size = -(-numel // step) * step
        sizes[dtype] = at + size
        split = pieces.setdefault(dtype, [])
        piece_of.append(len(split))
        split += [numel, size - numel]
    regions, nbytes = {}, 0
    for dtype, elements in sizes.items():
        regions[dtype] = (nbytes, elements)
        nbytes += -(-elements * dtype.itemsize // ALIGN_BYTES) * ALIGN_BYTES
    return InputLayout(tuple(slots), regions, nbytes, {d: tuple(p) for d, p in pieces.items()}, tuple(piece_of))


def region_views(buffer: torch.Tensor, layout: InputLayout) -> dict[torch.dtype, torch.Tensor]:
    """Each dtype's region of the uint8 ``buffer`` as a flat tensor of that dtype: ``{dtype: [elements]}``."""
    return {dtype: buffer[start: start + elements * dtype.itemsize].view(dtype)
            for dtype, (start, elements) in layout.regions.items()}


def fill_host_buffer(tensors: Sequence[torch.Tensor], layout: InputLayout, *, pin: bool) -> torch.Tensor:
    """A zeroed uint8 host buffer ``[nbytes]`` (pinned when ``pin``) holding ``tensors`` where ``layout`` puts them."""
    host = torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=pin)
    regions = region_views(host, layout)
    for tensor, (dtype, at, _) in zip(tensors, layout.slots):
        regions[dtype][at: at + tensor.numel()] = tensor.reshape(-1)
    return host


STRUCT_CODES = {torch.int64: "q", torch.int32: "i"}  # struct's codes of the inputs' dtypes (standard sizes)


def write_host_buffer(values: Sequence[Sequence[int]], layout: InputLayout) -> torch.Tensor:
    """The uint8 host buffer ``[nbytes]`` of ``layout`` holding ``values[i]`` (plain ints, slot i's elements in
    row-major order) where ``layout`` puts slot i, zeros elsewhere: :func:`fill_host_buffer`'s bytes, built from
    lists without a tensor per slot (one ``struct.pack_into`` per dtype region)."""
    regions: dict[torch.dtype, list[int]] = {dtype: [] for dtype in layout.regions}
    for flat, (dtype, at, _) in zip(values, layout.slots, strict=True):
        region = regions[dtype]
        region += [0] * (at - len(region))  # the previous slot's alignment gap
        region += flat
    buffer = bytearray(layout.nbytes)
    for dtype, (start, _) in layout.regions.items():
        struct.pack_into(f"={len(regions[dtype])}{STRUCT_CODES[dtype]}", buffer, start, *regions[dtype])
    return torch.frombuffer(buffer, dtype=torch.uint8)


def view_inputs(buffer: torch.Tensor, layout: InputLayout) -> tuple[dict[torch.dtype, torch.Tensor],
                                                                      list[torch.Tensor]]:
    """``(regions, views)`` of a filled buffer: each dtype's flat region and each slot's tensor, in slot order."""
    regions = region_views(buffer, layout)
    split = {dtype: region.split_with_sizes(layout.pieces[dtype]) for dtype, region in regions.items()}
    views = []
    for (dtype, _, shape), piece in zip(layout.slots, layout.piece_of):
        view = split[dtype][piece]
        views.append(view if len(shape) == 1 else view.view(shape))
    return regions, views

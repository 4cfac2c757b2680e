"""hf_openjev.packing.input_buffer: every input of a pack in one byte buffer, planned from tensors or from shapes,
filled from tensors or written from lists, to the same bytes."""

from __future__ import annotations

import torch

from hf_openjev.packing.input_buffer import (
    fill_host_buffer,
    plan_input_layout,
    plan_layout_of_shapes,
    view_inputs,
    write_host_buffer,
)


def test_lists_written_into_the_buffer_equal_the_tensors_filled_in():
    gen = torch.Generator().manual_seed(3)
    shapes = [(torch.int64, (5,)), (torch.int32, (3,)), (torch.int32, (4, 2)), (torch.int64, (1,)),
              (torch.int64, (0,)), (torch.int32, (0, 2)), (torch.int32, (7,)), (torch.int64, (9,))]
    tensors = [torch.randint(-2 ** 31, 2 ** 31 - 1, shape, generator=gen, dtype=dtype) for dtype, shape in shapes]
    layout = plan_input_layout(tensors)
    assert plan_layout_of_shapes(shapes) == layout
    written = write_host_buffer([t.reshape(-1).tolist() for t in tensors], layout)
    assert written.dtype == torch.uint8 and torch.equal(written, fill_host_buffer(tensors, layout, pin=False))
    _, views = view_inputs(written, layout)
    assert all(v.dtype == t.dtype and torch.equal(v, t) for v, t in zip(views, tensors, strict=True))

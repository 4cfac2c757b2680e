"""hf_openjev.packing.layout_cache: a pack of a shape seen before gets the tensors the full layout makes, from the
shape's template, with its own token ids. (Cached contexts against the reference on random plans, hits included:
tests/test_layout_reference.py.)"""

from __future__ import annotations

import pytest
import torch
from same_layouts import assert_same_context

from hf_openjev.fast_options import FastPathOptions
from hf_openjev.packing import naive_layout as nl
from hf_openjev.packing import pack_context as pc
from hf_openjev.packing.layout_cache import TEMPLATES, TemplateCache, shape_key
from hf_openjev.packing.pack_context import build_pack_context
from hf_openjev.packing.planner import plan_requests
from hf_openjev.patches.cuda_graphs import copy_inputs

DEFAULTS = FastPathOptions()  # the fast path's options as packing receives them

torch.set_num_threads(1)


def test_a_hit_runs_none_of_the_layout_steps_and_carries_the_new_tokens(monkeypatch):
    TEMPLATES.clear()
    first = plan_requests([[[[7] * 70 + [8, 9], [7] * 70 + [10]]]])
    second = plan_requests([[[[3] * 70 + [4, 5], [3] * 70 + [6]]]])  # the same shape, other ids
    a = build_pack_context(first, first.packs[0], {}, "cpu", DEFAULTS, pad=True)
    expected = nl.build_naive_pack_context(second, second.packs[0], {}, "cpu", DEFAULTS, pad=True)

    def refuse(*args, **kwargs):
        raise AssertionError("a layout step ran on a cache hit")

    for step in ("lay_out_template", "move_inputs"):
        monkeypatch.setattr(pc, step, refuse)
    for step in ("lay_out_levels", "lay_out_pack", "build_gdn_call"):
        monkeypatch.setattr(nl, step, refuse)
    b = build_pack_context(second, second.packs[0], {}, "cpu", DEFAULTS, pad=True)
    assert TEMPLATES.hits == 1 and b.graph_key == a.graph_key
    assert_same_context(b, expected)
    assert 7 not in b.input_ids.tolist() and {3, 4, 5, 6} <= set(b.input_ids.tolist())
    assert b.input_ids.data_ptr() != a.input_ids.data_ptr()  # each context owns its buffer
    a.input_ids.fill_(1)
    assert 1 not in b.input_ids.tolist()


def test_the_shape_key_is_the_lengths_and_the_tree_not_the_ids_or_segment_numbers():
    one = plan_requests([[[[7] * 40 + [8], [7] * 40 + [9]]]])
    other_ids = plan_requests([[[[5] * 40 + [1], [5] * 40 + [2]]]])
    later = plan_requests([[[[1, 2]]], [[[5] * 40 + [1], [5] * 40 + [2]]]], max_sequences=2)  # ids from 1
    longer = plan_requests([[[[7] * 40 + [8, 8], [7] * 40 + [9]]]])

    def key(plan, pack=None, **options):
        settings = dict(pad=True, merge_levels=True, dense_attention_tokens=2048) | options
        return shape_key(plan, pack or plan.packs[-1], {}, **settings)

    assert key(one) == key(other_ids) == key(later, later.packs[1])
    assert key(one) != key(longer) and key(one) != key(one, pad=False) and key(one) != key(one, merge_levels=False)
    assert key(one) != key(one, dense_attention_tokens=16)


def test_the_template_cache_is_bounded_least_recently_used_first_out():
    cache = TemplateCache(capacity=2)
    cache.put(("a",), "A")
    cache.put(("b",), "B")
    assert cache.get(("a",)) == "A"  # a is now the most recent
    cache.put(("c",), "C")
    assert cache.get(("b",)) is None and cache.get(("a",)) == "A" and len(cache) == 2
    assert (cache.hits, cache.misses) == (2, 1)
    with pytest.raises(ValueError, match="capacity"):
        TemplateCache(capacity=0)


def test_a_replay_copies_one_buffer_into_the_captured_context():
    first = plan_requests([[[[7] * 40 + [8], [7] * 40 + [9]]]])
    second = plan_requests([[[[5] * 40 + [1], [5] * 40 + [2]]]])
    captured = build_pack_context(first, first.packs[0], {}, "cpu", DEFAULTS, pad=True)
    new = build_pack_context(second, second.packs[0], {}, "cpu", DEFAULTS, pad=True)
    assert len(captured.input_buffer) == 1 and captured.input_buffer[0].dtype == torch.uint8
    for tensor in captured.static_tensors():  # every input lies in the one buffer
        assert tensor.untyped_storage().data_ptr() == captured.input_buffer[0].untyped_storage().data_ptr()
    copy_inputs(new, captured)
    assert all(torch.equal(x, y) for x, y in zip(captured.static_tensors(), new.static_tensors()))
    longer = plan_requests([[[[5] * 40 + [1] * 30, [5] * 40 + [2]]]])
    other = build_pack_context(longer, longer.packs[0], {}, "cpu", DEFAULTS, pad=True)
    with pytest.raises(RuntimeError, match="another input layout"):
        copy_inputs(other, captured)

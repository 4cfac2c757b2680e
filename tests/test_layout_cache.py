"""hf_openjev.packing.layout_cache: a pack of a shape seen before gets the tensors the full layout makes.

Random plans (tails, splits with received and handed-on states, padding, merged or per-level GDN calls) are built
through the cache twice, the second time with other token ids of the same lengths (its hits), and compared with
``build_pack_context_uncached`` (every step run) tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hf_openjev.patches.cuda_graphs import copy_inputs

from hf_openjev.fast_options import FastPathOptions
from hf_openjev.packing import pack_context as pc
from hf_openjev.packing.layout_cache import TEMPLATES, TemplateCache, shape_key
from hf_openjev.packing.pack_context import (
    SegmentState,
    build_pack_context,
    build_pack_context_uncached,
)
from hf_openjev.packing.planner import plan_requests

torch.set_num_threads(1)


def _lengths(rng: random.Random) -> list:
    """A batch's shape: per request, (prefix, per question (head, [suffixes]))."""
    return [(rng.choice([0, 10, 40, 64, 70, 130]),
             [(rng.choice([0, 5, 20, 70]), [rng.randint(1, 40) for _ in range(rng.randint(1, 5))])
              for _ in range(rng.randint(1, 2))]) for _ in range(rng.randint(1, 3))]


def _requests(shape: list, rng: random.Random) -> list:
    """Token ids of ``shape``: shared where the shape shares, random elsewhere (new ids each call)."""
    out = []
    for prefix_len, questions in shape:
        prefix = [rng.randrange(5, 400) for _ in range(prefix_len)]
        out.append([])
        for head_len, suffixes in questions:
            head = prefix + [rng.randrange(5, 400) for _ in range(head_len)]
            out[-1].append([head + [rng.randrange(5, 400) for _ in range(n)] for n in suffixes])
    return out


def _store_for(plan, pack, store: dict, rng: random.Random) -> None:
    """Exported states of earlier packs (random values, two layers) for ``pack.external``."""
    for seg in pack.external:
        if seg not in store:
            length = plan.segments[seg].end
            store[seg] = SegmentState(length, gdn={0: torch.randn(2, 3, 3)}, conv={0: torch.randn(4, 2)},
                                      key={1: torch.randn(length, 1, 2)}, value={1: torch.randn(length, 1, 2)})


def _assert_same_context(a, b) -> None:
    assert a.graph_key == b.graph_key and a.leaf_ids == b.leaf_ids and a.n_external == b.n_external
    assert a.options == b.options
    for x, y in zip(a.static_tensors(), b.static_tensors(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert {d: t.shape for d, t in a.inputs.items()} == {d: t.shape for d, t in b.inputs.items()}
    for xs, ys in ((a.levels, b.levels), (a.gdn_calls, b.gdn_calls)):
        assert len(xs) == len(ys)
        for x, y in zip(xs, ys):
            for f in dataclasses.fields(x):
                u, v = getattr(x, f.name), getattr(y, f.name)
                assert (torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v), f.name
            # a call that shares its level's metadata still does
            if isinstance(x, pc.GdnCall) and x.rows is None:
                assert x.cu_seqlens is a.levels[x.first].cu_seqlens
    assert a.exports.keys() == b.exports.keys()
    for seg, (row, chain, length) in a.exports.items():
        assert (row, length) == (b.exports[seg][0], b.exports[seg][2]) and torch.equal(chain, b.exports[seg][1])
    for name in ("external_gdn", "external_conv", "external_key", "external_value"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("plan_options", [dict(), dict(share_tails=False, min_shared_tokens=64),
                                          dict(max_sequences=2), dict(max_sequences=3, max_tokens=120)])
def test_cached_layouts_equal_the_full_layout_on_random_plans(plan_options):
    rng = random.Random(11)
    TEMPLATES.clear()
    compared = hits = exported = received = 0
    for _ in range(10):
        shape, dense = _lengths(rng), rng.choice([0, 16, 2048])
        for _ in range(2):  # the same shape with other token ids: the second round hits the cache
            plan = plan_requests(_requests(shape, rng), **plan_options)
            store: dict = {}
            for pack in plan.packs:
                _store_for(plan, pack, store, rng)
                pads = [False] if (pack.external or pack.export) else [False, True]
                for pad in pads:
                    for merge in (True, False):
                        options = FastPathOptions(dense_attention_tokens=dense)
                        before = TEMPLATES.hits
                        cached = build_pack_context(plan, pack, store, "cpu", options, pad=pad, merge_levels=merge)
                        hits += TEMPLATES.hits > before
                        full = build_pack_context_uncached(plan, pack, store, "cpu", options, pad=pad,
                                                           merge_levels=merge)
                        _assert_same_context(cached, full)
                        compared += 1
                exported += bool(pack.export)
                received += bool(pack.external)
    assert compared >= 40 and hits >= compared // 3
    if plan_options.get("max_sequences"):
        assert exported and received  # split trees: states handed on and received were compared


def test_a_hit_runs_none_of_the_layout_steps_and_carries_the_new_tokens(monkeypatch):
    TEMPLATES.clear()
    first = plan_requests([[[[7] * 70 + [8, 9], [7] * 70 + [10]]]])
    second = plan_requests([[[[3] * 70 + [4, 5], [3] * 70 + [6]]]])  # the same shape, other ids
    a = build_pack_context(first, first.packs[0], {}, "cpu", pad=True)
    expected = build_pack_context_uncached(second, second.packs[0], {}, "cpu", pad=True)

    def refuse(*args, **kwargs):
        raise AssertionError("a layout step ran on a cache hit")

    for step in ("lay_out_levels", "find_anchors", "build_gdn_call", "select_final_rows", "move_inputs"):
        monkeypatch.setattr(pc, step, refuse)
    b = build_pack_context(second, second.packs[0], {}, "cpu", pad=True)
    assert TEMPLATES.hits == 1 and b.graph_key == a.graph_key
    _assert_same_context(b, expected)
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
    captured = build_pack_context(first, first.packs[0], {}, "cpu", pad=True)
    new = build_pack_context(second, second.packs[0], {}, "cpu", pad=True)
    assert len(captured.input_buffer) == 1 and captured.input_buffer[0].dtype == torch.uint8
    for tensor in captured.static_tensors():  # every input lies in the one buffer
        assert tensor.untyped_storage().data_ptr() == captured.input_buffer[0].untyped_storage().data_ptr()
    copy_inputs(new, captured)
    assert all(torch.equal(x, y) for x, y in zip(captured.static_tensors(), new.static_tensors()))
    longer = plan_requests([[[[5] * 40 + [1] * 30, [5] * 40 + [2]]]])
    other = build_pack_context(longer, longer.packs[0], {}, "cpu", pad=True)
    with pytest.raises(RuntimeError, match="another input layout"):
        copy_inputs(other, captured)

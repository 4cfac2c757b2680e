"""hf_openjev.packing.host_layout: a pack of a new shape laid out on lists gets the template the tensor steps make.

Random plans (tails, nested tails, splits with received and handed-on states, padding, merged or per-level GDN
calls, dense levels) are laid out both ways, ``lay_out_template`` (what ``build_pack_context`` runs on a layout-cache
miss) and ``record_template(*lay_out_pack(...))`` (the tensor steps), and compared field by field and byte by byte;
the contexts filled from the new template are compared with ``build_pack_context_uncached`` tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from hf_openjev.fast_options import FastPathOptions
from hf_openjev.packing import pack_context as pc
from hf_openjev.packing.host_layout import lay_out_template
from hf_openjev.packing.input_buffer import (
    fill_host_buffer,
    plan_input_layout,
    plan_layout_of_shapes,
    write_host_buffer,
)
from hf_openjev.packing.layout_cache import TEMPLATES, fill_template, record_template
from hf_openjev.packing.planner import plan_requests

torch.set_num_threads(1)

PLAN_OPTIONS = [dict(), dict(share_tails=False, min_shared_tokens=64), dict(min_shared_tokens=4),
                dict(max_sequences=2), dict(max_sequences=3, max_tokens=150), dict(shared_prefix=False)]


def _random_requests(rng: random.Random) -> list:
    """1-3 requests of 1-2 questions of 1-6 candidates: a shared state, a question head, own suffixes (random
    lengths, 0 included, so prefixes are shared, tails cut or nothing shared)."""
    requests = []
    for _ in range(rng.randint(1, 3)):
        state = [rng.randrange(5, 400) for _ in range(rng.choice([0, 3, 38, 64, 70, 130, 200]))]
        questions = []
        for _ in range(rng.randint(1, 2)):
            head = state + [rng.randrange(5, 400) for _ in range(rng.choice([0, 5, 20, 70]))]
            questions.append([head + [rng.randrange(5, 400) for _ in range(rng.randint(1, 50))]
                              for _ in range(rng.randint(1, 6))])
        requests.append(questions)
    return requests


def _store_for(plan, pack, store: dict) -> None:
    for seg in pack.external:
        if seg not in store:
            length = plan.segments[seg].end
            store[seg] = pc.SegmentState(length, gdn={0: torch.zeros(2, 3, 3)}, conv={0: torch.zeros(4, 2)},
                                         key={1: torch.zeros(length, 1, 2)}, value={1: torch.zeros(length, 1, 2)})


def _assert_same_holder(new, old, new_fields, old_fields) -> None:
    """A template's LevelSpec / GdnCall: equal non-tensor fields, the same slot for each tensor field."""
    assert type(new) is type(old) and dict(new_fields) == dict(old_fields)
    assert tuple(name for name, _ in new_fields) == tuple(name for name, _ in old_fields)
    for f in dataclasses.fields(old):
        value = getattr(old, f.name)
        if isinstance(value, torch.Tensor):
            assert getattr(new, f.name) is None and f.name in dict(new_fields), f.name
        else:
            assert getattr(new, f.name) == value and f.name not in dict(new_fields), f.name


def _assert_same_template(new, old) -> None:
    assert new.layout == old.layout
    assert new.host.dtype == old.host.dtype == torch.uint8 and torch.equal(new.host, old.host)
    for name in ("token_runs", "context_fields", "leaf_positions", "exports", "key_tail", "n_external"):
        assert getattr(new, name) == getattr(old, name), name
    for news, olds in ((new.levels, old.levels), (new.gdn_calls, old.gdn_calls)):
        assert len(news) == len(olds)
        for (n, n_fields), (o, o_fields) in zip(news, olds):
            _assert_same_holder(n, o, n_fields, o_fields)


def _assert_same_tensors(a, b) -> None:
    assert a.graph_key == b.graph_key and a.leaf_ids == b.leaf_ids and a.n_external == b.n_external
    for x, y in zip(a.static_tensors(), b.static_tensors(), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    for xs, ys in ((a.levels, b.levels), (a.gdn_calls, b.gdn_calls)):
        for x, y in zip(xs, ys, strict=True):
            for f in dataclasses.fields(x):
                u, v = getattr(x, f.name), getattr(y, f.name)
                assert (torch.equal(u, v) and u.dtype == v.dtype if isinstance(u, torch.Tensor) else u == v), f.name
    assert a.exports.keys() == b.exports.keys()
    for seg, (row, chain, length) in a.exports.items():
        assert (row, length) == (b.exports[seg][0], b.exports[seg][2]) and torch.equal(chain, b.exports[seg][1])


@pytest.mark.parametrize("plan_options", PLAN_OPTIONS)
def test_list_templates_equal_the_tensor_steps_templates_on_random_plans(plan_options):
    rng = random.Random(5)
    compared, kinds = 0, set()
    for _ in range(12):
        plan = plan_requests(_random_requests(rng), **plan_options)
        store: dict = {}
        dense = rng.choice([0, 16, 2048])
        options = FastPathOptions(dense_attention_tokens=dense)
        for pack in plan.packs:
            _store_for(plan, pack, store)
            for pad in [False] if (pack.external or pack.export) else [False, True]:
                for merge in (True, False):
                    new = lay_out_template(plan, pack, store, pad=pad, merge_levels=merge,
                                           dense_attention_tokens=dense)
                    ctx, layout, bank = pc.lay_out_pack(plan, pack, store, options, pad=pad, merge_levels=merge)
                    _assert_same_template(new, record_template(ctx, plan, pack, layout, bank))
                    filled = fill_template(new, plan, pack, "cpu", options, pc.PackContext)
                    _assert_same_tensors(filled, pc.build_pack_context_uncached(plan, pack, store, "cpu", options,
                                                                                pad=pad, merge_levels=merge))
                    compared += 1
                    kinds |= {"gathered" for call in ctx.gdn_calls if call.rows is not None}
                    kinds |= {"chain" for level in ctx.levels if level.chain_index is not None}
                    kinds |= {"dense" for level in ctx.levels if level.dense}
                    kinds |= {"export"} if pack.export else set()
                    kinds |= {"received"} if pack.external else set()
                    kinds |= {"source"} if any(call.source is not None for call in ctx.gdn_calls) else set()
    assert compared >= 24
    if plan_options.get("max_sequences"):
        assert {"export", "received"} <= kinds
    if not plan_options:  # the default plans: tails (gathered calls) and padded, shared-prefix levels
        assert {"gathered", "source", "dense"} <= kinds


def test_a_nested_tail_plan_gathers_its_chains_and_matches_the_tensor_steps():
    nested = plan_requests([[[list(range(100, 140)) + list(range(200, 220)) + [c] for c in (1, 2)],
                             [list(range(100, 140)) + list(range(300, 320)) + [c] for c in (3, 4)]]],
                           share_tails=True, min_shared_tokens=8)
    pack = nested.packs[0]
    for pad in (False, True):
        new = lay_out_template(nested, pack, {}, pad=pad, merge_levels=True, dense_attention_tokens=2048)
        ctx, layout, bank = pc.lay_out_pack(nested, pack, {}, FastPathOptions(), pad=pad, merge_levels=True)
        assert any(level.chain_index is not None for level in ctx.levels)  # split chains: a gathered block
        _assert_same_template(new, record_template(ctx, nested, pack, layout, bank))


def test_a_new_shape_builds_no_tensor_per_input(monkeypatch):
    plan = plan_requests([[[[7] * 50 + [8] * 30, [7] * 50 + [9] * 41, [7] * 50 + [4]]]])
    TEMPLATES.clear()
    made = []
    real = torch.tensor

    def counting(*args, **kwargs):
        made.append(args)
        return real(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor step ran on a new shape")

    monkeypatch.setattr(torch, "tensor", counting)
    for step in ("lay_out_pack", "lay_out_level", "route_prefixes", "build_gdn_call", "prepare_varlen_metadata"):
        monkeypatch.setattr(pc, step, refuse)
    ctx = pc.build_pack_context(plan, plan.packs[0], {}, "cpu", pad=True)
    assert TEMPLATES.misses == 1 and not made
    monkeypatch.undo()
    _assert_same_tensors(ctx, pc.build_pack_context_uncached(plan, plan.packs[0], {}, "cpu", pad=True))


def test_lists_written_into_the_buffer_equal_the_tensors_filled_in():
    gen = torch.Generator().manual_seed(3)
    shapes = [(torch.int64, (5,)), (torch.int32, (3,)), (torch.int32, (4, 2)), (torch.int64, (1,)),
              (torch.int64, (0,)), (torch.int32, (0, 2)), (torch.int32, (7,)), (torch.int64, (9,))]
    tensors = [torch.randint(-2 ** 31, 2 ** 31 - 1, shape, generator=gen, dtype=dtype) for dtype, shape in shapes]
    layout = plan_input_layout(tensors)
    assert plan_layout_of_shapes(shapes) == layout
    written = write_host_buffer([t.reshape(-1).tolist() for t in tensors], layout)
    assert written.dtype == torch.uint8 and torch.equal(written, fill_host_buffer(tensors, layout, pin=False))

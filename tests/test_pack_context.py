"""hf_openjev.packing.pack_context: the context the fast path builds (``build_pack_context``), on small hand-made
plans (tests/small_plans.py). That it equals the reference's context on random plans:
tests/test_layout_reference.py."""

from __future__ import annotations

import torch
from same_layouts import assert_same_context
from small_plans import NO_EXTERNAL, SPLIT, TAILS, TWO

from hf_openjev.fast_options import FastPathOptions
from hf_openjev.packing import naive_layout as nl
from hf_openjev.packing import pack_context as pc
from hf_openjev.packing.layout_cache import TEMPLATES
from hf_openjev.packing.layout_steps import SegmentState
from hf_openjev.packing.planner import plan_requests

DEFAULTS = FastPathOptions()  # the fast path's options as packing receives them


def test_build_pack_context_gives_the_steps_results():
    """The context of the tails plan is the reference steps' results put together."""
    ctx = pc.build_pack_context(TAILS, TAILS.packs[0], {}, "cpu", DEFAULTS)
    layout = nl.lay_out_levels(TAILS, [[0], [1], [2, 3]], NO_EXTERNAL, pad=False, dense_attention_tokens=2048)
    assert ctx.input_ids.tolist() == layout.token_ids and ctx.positions.tolist() == layout.positions
    assert [(level.lo, level.hi) for level in ctx.levels] == [(level.lo, level.hi) for level in layout.levels]
    assert [(call.first, call.last, call.source) for call in ctx.gdn_calls] == [(0, 0, None), (1, 2, 0)]
    assert ctx.leaf_ids == [2, 3] and ctx.final_rows.tolist() == [82, 84]
    assert ctx.options == FastPathOptions()


def test_graph_keys_follow_shapes_and_forward_options_only():
    other = plan_requests([[[[1] * 80 + [2, 3, 4], [1] * 80 + [6, 5]]]], share_tails=False, min_shared_tokens=64)
    key = pc.build_pack_context(TWO, TWO.packs[0], {}, "cpu", DEFAULTS, pad=True).graph_key
    assert pc.build_pack_context(other, other.packs[0], {}, "cpu", DEFAULTS, pad=True).graph_key == key  # other ids
    planner_only = FastPathOptions(min_shared_tokens=8, max_tokens=100, share_tails=True)
    assert pc.build_pack_context(TWO, TWO.packs[0], {}, "cpu", planner_only, pad=True).graph_key == key
    fp32 = pc.build_pack_context(TWO, TWO.packs[0], {}, "cpu", FastPathOptions(gdn_fp32=True), pad=True)
    assert fp32.graph_key != key and fp32.options.gdn_fp32
    assert pc.build_pack_context(TWO, TWO.packs[0], {}, "cpu", DEFAULTS).graph_key is None  # unpadded: no graph


def test_exports_and_received_states_are_attached():
    first = pc.build_pack_context(SPLIT, SPLIT.packs[0], {}, "cpu", DEFAULTS)
    ((seg, (row, rows, length)),) = first.exports.items()
    assert (seg, row, rows.tolist(), length) == (0, 1, list(range(64)), 64)  # bank row 1: the first call's state
    gen = torch.Generator().manual_seed(0)
    state = SegmentState(64, gdn={0: torch.randn(2, 4, 3, generator=gen)}, conv={0: torch.randn(5, 4, generator=gen)},
                         key={3: torch.randn(64, 1, 8, generator=gen)}, value={3: torch.randn(64, 1, 8, generator=gen)})
    ctx = pc.build_pack_context(SPLIT, SPLIT.packs[1], {0: state}, "cpu", DEFAULTS)
    assert ctx.n_external == 1 and not ctx.exports
    assert torch.equal(ctx.external_gdn[0], state.gdn[0][None]) and torch.equal(ctx.external_conv[0], state.conv[0][None])
    assert torch.equal(ctx.external_key[3], state.key[3]) and torch.equal(ctx.external_value[3], state.value[3])
    assert ctx.gdn_calls[0].parent_rows.tolist() == [1] and ctx.gdn_calls[0].source is None  # the bank's row 1


def test_a_new_shape_builds_no_tensor_per_input(monkeypatch):
    """A layout-cache miss runs the list layout (layout.lay_out_template), never the reference's tensor steps."""
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
    for step in ("lay_out_pack", "lay_out_level", "route_prefixes", "build_gdn_call", "record_template"):
        monkeypatch.setattr(nl, step, refuse)
    monkeypatch.setattr(pc, "move_inputs", refuse)
    ctx = pc.build_pack_context(plan, plan.packs[0], {}, "cpu", DEFAULTS, pad=True)
    assert TEMPLATES.misses == 1 and not made
    monkeypatch.undo()
    assert_same_context(ctx, nl.build_naive_pack_context(plan, plan.packs[0], {}, "cpu", DEFAULTS, pad=True))

"""The reference layout (hf_openjev.packing.naive_layout): its tensor steps, each on small hand-made plans
(tests/small_plans.py). That the fast layout equals it on random plans: tests/test_layout_reference.py."""

from __future__ import annotations

import torch
from small_plans import NO_EXTERNAL, SPLIT, TAILS, TWO

from hf_openjev.fast_options import FastPathOptions
from hf_openjev.packing import naive_layout as nl
from hf_openjev.packing.graph_buckets import bucket_tokens, pad_level
from hf_openjev.packing.layout_steps import SegmentState, StateBank, find_anchors, group_levels, index_external

DEFAULTS = FastPathOptions()  # the fast path's options as packing receives them

# --- prefix routing -----------------------------------------------------------------------------------------------


def test_consecutive_prefix_blocks_are_read_in_place():
    prefix = list(range(64))
    route = nl.route_prefixes([prefix, prefix, []], 64, pad=False)
    assert route.chain_index is None
    assert route.prefix_starts.tolist() == [0, 0, 0, 64] and route.prefix_lengths.tolist() == [64, 64, 0]
    assert route.prefix_starts.dtype == route.prefix_lengths.dtype == torch.int32
    assert route.max_chain == 64
    assert nl.route_prefixes([prefix, []], 100, pad=True).max_chain == 100  # padded: the rows before the level


def test_split_prefix_chains_are_gathered_once_per_distinct_block():
    first, second = [0, 1, 2, 10, 11], [0, 1, 2, 20]  # a shared prefix, then each question's own rows
    route = nl.route_prefixes([first, first, second], 30, pad=False)
    assert route.chain_index.tolist() == [0, 1, 2, 10, 11, 0, 1, 2, 20]  # the repeated block once
    assert route.prefix_starts.tolist() == [0, 0, 5, 9] and route.prefix_lengths.tolist() == [5, 5, 4]
    assert route.max_chain == 5
    padded = nl.route_prefixes([first, first, second, []], 30, pad=True)
    assert padded.max_chain == bucket_tokens(9) == len(padded.chain_index) == 32
    assert padded.chain_index.tolist()[9:] == [0] * 23 and padded.prefix_lengths.tolist() == [5, 5, 4, 0]


# --- the layout ---------------------------------------------------------------------------------------------------

def test_levels_are_contiguous_and_children_continue_their_prefix_positions_and_keys():
    layout = nl.lay_out_levels(TWO, [[0], [1, 2]], NO_EXTERNAL, pad=False, dense_attention_tokens=2048)
    segments = TWO.segments
    assert layout.token_ids == list(segments[0].tokens + segments[1].tokens + segments[2].tokens)
    assert layout.positions == list(range(64)) + list(range(64, 83)) + list(range(64, 82))
    assert layout.start_of == {0: 0, 1: 64, 2: 83}
    assert layout.chain_rows[1] == list(range(83)) and layout.chain_rows[2] == list(range(64)) + list(range(83, 101))
    root, children = layout.levels
    assert (root.lo, root.hi, root.cu_seqlens.tolist(), root.has_parents, root.max_seqlen) == (0, 64, [0, 64], False, 64)
    assert root.prefix_starts is None and not root.dense  # 64 tokens < 2048
    assert (children.lo, children.hi, children.cu_seqlens.tolist(), children.max_seqlen) == (64, 101, [0, 19, 37], 19)
    assert children.has_parents and children.chain_index is None  # the prefix's rows 0..63, in place
    assert children.prefix_starts.tolist() == [0, 0, 64] and children.prefix_lengths.tolist() == [64, 64]


def test_a_long_root_level_alone_gets_dense_attention():
    dense = nl.lay_out_levels(TWO, [[0], [1, 2]], NO_EXTERNAL, pad=False, dense_attention_tokens=64)
    assert [level.dense for level in dense.levels] == [True, False]  # the children are two and continue a prefix
    never = nl.lay_out_levels(TWO, [[0], [1, 2]], NO_EXTERNAL, pad=False, dense_attention_tokens=0)
    assert [level.dense for level in never.levels] == [False, False]


def test_padded_levels_end_with_dummy_sequences_from_position_zero():
    layout = nl.lay_out_levels(TWO, [[0], [1, 2]], NO_EXTERNAL, pad=True, dense_attention_tokens=2048)
    children = layout.levels[1]
    dummies = pad_level([19, 18])
    assert dummies  # the level is padded
    assert children.cu_seqlens.tolist() == [0, 19, 37, *[37 + sum(dummies[: i + 1]) for i in range(len(dummies))]]
    assert children.hi - children.lo == children.max_seqlen == 37 + sum(dummies)
    assert layout.token_ids[101:] == [0] * sum(dummies)
    assert layout.positions[101:] == [p for n in dummies for p in range(n)]
    assert children.prefix_lengths.tolist() == [64, 64] + [0] * len(dummies)  # dummies read no prefix
    assert children.max_chain == 64  # the rows before the level: the bound a padded level keeps


def test_a_continued_external_prefix_is_read_from_the_external_rows():
    store = {0: SegmentState(length=64)}
    pack = SPLIT.packs[1]
    external = index_external(pack, store)
    layout = nl.lay_out_levels(SPLIT, group_levels(SPLIT, pack), external, pad=False, dense_attention_tokens=2048)
    (level,) = layout.levels
    assert layout.start_of == {1: 0} and layout.positions == list(range(64, 83))
    assert layout.chain_rows[1] == list(range(64)) + list(range(64, 83))  # [external K/V ; pack K/V] rows
    assert level.has_parents and level.chain_index is None
    assert level.prefix_starts.tolist() == [0, 64] and level.prefix_lengths.tolist() == [64]


# --- Gated DeltaNet calls -----------------------------------------------------------------------------------------

def test_gdn_calls_over_a_level_and_over_a_gathered_layout():
    layout = nl.lay_out_levels(TAILS, [[0], [1], [2, 3]], NO_EXTERNAL, pad=False, dense_attention_tokens=2048)
    anchors = find_anchors(TAILS, TAILS.packs[0])
    bank = StateBank([])
    first = nl.build_gdn_call(TAILS, [0], layout, anchors, bank, pad=False)
    assert (first.first, first.last, first.lo, first.hi, first.rows, first.keep) == (0, 0, 0, 64, None, None)
    assert first.cu_seqlens is layout.levels[0].cu_seqlens  # its level's metadata, shared
    assert first.parent_rows.tolist() == [0] and first.parent_rows.dtype == torch.int64
    assert not first.has_parents and first.source is None
    second = nl.build_gdn_call(TAILS, [1, 2], layout, anchors, bank, pad=False)
    assert (second.first, second.last, second.lo, second.hi) == (1, 2, 64, 85)
    assert second.cu_seqlens.tolist() == [0, 16, 35, 53] and len(second.rows) == 53 and len(second.keep) == 21
    assert second.has_parents and second.source == 0 and second.parent_rows.tolist() == [0, 0, 0]  # call 0's state
    assert bank.row_of == {0: 1, 1: 2, 2: 3, 3: 4}


def test_a_padded_gathered_call_gives_its_dummies_the_first_row():
    layout = nl.lay_out_levels(TAILS, [[0], [1], [2, 3]], NO_EXTERNAL, pad=True, dense_attention_tokens=2048)
    anchors = find_anchors(TAILS, TAILS.packs[0])
    bank = StateBank([])
    nl.build_gdn_call(TAILS, [0], layout, anchors, bank, pad=True)
    call = nl.build_gdn_call(TAILS, [1, 2], layout, anchors, bank, pad=True)
    dummies = pad_level([16, 19, 18])
    assert dummies and call.cu_seqlens.tolist()[:4] == [0, 16, 35, 53]
    assert call.rows.tolist()[53:] == [call.lo] * sum(dummies)
    assert call.parent_rows.tolist() == [0, 0, 0] + [0] * len(dummies) and call.source == 0


# --- the whole context --------------------------------------------------------------------------------------------

def test_the_naive_context_is_the_steps_results_put_together():
    ctx = nl.build_naive_pack_context(TAILS, TAILS.packs[0], {}, "cpu", DEFAULTS)
    layout = nl.lay_out_levels(TAILS, [[0], [1], [2, 3]], NO_EXTERNAL, pad=False, dense_attention_tokens=2048)
    assert ctx.input_ids.tolist() == layout.token_ids and ctx.positions.tolist() == layout.positions
    assert [(level.lo, level.hi) for level in ctx.levels] == [(level.lo, level.hi) for level in layout.levels]
    assert [(call.first, call.last, call.source) for call in ctx.gdn_calls] == [(0, 0, None), (1, 2, 0)]
    assert ctx.leaf_ids == [2, 3] and ctx.final_rows.tolist() == [82, 84]
    assert ctx.options == FastPathOptions() and ctx.graph_key is None
    padded = nl.build_naive_pack_context(TWO, TWO.packs[0], {}, "cpu", DEFAULTS, pad=True)
    assert padded.graph_key == nl.key_graph(padded) and len(padded.input_buffer) == 1  # moved: one buffer


def test_the_naive_context_attaches_exports_and_received_states():
    first = nl.build_naive_pack_context(SPLIT, SPLIT.packs[0], {}, "cpu", DEFAULTS)
    ((seg, (row, rows, length)),) = first.exports.items()
    assert (seg, row, rows.tolist(), length) == (0, 1, list(range(64)), 64)  # bank row 1: the first call's state
    state = SegmentState(64, gdn={0: torch.ones(2, 4, 3)}, conv={0: torch.ones(5, 4)},
                         key={3: torch.ones(64, 1, 8)}, value={3: torch.ones(64, 1, 8)})
    ctx = nl.build_naive_pack_context(SPLIT, SPLIT.packs[1], {0: state}, "cpu", DEFAULTS)
    assert ctx.n_external == 1 and not ctx.exports and torch.equal(ctx.external_key[3], state.key[3])
    assert ctx.gdn_calls[0].parent_rows.tolist() == [1] and ctx.gdn_calls[0].source is None  # the bank's row 1


def test_a_template_records_the_contexts_slots_and_bytes():
    ctx, layout, bank = nl.lay_out_pack(TAILS, TAILS.packs[0], {}, FastPathOptions(), pad=True, merge_levels=True)
    template = nl.record_template(ctx, layout, bank, TAILS, TAILS.packs[0])
    tensors = ctx.static_tensors()
    assert len(template.layout.slots) == len(tensors) and dict(template.context_fields)["input_ids"] == 0
    assert template.key_tail == ctx.graph_key[len(ctx.options.forward_key()):]
    real = [run for run in template.token_runs if run[0] >= 0]  # dummies: -1
    assert real == [(0, 64), (1, 16), (2, 3), (3, 2)] and len(real) < len(template.token_runs)
    assert sum(length for _, length in template.token_runs) == len(layout.token_ids)
    host_ids = template.host[: 8 * len(layout.token_ids)].view(torch.int64)  # slot 0 first in the int64 region
    assert host_ids.tolist() == layout.token_ids

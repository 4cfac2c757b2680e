"""The steps of ``build_pack_context`` (hf_openjev.packing.pack_context), each on small hand-made plans.

Three plans of one request whose two candidates share an 80-token state (64 tokens at a multiple of 64, then 16):

- ``TWO``: aligned sharing: segment 0 = the 64-token prefix, 1 and 2 = the candidates (19 and 18 tokens);
- ``TAILS``: exact sharing: 0 = the 64-token prefix, 1 = the 16-token tail (hands no state on), 2 and 3 = the
  candidates' own tokens (3 and 2);
- ``SPLIT``: ``TWO`` one candidate per pack: the prefix runs alone and exports its state, each candidate continues it.
"""

from __future__ import annotations

import pytest
import torch

from hf_openjev.fast_options import FastPathOptions
from hf_openjev.packing import pack_context as pc
from hf_openjev.packing.graph_buckets import bucket_sequences, bucket_tokens, pad_level
from hf_openjev.packing.planner import Pack

from aligned_plans import plan_requests  # the aligned layout these plans describe (tails: TAILS)

STATE = list(range(100, 180))  # 80 tokens
CANDIDATES = [[[STATE + [7, 8, 9], STATE + [5, 6]]]]
TWO = plan_requests(CANDIDATES)
TAILS = plan_requests(CANDIDATES, share_tails=True, min_shared_tokens=16)
SPLIT = plan_requests(CANDIDATES, max_sequences=1)
NO_EXTERNAL = pc.ExternalBlocks([], {}, {}, 0)
# two questions: a 40-token request tail, then each question's 20-token tail, then one own token per candidate
NESTED = plan_requests([[[list(range(100, 140)) + list(range(200, 220)) + [c] for c in (1, 2)],
                         [list(range(100, 140)) + list(range(300, 320)) + [c] for c in (3, 4)]]],
                       share_tails=True, min_shared_tokens=8)


def test_the_plans_are_the_ones_described():
    assert [(len(s.tokens), s.parent, s.hands_state) for s in TWO.segments] == [(64, None, True), (19, 0, True),
                                                                                (18, 0, True)]
    assert [(len(s.tokens), s.parent, s.hands_state) for s in TAILS.segments] == [
        (64, None, True), (16, 0, False), (3, 1, True), (2, 1, True)]
    assert [(p.segments, p.external, p.export) for p in SPLIT.packs] == [([0], [], [0]), ([1], [0], []),
                                                                         ([2], [0], [])]


# --- levels ------------------------------------------------------------------------------------------------------

def test_levels_count_ancestors_inside_the_pack():
    assert pc.group_levels(TWO, TWO.packs[0]) == [[0], [1, 2]]
    assert pc.group_levels(TAILS, TAILS.packs[0]) == [[0], [1], [2, 3]]
    assert pc.group_levels(SPLIT, SPLIT.packs[1]) == [[1]]  # its parent ran in an earlier pack


def test_anchors_are_the_nearest_state_handing_ancestor_and_the_tails_between():
    assert pc.find_anchors(TWO, TWO.packs[0]) == {0: ([], None), 1: ([], 0), 2: ([], 0)}
    assert pc.find_anchors(TAILS, TAILS.packs[0]) == {0: ([], None), 1: ([], 0), 2: ([1], 0), 3: ([1], 0)}
    assert pc.find_anchors(SPLIT, SPLIT.packs[1]) == {1: ([], 0)}
    # tails under tails: a 40-token request prefix, then 20-token question prefixes (all under 64: no anchor)
    assert pc.find_anchors(NESTED, NESTED.packs[0]) == {0: ([], None), 1: ([0], None), 2: ([0, 1], None),
                                                        3: ([0, 1], None), 4: ([0], None), 5: ([0, 4], None),
                                                        6: ([0, 4], None)}
    with pytest.raises(ValueError, match="segment 2 continues tail 1 from another pack"):
        pc.find_anchors(TAILS, Pack(segments=[2, 3], external=[1]))


def test_external_blocks_are_laid_end_to_end_in_pack_order():
    store = {0: pc.SegmentState(length=64), 5: pc.SegmentState(length=128)}
    blocks = pc.index_external(Pack(segments=[1], external=[5, 0]), store)
    assert (blocks.ids, blocks.offset, blocks.length, blocks.rows) == ([5, 0], {5: 0, 0: 128}, {5: 128, 0: 64}, 192)
    assert pc.index_external(TWO.packs[0], {}) == NO_EXTERNAL


# --- prefix routing -----------------------------------------------------------------------------------------------

def test_consecutive_prefix_blocks_are_read_in_place():
    prefix = list(range(64))
    route = pc.route_prefixes([prefix, prefix, []], 64, pad=False)
    assert route.chain_index is None
    assert route.prefix_starts.tolist() == [0, 0, 0, 64] and route.prefix_lengths.tolist() == [64, 64, 0]
    assert route.prefix_starts.dtype == route.prefix_lengths.dtype == torch.int32
    assert route.max_chain == 64
    assert pc.route_prefixes([prefix, []], 100, pad=True).max_chain == 100  # padded: the rows before the level


def test_split_prefix_chains_are_gathered_once_per_distinct_block():
    first, second = [0, 1, 2, 10, 11], [0, 1, 2, 20]  # a shared prefix, then each question's own rows
    route = pc.route_prefixes([first, first, second], 30, pad=False)
    assert route.chain_index.tolist() == [0, 1, 2, 10, 11, 0, 1, 2, 20]  # the repeated block once
    assert route.prefix_starts.tolist() == [0, 0, 5, 9] and route.prefix_lengths.tolist() == [5, 5, 4]
    assert route.max_chain == 5
    padded = pc.route_prefixes([first, first, second, []], 30, pad=True)
    assert padded.max_chain == bucket_tokens(9) == len(padded.chain_index) == 32
    assert padded.chain_index.tolist()[9:] == [0] * 23 and padded.prefix_lengths.tolist() == [5, 5, 4, 0]


# --- the layout ---------------------------------------------------------------------------------------------------

def test_levels_are_contiguous_and_children_continue_their_prefix_positions_and_keys():
    layout = pc.lay_out_levels(TWO, [[0], [1, 2]], NO_EXTERNAL, pad=False, dense_attention_tokens=2048)
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
    dense = pc.lay_out_levels(TWO, [[0], [1, 2]], NO_EXTERNAL, pad=False, dense_attention_tokens=64)
    assert [level.dense for level in dense.levels] == [True, False]  # the children are two and continue a prefix
    never = pc.lay_out_levels(TWO, [[0], [1, 2]], NO_EXTERNAL, pad=False, dense_attention_tokens=0)
    assert [level.dense for level in never.levels] == [False, False]


def test_padded_levels_end_with_dummy_sequences_from_position_zero():
    layout = pc.lay_out_levels(TWO, [[0], [1, 2]], NO_EXTERNAL, pad=True, dense_attention_tokens=2048)
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
    store = {0: pc.SegmentState(length=64)}
    pack = SPLIT.packs[1]
    external = pc.index_external(pack, store)
    layout = pc.lay_out_levels(SPLIT, pc.group_levels(SPLIT, pack), external, pad=False, dense_attention_tokens=2048)
    (level,) = layout.levels
    assert layout.start_of == {1: 0} and layout.positions == list(range(64, 83))
    assert layout.chain_rows[1] == list(range(64)) + list(range(64, 83))  # [external K/V ; pack K/V] rows
    assert level.has_parents and level.chain_index is None
    assert level.prefix_starts.tolist() == [0, 64] and level.prefix_lengths.tolist() == [64]


# --- Gated DeltaNet calls -----------------------------------------------------------------------------------------

def test_a_tail_and_its_children_share_one_gdn_call_and_a_level_reading_the_open_call_starts_another():
    anchors = pc.find_anchors(TAILS, TAILS.packs[0])
    assert pc.group_gdn_levels([[0], [1], [2, 3]], anchors) == [[0], [1, 2]]
    assert pc.group_gdn_levels([[0], [1], [2, 3]], anchors, merge=False) == [[0], [1], [2]]
    assert pc.group_gdn_levels([[0], [1, 2]], pc.find_anchors(TWO, TWO.packs[0])) == [[0], [1]]


def test_the_state_bank_numbers_calls_and_finds_a_source_call():
    bank = pc.StateBank([7])  # one state received from an earlier pack: bank row 1
    assert bank.row_of == {7: 1} and bank.next_row == 2 and bank.anchor_row(None) == 0 and bank.anchor_row(7) == 1
    source, rows = bank.add_call([0], [0, 0])  # a root and a dummy, from zeros
    assert source is None and rows.tolist() == [0, 0] and bank.row_of[0] == 2 and bank.spans == [(2, 4)]
    source, rows = bank.add_call([1, 2], [2, 2, 0])  # both children of 0, and a dummy: call 0's final states
    assert source == 0 and rows.tolist() == [0, 0, 0] and (bank.row_of[1], bank.row_of[2]) == (4, 5)
    source, rows = bank.add_call([3, 4], [5, 4])  # children of 2 and 1: rows of call 1
    assert source == 1 and rows.tolist() == [1, 0]
    source, rows = bank.add_call([5, 6], [5, 1])  # one from call 1, one from the received state: the bank
    assert source is None and rows.tolist() == [5, 1] and bank.next_row == 11


def test_a_gathered_call_re_runs_the_tail_rows_before_each_child():
    layout = pc.lay_out_levels(TAILS, [[0], [1], [2, 3]], NO_EXTERNAL, pad=False, dense_attention_tokens=2048)
    assert layout.start_of == {0: 0, 1: 64, 2: 80, 3: 83}
    anchors = pc.find_anchors(TAILS, TAILS.packs[0])
    rows, cu, keep = pc.gather_call_rows(TAILS, [1, 2, 3], anchors, layout, 64, 85)
    tail = list(range(64, 80))
    assert rows == tail + tail + [80, 81, 82] + tail + [83, 84]
    assert cu == [0, 16, 35, 53]
    assert keep == list(range(16)) + [32, 33, 34] + [51, 52]  # each pack row's own computation
    nested = pc.lay_out_levels(NESTED, pc.group_levels(NESTED, NESTED.packs[0]), NO_EXTERNAL, pad=False,
                               dense_attention_tokens=2048)
    assert nested.start_of == {0: 0, 1: 40, 4: 60, 2: 80, 3: 81, 5: 82, 6: 83}
    rows, cu, keep = pc.gather_call_rows(NESTED, [2, 5], pc.find_anchors(NESTED, NESTED.packs[0]), nested, 80, 84)
    assert rows == list(range(40)) + list(range(40, 60)) + [80] + list(range(40)) + list(range(60, 80)) + [82]
    assert cu == [0, 61, 122] and keep == [60, 0, 121, 0]  # root-most tail first; rows 81, 83: not in this call


def test_gdn_calls_over_a_level_and_over_a_gathered_layout():
    layout = pc.lay_out_levels(TAILS, [[0], [1], [2, 3]], NO_EXTERNAL, pad=False, dense_attention_tokens=2048)
    anchors = pc.find_anchors(TAILS, TAILS.packs[0])
    bank = pc.StateBank([])
    first = pc.build_gdn_call(TAILS, [0], layout, anchors, bank, pad=False)
    assert (first.first, first.last, first.lo, first.hi, first.rows, first.keep) == (0, 0, 0, 64, None, None)
    assert first.cu_seqlens is layout.levels[0].cu_seqlens  # its level's metadata, shared
    assert first.parent_rows.tolist() == [0] and not first.has_parents and first.source is None
    second = pc.build_gdn_call(TAILS, [1, 2], layout, anchors, bank, pad=False)
    assert (second.first, second.last, second.lo, second.hi) == (1, 2, 64, 85)
    assert second.cu_seqlens.tolist() == [0, 16, 35, 53] and len(second.rows) == 53 and len(second.keep) == 21
    assert second.has_parents and second.source == 0 and second.parent_rows.tolist() == [0, 0, 0]  # call 0's state
    assert bank.row_of == {0: 1, 1: 2, 2: 3, 3: 4}


def test_a_padded_gathered_call_gives_its_dummies_the_first_row():
    layout = pc.lay_out_levels(TAILS, [[0], [1], [2, 3]], NO_EXTERNAL, pad=True, dense_attention_tokens=2048)
    anchors = pc.find_anchors(TAILS, TAILS.packs[0])
    bank = pc.StateBank([])
    pc.build_gdn_call(TAILS, [0], layout, anchors, bank, pad=True)
    call = pc.build_gdn_call(TAILS, [1, 2], layout, anchors, bank, pad=True)
    dummies = pad_level([16, 19, 18])
    assert dummies and call.cu_seqlens.tolist()[:4] == [0, 16, 35, 53]
    assert call.rows.tolist()[53:] == [call.lo] * sum(dummies)
    assert call.parent_rows.tolist() == [0, 0, 0] + [0] * len(dummies) and call.source == 0


# --- inputs -------------------------------------------------------------------------------------------------------

def test_final_rows_are_the_last_token_of_each_scored_segment():
    layout = pc.lay_out_levels(TWO, [[0], [1, 2]], NO_EXTERNAL, pad=False, dense_attention_tokens=2048)
    assert pc.select_final_rows(TWO, TWO.packs[0], layout, pad=False) == ([1, 2], [82, 100])
    three = plan_requests([[[STATE + [7], STATE + [8], STATE + [9]]]])
    layout = pc.lay_out_levels(three, pc.group_levels(three, three.packs[0]), NO_EXTERNAL, pad=True,
                               dense_attention_tokens=2048)
    leaf_ids, rows = pc.select_final_rows(three, three.packs[0], layout, pad=True)
    assert leaf_ids == [1, 2, 3] and len(rows) == bucket_sequences(3) == 4 and rows[3] == 0


def test_graph_keys_follow_shapes_and_forward_options_only():
    other = plan_requests([[[[1] * 80 + [2, 3, 4], [1] * 80 + [6, 5]]]])  # other ids, the same shapes
    key = pc.build_pack_context(TWO, TWO.packs[0], {}, "cpu", pad=True).graph_key
    assert pc.build_pack_context(other, other.packs[0], {}, "cpu", pad=True).graph_key == key
    planner_only = FastPathOptions(min_shared_tokens=8, max_tokens=100, share_tails=True)
    assert pc.build_pack_context(TWO, TWO.packs[0], {}, "cpu", planner_only, pad=True).graph_key == key
    fp32 = pc.build_pack_context(TWO, TWO.packs[0], {}, "cpu", FastPathOptions(gdn_fp32=True), pad=True)
    assert fp32.graph_key != key and fp32.options.gdn_fp32
    assert pc.build_pack_context(TWO, TWO.packs[0], {}, "cpu").graph_key is None  # unpadded: no graph


def test_exports_and_received_states_are_attached():
    first = pc.build_pack_context(SPLIT, SPLIT.packs[0], {}, "cpu")
    ((seg, (row, rows, length)),) = first.exports.items()
    assert (seg, row, rows.tolist(), length) == (0, 1, list(range(64)), 64)  # bank row 1: the first call's state
    gen = torch.Generator().manual_seed(0)
    state = pc.SegmentState(64, gdn={0: torch.randn(2, 4, 3, generator=gen)}, conv={0: torch.randn(5, 4, generator=gen)},
                            key={3: torch.randn(64, 1, 8, generator=gen)}, value={3: torch.randn(64, 1, 8, generator=gen)})
    ctx = pc.build_pack_context(SPLIT, SPLIT.packs[1], {0: state}, "cpu")
    assert ctx.n_external == 1 and not ctx.exports
    assert torch.equal(ctx.external_gdn[0], state.gdn[0][None]) and torch.equal(ctx.external_conv[0], state.conv[0][None])
    assert torch.equal(ctx.external_key[3], state.key[3]) and torch.equal(ctx.external_value[3], state.value[3])
    assert ctx.gdn_calls[0].parent_rows.tolist() == [1] and ctx.gdn_calls[0].source is None  # the bank's row 1


def test_build_pack_context_runs_the_steps_in_order():
    """The context of the tails plan is the steps' results put together."""
    ctx = pc.build_pack_context(TAILS, TAILS.packs[0], {}, "cpu")
    layout = pc.lay_out_levels(TAILS, [[0], [1], [2, 3]], NO_EXTERNAL, pad=False, dense_attention_tokens=2048)
    assert ctx.input_ids.tolist() == layout.token_ids and ctx.positions.tolist() == layout.positions
    assert [(level.lo, level.hi) for level in ctx.levels] == [(level.lo, level.hi) for level in layout.levels]
    assert [(call.first, call.last, call.source) for call in ctx.gdn_calls] == [(0, 0, None), (1, 2, 0)]
    assert ctx.leaf_ids == [2, 3] and ctx.final_rows.tolist() == [82, 84]
    assert ctx.options == FastPathOptions()

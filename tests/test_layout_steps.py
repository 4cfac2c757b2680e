"""The tensor-free steps of a pack's layout (hf_openjev.packing.layout_steps), each on small hand-made plans
(tests/small_plans.py); the layouts they read are the reference's (naive_layout.lay_out_levels)."""

from __future__ import annotations

import pytest
from aligned_plans import plan_requests
from small_plans import NESTED, NO_EXTERNAL, SPLIT, STATE, TAILS, TWO

from hf_openjev.packing import layout_steps as steps
from hf_openjev.packing.graph_buckets import bucket_sequences
from hf_openjev.packing.naive_layout import lay_out_levels
from hf_openjev.packing.planner import Pack


def test_the_plans_are_the_ones_described():
    assert [(len(s.tokens), s.parent, s.hands_state) for s in TWO.segments] == [(64, None, True), (19, 0, True),
                                                                                (18, 0, True)]
    assert [(len(s.tokens), s.parent, s.hands_state) for s in TAILS.segments] == [
        (64, None, True), (16, 0, False), (3, 1, True), (2, 1, True)]
    assert [(p.segments, p.external, p.export) for p in SPLIT.packs] == [([0], [], [0]), ([1], [0], []),
                                                                         ([2], [0], [])]


# --- levels ------------------------------------------------------------------------------------------------------

def test_levels_count_ancestors_inside_the_pack():
    assert steps.group_levels(TWO, TWO.packs[0]) == [[0], [1, 2]]
    assert steps.group_levels(TAILS, TAILS.packs[0]) == [[0], [1], [2, 3]]
    assert steps.group_levels(SPLIT, SPLIT.packs[1]) == [[1]]  # its parent ran in an earlier pack


def test_anchors_are_the_nearest_state_handing_ancestor_and_the_tails_between():
    assert steps.find_anchors(TWO, TWO.packs[0]) == {0: ([], None), 1: ([], 0), 2: ([], 0)}
    assert steps.find_anchors(TAILS, TAILS.packs[0]) == {0: ([], None), 1: ([], 0), 2: ([1], 0), 3: ([1], 0)}
    assert steps.find_anchors(SPLIT, SPLIT.packs[1]) == {1: ([], 0)}
    # tails under tails: a 40-token request prefix, then 20-token question prefixes (all under 64: no anchor)
    assert steps.find_anchors(NESTED, NESTED.packs[0]) == {0: ([], None), 1: ([0], None), 2: ([0, 1], None),
                                                           3: ([0, 1], None), 4: ([0], None), 5: ([0, 4], None),
                                                           6: ([0, 4], None)}
    with pytest.raises(ValueError, match="segment 2 continues tail 1 from another pack"):
        steps.find_anchors(TAILS, Pack(segments=[2, 3], external=[1]))


def test_external_blocks_are_laid_end_to_end_in_pack_order():
    store = {0: steps.SegmentState(length=64), 5: steps.SegmentState(length=128)}
    blocks = steps.index_external(Pack(segments=[1], external=[5, 0]), store)
    assert (blocks.ids, blocks.offset, blocks.length, blocks.rows) == ([5, 0], {5: 0, 0: 128}, {5: 128, 0: 64}, 192)
    assert steps.index_external(TWO.packs[0], {}) == NO_EXTERNAL


# --- Gated DeltaNet calls -----------------------------------------------------------------------------------------

def test_a_tail_and_its_children_share_one_gdn_call_and_a_level_reading_the_open_call_starts_another():
    anchors = steps.find_anchors(TAILS, TAILS.packs[0])
    assert steps.group_gdn_levels([[0], [1], [2, 3]], anchors) == [[0], [1, 2]]
    assert steps.group_gdn_levels([[0], [1], [2, 3]], anchors, merge=False) == [[0], [1], [2]]
    assert steps.group_gdn_levels([[0], [1, 2]], steps.find_anchors(TWO, TWO.packs[0])) == [[0], [1]]


def test_the_state_bank_numbers_calls_and_finds_a_source_call():
    bank = steps.StateBank([7])  # one state received from an earlier pack: bank row 1
    assert bank.row_of == {7: 1} and bank.next_row == 2 and bank.anchor_row(None) == 0 and bank.anchor_row(7) == 1
    source, rows = bank.add_call_rows([0], [0, 0])  # a root and a dummy, from zeros
    assert source is None and rows == [0, 0] and bank.row_of[0] == 2 and bank.spans == [(2, 4)]
    source, rows = bank.add_call_rows([1, 2], [2, 2, 0])  # both children of 0, and a dummy: call 0's final states
    assert source == 0 and rows == [0, 0, 0] and (bank.row_of[1], bank.row_of[2]) == (4, 5)
    source, rows = bank.add_call_rows([3, 4], [5, 4])  # children of 2 and 1: rows of call 1
    assert source == 1 and rows == [1, 0]
    source, rows = bank.add_call_rows([5, 6], [5, 1])  # one from call 1, one from the received state: the bank
    assert source is None and rows == [5, 1] and bank.next_row == 11


def test_a_gathered_call_re_runs_the_tail_rows_before_each_child():
    layout = lay_out_levels(TAILS, [[0], [1], [2, 3]], NO_EXTERNAL, pad=False, dense_attention_tokens=2048)
    assert layout.start_of == {0: 0, 1: 64, 2: 80, 3: 83}
    anchors = steps.find_anchors(TAILS, TAILS.packs[0])
    rows, cu, keep = steps.gather_call_rows(TAILS, [1, 2, 3], anchors, layout, 64, 85)
    tail = list(range(64, 80))
    assert rows == tail + tail + [80, 81, 82] + tail + [83, 84]
    assert cu == [0, 16, 35, 53]
    assert keep == list(range(16)) + [32, 33, 34] + [51, 52]  # each pack row's own computation
    nested = lay_out_levels(NESTED, steps.group_levels(NESTED, NESTED.packs[0]), NO_EXTERNAL, pad=False,
                            dense_attention_tokens=2048)
    assert nested.start_of == {0: 0, 1: 40, 4: 60, 2: 80, 3: 81, 5: 82, 6: 83}
    rows, cu, keep = steps.gather_call_rows(NESTED, [2, 5], steps.find_anchors(NESTED, NESTED.packs[0]), nested, 80,
                                            84)
    assert rows == list(range(40)) + list(range(40, 60)) + [80] + list(range(40)) + list(range(60, 80)) + [82]
    assert cu == [0, 61, 122] and keep == [60, 0, 121, 0]  # root-most tail first; rows 81, 83: not in this call


# --- inputs -------------------------------------------------------------------------------------------------------

def test_final_rows_are_the_last_token_of_each_scored_segment():
    layout = lay_out_levels(TWO, [[0], [1, 2]], NO_EXTERNAL, pad=False, dense_attention_tokens=2048)
    assert steps.select_final_rows(TWO, TWO.packs[0], layout, pad=False) == ([1, 2], [82, 100])
    three = plan_requests([[[STATE + [7], STATE + [8], STATE + [9]]]])
    layout = lay_out_levels(three, steps.group_levels(three, three.packs[0]), NO_EXTERNAL, pad=True,
                            dense_attention_tokens=2048)
    leaf_ids, rows = steps.select_final_rows(three, three.packs[0], layout, pad=True)
    assert leaf_ids == [1, 2, 3] and len(rows) == bucket_sequences(3) == 4 and rows[3] == 0

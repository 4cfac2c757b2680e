"""hf_openjev.packing.planner: the exact token prefix tree of each request, the sharing policy, and packing.

Requests are built by hand from disjoint token ranges so that every common prefix has an exact, known length:
the request prefix uses tokens 1000.., question ``q``'s prefix starts with token ``2000 + 100 q`` and each
candidate's own part starts with a token no other candidate of its question has.
"""

from __future__ import annotations

import random

import pytest
import torch
from aligned_plans import ALIGNED, build_tree, plan_requests  # most tests here describe the aligned layout

from hf_openjev.packing import planner
from hf_openjev.packing.planner import (
    ALIGN,
    DEFAULT_MAX_SEQUENCES,
    DEFAULT_MAX_TOKENS,
    Pack,
    Plan,
    Segment,
    common_prefix_length,
    shareable_length,
)

DEFAULT_MIN_SHARED_TOKENS = ALIGNED["min_shared_tokens"]


def test_the_default_plan_shares_exact_prefixes_from_16_tokens():
    assert (planner.DEFAULT_SHARE_TAILS, planner.DEFAULT_MIN_SHARED_TOKENS) == (True, 16)
    request = [[list(range(100, 130)) + [1, 2], list(range(100, 130)) + [3]]]  # a 30-token common prefix
    default = planner.plan_requests([request])
    assert default == planner.plan_requests([request], share_tails=True, min_shared_tokens=16)
    assert [len(s.tokens) for s in default.segments] == [30, 2, 1]  # shared exactly, as a tail
    assert [len(s.tokens) for s in plan_requests([request]).segments] == [32, 31]  # aligned: nothing shared

torch.set_num_threads(1)


# --- request builders -----------------------------------------------------------------------------------------

def request_prefix(n: int) -> list[int]:
    return [1000 + i for i in range(n)]


def question_prefix(q: int, n: int) -> list[int]:
    return [2000 + 100 * q + i for i in range(n)]


def own(q: int, c: int, n: int) -> list[int]:
    """A candidate's own tokens: the first one differs from every other candidate's."""
    return [5000 + 1000 * q + 10 * c] + [7 + (c + i) % 5 for i in range(n - 1)]


def make_request(rp: int, questions: list[tuple[int, list[int]]]) -> list[list[list[int]]]:
    """``rp`` request-prefix tokens, then per question (question-prefix length, [own length per candidate])."""
    out = []
    for q, (qp, owns) in enumerate(questions):
        out.append([request_prefix(rp) + question_prefix(q, qp) + own(q, c, n) for c, n in enumerate(owns)])
    return out


def leaves(plan: Plan) -> list[Segment]:
    return [s for s in plan.segments if s.leaf is not None]


def chain_tokens(plan: Plan, segment_id: int) -> list[int]:
    return [t for s in plan.chain(segment_id) for t in plan.segments[s].tokens]


def check_plan(plan: Plan, requests, *, max_sequences: int = DEFAULT_MAX_SEQUENCES,
               max_tokens: int = DEFAULT_MAX_TOKENS, align: int = ALIGN, shared_prefix: bool = True,
               min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS, share_tails: bool = False,
               prefix_packs_within_max_tokens: bool = False) -> None:
    """Every invariant of a plan, checked from the outside.

    The token limit of packs that hold only shared prefixes (the first pack of a split tree) is checked only
    with ``prefix_packs_within_max_tokens`` (see ``test_prefix_pack_respects_max_tokens``).
    """
    segments = plan.segments
    assert [s.id for s in segments] == list(range(len(segments)))
    # the tree: segments reassemble exactly into every candidate; prefixes are aligned and long enough
    expected_leaves = {(r, q, c) for r, qs in enumerate(requests) for q, cs in enumerate(qs) for c in range(len(cs))}
    seen = set()
    for seg in segments:
        parent = segments[seg.parent] if seg.parent is not None else None
        assert seg.start == (parent.end if parent else 0)
        if parent is not None:
            assert parent.request == seg.request and parent.leaf is None
            assert parent.id < seg.id
        if seg.leaf is None and not seg.hands_state:  # a tail: past the last multiple of align of a prefix
            assert share_tails and shared_prefix
            assert seg.end % align != 0 and seg.start >= seg.end // align * align
            assert parent is None or parent.end % align == 0 or not parent.hands_state or parent.end == seg.start
            users = [leaf for leaf in leaves(plan) if seg.id in plan.chain(leaf.id)]
            assert len(users) >= 2
            tree_pack = {i for i, pack in enumerate(plan.packs) for t in pack.segments
                         if segments[t].request == seg.request}
            assert len(tree_pack) == 1, "a tree with a tail runs in one pack"
        elif seg.leaf is None:  # a shared prefix: hands on its state at a multiple of align, used by >= 2 leaves
            assert shared_prefix
            assert seg.end % align == 0
            if share_tails:
                assert seg.start % align == 0 or (parent is not None and not parent.hands_state)
            else:
                assert seg.start % align == 0 and len(seg.tokens) >= min_shared_tokens
            users = [leaf for leaf in leaves(plan) if seg.id in plan.chain(leaf.id)]
            assert len(users) >= 2
        else:
            assert len(seg.tokens) >= 1  # the scored token is always computed in the candidate's own segment
            q, c = seg.leaf
            key = (seg.request, q, c)
            assert key not in seen
            seen.add(key)
            assert chain_tokens(plan, seg.id) == list(requests[seg.request][q][c])
            assert seg.end == len(requests[seg.request][q][c])
    assert seen == expected_leaves
    # shared tokens = token positions a per-candidate forward would compute - positions the plan computes
    assert len(plan.shared_tokens) == len(requests)
    for r, qs in enumerate(requests):
        per_candidate = sum(len(seq) for cs in qs for seq in cs)
        computed = sum(len(s.tokens) for s in segments if s.request == r)
        assert plan.shared_tokens[r] == per_candidate - computed
    # packs: every segment exactly once; parents before children or exported by an earlier pack
    placed = [s for pack in plan.packs for s in pack.segments]
    assert sorted(placed) == list(range(len(segments)))
    exported: set[int] = set()
    for pack in plan.packs:
        assert pack.segments, "no empty pack"
        here: set[int] = set()
        pack_leaves = pack.leaves(plan)
        assert len(pack_leaves) <= max_sequences
        within = pack.tokens(plan) <= max_tokens or len(pack.segments) == 1
        assert within or not (pack_leaves or prefix_packs_within_max_tokens), (
            f"pack of {len(pack.segments)} segments has {pack.tokens(plan)} > {max_tokens} tokens")
        for s in pack.segments:
            parent = segments[s].parent
            if parent is not None and parent not in here:
                assert parent in pack.external, f"segment {s}: parent {parent} neither earlier in pack nor external"
                assert parent in exported, f"external {parent} was not exported by an earlier pack"
            here.add(s)
        for e in pack.external:
            assert e not in here and any(segments[s].parent == e for s in pack.segments)
        for e in pack.export:
            assert e in here and segments[e].leaf is None
        exported.update(pack.export)


# --- common_prefix_length / shareable_length ---------------------------------------------------------------------

def test_common_prefix_length():
    assert common_prefix_length([]) == 0
    assert common_prefix_length([[1, 2, 3]]) == 3
    assert common_prefix_length([[1, 2, 3], [1, 2, 3]]) == 3
    assert common_prefix_length([[1, 2, 3], [1, 2]]) == 2
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 5]]) == 1
    assert common_prefix_length([[9, 2], [1, 2]]) == 0
    assert common_prefix_length([[1, 2], []]) == 0
    assert common_prefix_length([(1, 2, 3, 4), (1, 2, 3, 5)]) == 3  # any sequence type


@pytest.mark.parametrize("common, length, expected", [
    (63, 100, 0), (64, 100, 64), (65, 100, 64), (127, 200, 64), (128, 200, 128), (129, 200, 128),
    (128, 128, 64),  # identical sequences of 128 tokens: each keeps >= 1 own token, so only 64 are shareable
    (64, 64, 0), (64, 65, 64), (200, 200, 192), (0, 10, 0),
])
def test_shareable_length_is_common_and_aligned_and_leaves_one_token(common, length, expected):
    a = list(range(common)) + [10_000 + i for i in range(length - common)]
    b = list(range(common)) + [20_000 + i for i in range(length - common)]
    assert common_prefix_length([a, b]) == common
    assert shareable_length([a, b]) == expected
    assert shareable_length([a, b, a]) == expected


def test_shareable_length_needs_two_sequences_and_honours_align():
    seq = list(range(300))
    assert shareable_length([]) == 0
    assert shareable_length([seq]) == 0
    assert shareable_length([seq, seq[:100]]) == 64
    assert shareable_length([seq, seq[:100]], align=10) == 90
    assert shareable_length([seq, seq[:100]], align=1) == 99
    assert shareable_length([seq, seq], align=1) == 299


# --- build_tree: exact trees -------------------------------------------------------------------------------------

@pytest.mark.parametrize("rp, root", [(63, 0), (64, 64), (65, 64), (127, 64), (128, 128), (129, 128), (191, 128),
                                      (192, 192)])
def test_request_prefix_is_cut_at_a_multiple_of_64(rp, root):
    request = make_request(rp, [(0, [3, 1, 5])])  # one question: its prefix is the request prefix
    segments, shared = build_tree(0, request, 0)
    seqs = request[0]
    if root:
        assert segments[0] == Segment(0, tuple(request_prefix(root)), None, 0, 0, None)
        assert segments[1:] == [Segment(1 + c, tuple(seq[root:]), 0, root, 0, (0, c)) for c, seq in enumerate(seqs)]
    else:
        assert segments == [Segment(c, tuple(seq), None, 0, 0, (0, c)) for c, seq in enumerate(seqs)]
    assert shared == root * 2


def test_tree_ids_start_at_next_id_and_carry_the_request_index():
    request = make_request(70, [(0, [1, 1])])
    segments, _ = build_tree(7, request, 40)
    assert [s.id for s in segments] == [40, 41, 42]
    assert {s.request for s in segments} == {7}
    assert [s.parent for s in segments] == [None, 40, 40]


def test_min_shared_tokens_threshold():
    request = make_request(128, [(0, [2, 2])])
    for threshold, root in [(1, 128), (64, 128), (65, 128), (128, 128), (129, 0), (10_000, 0)]:
        segments, shared = build_tree(0, request, 0, min_shared_tokens=threshold)
        prefixes = [s for s in segments if s.leaf is None]
        assert [len(s.tokens) for s in prefixes] == ([root] if root else [])
        assert shared == root
        assert all(len(s.tokens) == len(seq) - root for s, seq in zip(segments[len(prefixes):], request[0]))


def test_shared_prefix_false_gives_one_segment_per_candidate():
    request = make_request(300, [(70, [1, 2]), (0, [4])])
    segments, shared = build_tree(0, request, 0, shared_prefix=False)
    expected = [seq for q in request for seq in q]
    assert [list(s.tokens) for s in segments] == expected
    assert all(s.parent is None and s.start == 0 for s in segments)
    assert [s.leaf for s in segments] == [(0, 0), (0, 1), (1, 0)]
    assert shared == 0


def test_request_prefix_then_question_prefixes():
    # request prefix 70 (-> 64 shared by all 5 candidates); question 0 adds 70 (common 140 -> 128: 64 more),
    # question 1 adds 20 (common 90 -> 64: nothing beyond the root), question 2 has a single candidate.
    request = make_request(70, [(70, [1, 3]), (20, [2, 2]), (200, [5])])
    segments, shared = build_tree(0, request, 0)
    root = Segment(0, tuple(request_prefix(64)), None, 0, 0, None)
    qp0 = Segment(1, tuple((request_prefix(70) + question_prefix(0, 70))[64:128]), 0, 64, 0, None)
    q0, q1, q2 = request
    assert segments == [
        root,
        qp0,
        Segment(2, tuple(q0[0][128:]), 1, 128, 0, (0, 0)),
        Segment(3, tuple(q0[1][128:]), 1, 128, 0, (0, 1)),
        Segment(4, tuple(q1[0][64:]), 0, 64, 0, (1, 0)),
        Segment(5, tuple(q1[1][64:]), 0, 64, 0, (1, 1)),
        Segment(6, tuple(q2[0][64:]), 0, 64, 0, (2, 0)),
    ]
    assert shared == 64 * 4 + 64 * 1


def test_question_prefix_without_a_request_prefix():
    # questions diverge at token 0: no root; each question's candidates share their own prefix
    request = [[question_prefix(0, 130) + own(0, c, 2) for c in range(3)],
               [question_prefix(1, 64) + own(1, c, 1) for c in range(2)],
               [question_prefix(2, 63) + own(2, c, 1) for c in range(2)]]
    segments, shared = build_tree(0, request, 0)
    assert [(len(s.tokens), s.parent, s.start, s.leaf) for s in segments] == [
        (128, None, 0, None), (4, 0, 128, (0, 0)), (4, 0, 128, (0, 1)), (4, 0, 128, (0, 2)),
        (64, None, 0, None), (1, 4, 64, (1, 0)), (1, 4, 64, (1, 1)),
        (64, None, 0, (2, 0)), (64, None, 0, (2, 1)),
    ]
    assert shared == 128 * 2 + 64


def test_question_prefix_must_add_min_shared_tokens_beyond_the_root():
    request = make_request(64, [(100, [1, 1]), (0, [1, 1])])  # q0 common 164 -> 128, 64 beyond the root
    assert [len(s.tokens) for s in build_tree(0, request, 0)[0] if s.leaf is None] == [64, 64]
    # no root (64 < 65): question 0's prefix is then its whole aligned common prefix, 128 from position 0
    segments, shared = build_tree(0, request, 0, min_shared_tokens=65)
    assert [(len(s.tokens), s.start) for s in segments if s.leaf is None] == [(128, 0)]
    assert shared == 128
    assert [len(s.tokens) for s in build_tree(0, request, 0, min_shared_tokens=129)[0] if s.leaf is None] == []
    request = make_request(128, [(100, [1, 1]), (0, [1, 1])])  # root 128, q0 common 228 -> 192
    segments, shared = build_tree(0, request, 0, min_shared_tokens=65)
    assert [len(s.tokens) for s in segments if s.leaf is None] == [128]  # 64 beyond the root < 65: not shared
    assert shared == 128 * 3


def test_single_candidate_questions_share_only_the_request_prefix():
    request = make_request(100, [(0, [1]), (50, [1]), (300, [1])])
    segments, shared = build_tree(0, request, 0)
    assert [(len(s.tokens), s.parent, s.leaf) for s in segments] == [
        (64, None, None), (37, 0, (0, 0)), (87, 0, (1, 0)), (337, 0, (2, 0))]
    assert shared == 64 * 2
    # one candidate in the whole request: nothing to share
    request = make_request(500, [(0, [3])])
    segments, shared = build_tree(0, request, 0)
    assert [(len(s.tokens), s.parent, s.leaf) for s in segments] == [(503, None, (0, 0))]
    assert shared == 0


@pytest.mark.parametrize("length", [1, 63, 64, 65, 128, 129])
def test_identical_candidates_keep_at_least_one_own_token(length):
    seq = list(range(length))
    segments, shared = build_tree(0, [[seq, seq, seq]], 0)
    root = (length - 1) // 64 * 64
    assert [len(s.tokens) for s in segments] == ([root] if root else []) + [length - root] * 3
    assert shared == 2 * root
    for s in segments:
        if s.leaf is not None:
            assert len(s.tokens) >= 1 and list(s.tokens) == seq[root:]


def test_candidate_that_is_a_prefix_of_another():
    long, short = list(range(200)), list(range(129))  # common 129, shortest 129 -> limit 128
    segments, _ = build_tree(0, [[long, short]], 0)
    assert [(len(s.tokens), s.start) for s in segments] == [(128, 0), (72, 128), (1, 128)]


def test_one_token_suffixes_after_a_long_prefix():
    request = make_request(256, [(0, [1] * 10)])  # a 10-level score: ten one-token suffixes
    segments, shared = build_tree(0, request, 0)
    assert [len(s.tokens) for s in segments] == [256] + [1] * 10
    assert shared == 256 * 9


@pytest.mark.parametrize("rp, segments", [
    (38, [(38, 0, False)]), (63, [(63, 0, False)]), (64, [(64, 0, True)]), (100, [(64, 0, True), (36, 64, False)]),
    (128, [(128, 0, True)]), (129, [(128, 0, True), (1, 128, False)])])
def test_share_tails_shares_the_exact_prefix_and_marks_its_tail(rp, segments):
    request = make_request(rp, [(0, [3, 1, 5])])
    tree, shared = build_tree(0, request, 0, share_tails=True, min_shared_tokens=16)
    prefixes = [(len(s.tokens), s.start, s.hands_state) for s in tree if s.leaf is None]
    assert prefixes == segments
    assert [(s.start, s.parent) for s in tree if s.leaf is not None] == [(rp, len(segments) - 1)] * 3
    assert shared == rp * 2
    aligned, _ = build_tree(0, request, 0, min_shared_tokens=16)  # without tails: cut at the multiple of 64
    assert [len(s.tokens) for s in aligned if s.leaf is None] == ([rp // 64 * 64] if rp >= 64 else [])


def test_share_tails_question_prefixes_continue_a_root_tail():
    # root 38 (a tail from 0); question 0 adds 62 (common 100): [38, 64) hands on the state at 64, [64, 100) is a
    # tail; question 1 adds 20 (common 58): all of [38, 58) is a tail continuing the root's tail
    request = make_request(38, [(62, [1, 3]), (20, [2, 2])])
    tree, shared = build_tree(0, request, 0, share_tails=True, min_shared_tokens=16)
    assert [(len(s.tokens), s.start, s.parent, s.hands_state, s.leaf) for s in tree] == [
        (38, 0, None, False, None), (26, 38, 0, True, None), (36, 64, 1, False, None),
        (1, 100, 2, True, (0, 0)), (3, 100, 2, True, (0, 1)),
        (20, 38, 0, False, None), (2, 58, 5, True, (1, 0)), (2, 58, 5, True, (1, 1))]
    assert shared == 38 * 3 + 62 + 20


def test_a_tree_with_tails_too_large_for_a_pack_is_planned_without_them():
    request = make_request(100, [(0, [1] * 5)])
    assert not all(s.hands_state for s in plan_requests([request], share_tails=True).segments)
    plan = plan_requests([request], share_tails=True, max_sequences=3)
    assert all(s.hands_state for s in plan.segments) and len(plan.packs) == 3  # prefix, 3 + 2 candidates
    assert plan.shared_tokens == [64 * 4]
    check_plan(plan, [request], max_sequences=3, share_tails=True)


def test_align_parameter():
    request = make_request(100, [(0, [1, 1])])
    assert [len(s.tokens) for s in build_tree(0, request, 0, align=32, min_shared_tokens=32)[0]] == [96, 5, 5]
    assert [len(s.tokens) for s in build_tree(0, request, 0, align=1, min_shared_tokens=1)[0]] == [100, 1, 1]


# --- plan_requests: packing ------------------------------------------------------------------------------------

def test_small_requests_share_one_pack_in_order():
    requests = [make_request(10, [(0, [2, 3])]), make_request(70, [(0, [1, 1, 1])]), make_request(5, [(0, [1])])]
    plan = plan_requests(requests)
    check_plan(plan, requests)
    assert len(plan.packs) == 1
    assert plan.packs[0].segments == list(range(len(plan.segments)))
    assert plan.packs[0].external == [] and plan.packs[0].export == []
    assert plan.shared_tokens == [0, 128, 0]
    assert [s.request for s in plan.segments] == [0, 0, 1, 1, 1, 1, 2]


def test_max_sequences_closes_packs_at_tree_boundaries():
    requests = [make_request(10, [(0, [1] * 6)]) for _ in range(3)]
    plan = plan_requests(requests)
    check_plan(plan, requests)
    assert [[plan.segments[s].request for s in p.segments] for p in plan.packs] == [[0] * 6 + [1] * 6, [2] * 6]
    plan = plan_requests(requests, max_sequences=6)
    check_plan(plan, requests, max_sequences=6)
    assert len(plan.packs) == 3
    plan = plan_requests(requests, max_sequences=18)
    assert len(plan.packs) == 1


def test_max_tokens_closes_packs():
    requests = [[[list(range(i * 10_000, i * 10_000 + 1000))]] for i in range(5)]
    plan = plan_requests(requests)
    check_plan(plan, requests)
    assert [p.segments for p in plan.packs] == [[0, 1, 2, 3], [4]]  # 4000 <= 4096 < 5000
    plan = plan_requests(requests, max_tokens=2000)
    check_plan(plan, requests, max_tokens=2000)
    assert [p.segments for p in plan.packs] == [[0, 1], [2, 3], [4]]
    assert [p.tokens(plan) for p in plan.packs] == [2000, 2000, 1000]


def test_a_sequence_longer_than_max_tokens_runs_alone_untruncated():
    long = list(range(5000))
    requests = [[[[1, 2, 3]]], [[long]], [[[4, 5]]]]
    plan = plan_requests(requests)
    check_plan(plan, requests)
    alone = [p for p in plan.packs if 1 in p.segments]
    assert len(alone) == 1 and alone[0].segments == [1]
    assert plan.segments[1].tokens == tuple(long)
    assert sorted(s for p in plan.packs if p is not alone[0] for s in p.segments) == [0, 2]
    # also inside a request whose tree must be split (no prefix to share)
    requests = [[[long, [9] * 10, [8] * 10]]]
    plan = plan_requests(requests, max_tokens=100)
    check_plan(plan, requests, max_tokens=100)
    assert [p.segments for p in plan.packs] == [[0], [1, 2]]


def test_a_tree_with_too_many_candidates_is_split_after_its_prefix():
    request = make_request(128, [(0, [1] * 20)])
    plan = plan_requests([request])
    check_plan(plan, [request])
    assert plan.packs == [Pack(segments=[0], external=[], export=[0]),
                          Pack(segments=list(range(1, 17)), external=[0], export=[]),
                          Pack(segments=list(range(17, 21)), external=[0], export=[])]
    assert plan.shared_tokens == [128 * 19]


def test_a_tree_with_too_many_tokens_is_split_and_later_packs_list_their_externals():
    request = make_request(64, [(70, [30, 30]), (0, [30, 30]), (100, [30])])
    plan = plan_requests([request], max_tokens=200)
    check_plan(plan, [request], max_tokens=200, prefix_packs_within_max_tokens=True)
    seg = plan.segments
    prefixes = [s.id for s in seg if s.leaf is None]
    assert [len(seg[s].tokens) for s in prefixes] == [64, 64]
    assert plan.packs[0] == Pack(segments=prefixes, external=[], export=prefixes)
    leaf_packs = plan.packs[1:]
    # leaves: 36 + 36 + 30 + 30 = 132 tokens, then 130 more would pass 200
    assert [[len(seg[s].tokens) for s in p.segments] for p in leaf_packs] == [[36, 36, 30, 30], [130]]
    assert [[seg[s].leaf for s in p.segments] for p in leaf_packs] == [[(0, 0), (0, 1), (1, 0), (1, 1)], [(2, 0)]]
    assert [p.external for p in leaf_packs] == [[1, 0], [0]]
    assert [seg[s].parent for s in leaf_packs[0].segments] == [1, 1, 0, 0]


def test_split_trees_and_whole_trees_mixed():
    small = make_request(0, [(0, [2, 2])])
    big = make_request(200, [(0, [1] * 5)])
    requests = [small, big, small]
    plan = plan_requests(requests, max_sequences=4)
    check_plan(plan, requests, max_sequences=4)
    assert plan.shared_tokens == [0, 192 * 4, 0]


def test_prefix_pack_respects_max_tokens():
    # Many questions, each with its own long prefix: the prefixes of a split tree must not all go into one
    # pack of 6 x 64 = 384 tokens when max_tokens is 200 (issue 5: packs of at most max_tokens tokens; only a
    # single over-long sequence may exceed it).
    request = make_request(64, [(70, [1, 1]) for _ in range(5)])
    plan = plan_requests([request], max_tokens=200, max_sequences=4)
    check_plan(plan, [request], max_tokens=200, max_sequences=4, prefix_packs_within_max_tokens=True)


@pytest.mark.parametrize("seed", range(40))
def test_random_plans_keep_every_invariant(seed):
    rng = random.Random(seed)
    requests = []
    for r in range(rng.randint(1, 5)):
        rp = rng.choice([0, 1, 63, 64, 65, 127, 128, 129, 200])
        questions = []
        for q in range(rng.randint(1, 4)):
            qp = rng.choice([0, 0, 1, 63, 64, 65, 130])
            n = rng.choice([1, 1, 2, 3, 10, 20])
            questions.append((qp, [rng.choice([1, 1, 2, 5, 70]) for _ in range(n)]))
        request = make_request(rp, questions)
        if rng.random() < 0.2:  # identical candidates
            request[0] = [request[0][0]] * len(request[0])
        requests.append(request)
    options = dict(max_sequences=rng.choice([1, 2, 3, 16]), max_tokens=rng.choice([1, 50, 300, 4096]),
                   min_shared_tokens=rng.choice([1, 64, 65, 128]), shared_prefix=rng.random() < 0.8,
                   share_tails=rng.random() < 0.5)
    plan = plan_requests(requests, **options)
    check_plan(plan, requests, **options)


def test_shared_tokens_counts():
    requests = [make_request(130, [(0, [1] * 4)]),  # 128 saved 3 times
                make_request(64, [(64, [2, 2, 2]), (0, [5])]),  # root 64 (x3), q0 prefix 64 (x2)
                make_request(500, [(0, [3])])]  # alone
    plan = plan_requests(requests)
    assert plan.shared_tokens == [128 * 3, 64 * 3 + 64 * 2, 0]
    assert plan_requests(requests, shared_prefix=False).shared_tokens == [0, 0, 0]
    # no root below 100 tokens in request 1: its question 0 then shares its whole 128-token prefix
    assert plan_requests(requests, min_shared_tokens=100).shared_tokens == [128 * 3, 128 * 2, 0]
    assert plan_requests(requests, min_shared_tokens=129).shared_tokens == [0, 0, 0]


def test_plan_chain_walks_from_the_root():
    request = make_request(64, [(64, [1, 1]), (0, [1])])
    plan = plan_requests([request])
    assert [(len(s.tokens), s.parent) for s in plan.segments] == [(64, None), (64, 0), (1, 1), (1, 1), (1, 0)]
    assert plan.chain(0) == [0]
    assert plan.chain(2) == [0, 1, 2]
    assert plan.chain(4) == [0, 4]
    assert chain_tokens(plan, 3) == request[0][1]
    assert chain_tokens(plan, 4) == request[1][0]


def test_empty_input_gives_an_empty_plan():
    plan = plan_requests([])
    assert plan.segments == [] and plan.packs == [] and plan.shared_tokens == []


@pytest.mark.parametrize("option", [dict(max_sequences=0), dict(max_tokens=0), dict(min_shared_tokens=0),
                                    dict(align=0), dict(max_sequences=-1), dict(max_tokens=-5)])
def test_invalid_options_are_refused(option):
    with pytest.raises(ValueError):
        plan_requests([make_request(0, [(0, [1])])], **option)


def test_an_empty_candidate_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        plan_requests([[[[1, 2, 3], []]]])


def test_plan_with_options_follows_the_fast_path_options():
    """``plan_with_options`` plans as ``score_fast`` does: packed candidates share packs, ``packed_candidates`` off
    puts each candidate in a pack of its own, and ``shared_prefix`` off keeps every candidate whole."""
    from hf_openjev.fast_options import FastPathOptions

    prefix = list(range(1000, 1100))
    request = [[prefix + [3000 + 10 * c + i for i in range(20)] for c in range(3)]]
    packed = planner.plan_with_options([request], FastPathOptions())
    assert [len(pack.leaves(packed)) for pack in packed.packs] == [3]
    alone = planner.plan_with_options([request], FastPathOptions(packed_candidates=False))
    assert max(len(pack.leaves(alone)) for pack in alone.packs) == 1
    assert sum(len(pack.leaves(alone)) for pack in alone.packs) == 3
    whole = planner.plan_with_options([request], FastPathOptions(packed_candidates=False, shared_prefix=False))
    assert sorted(pack.tokens(whole) for pack in whole.packs) == [120, 120, 120]

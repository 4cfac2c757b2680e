"""What a request costs (hf_openjev.work_tokens), the batches bounded by tokens, and the per-request cap that
counts it (issue 36 item 5): the fast path's shared prefixes once, a running floor that never passes the exact count, and the conformance suite's
255-option choice admitted under the default cap."""

from __future__ import annotations

import random

import pytest
from test_server_abuse import ByteLevel, conformance_choice

from hf_openjev.contract import MSG_TOO_MANY_TOKENS, RequestError, parse_request
from hf_openjev.fast_options import FastPathOptions
from hf_openjev.packing.planner import plan_requests
from hf_openjev.scoring import tokenize_request
from hf_openjev.serve.limits import DEFAULT_MAX_REQUEST_TOKENS
from hf_openjev.work_tokens import (
    DEFAULT_BATCH_TOKENS,
    WorkFloor,
    check_batch_tokens,
    count_work_tokens,
    split_by_tokens,
    split_padded,
)


def random_request(rng: random.Random) -> list:
    """tokens[question][candidate]: shared request and question prefixes of random lengths, random suffixes."""
    root = [rng.randrange(50) for _ in range(rng.choice([0, 5, 70, 140]))]
    questions = []
    for _ in range(rng.randint(1, 4)):
        head = root + [rng.randrange(50) for _ in range(rng.choice([0, 3, 20, 90]))]
        questions.append([head + [rng.randrange(50) for _ in range(rng.randint(1, 40))]
                          for _ in range(rng.randint(1, 12))])
    return questions


def test_the_fast_path_counts_a_shared_prefix_once_and_the_reference_path_counts_every_sequence():
    prefix = list(range(250))
    tokens = [[prefix + [1000 + i, 7, 8] for i in range(255)]]
    full = 255 * 253
    assert count_work_tokens(tokens, fast=False) == full
    work = count_work_tokens(tokens, fast=True)
    # 255 candidates do not fit one pack: the plan shares the prefix up to its last multiple of 64 (192 tokens) once
    # and runs the rest of it (58 tokens) with each candidate (packing/planner.py)
    assert work == 192 + 255 * (58 + 3)
    assert count_work_tokens([tokens[0][:8]], fast=True) == 250 + 8 * 3  # one pack: the exact prefix once
    plan = plan_requests([tokens])
    assert work == sum(pack.tokens(plan) for pack in plan.packs)
    unshared = count_work_tokens(tokens, fast=True, options=FastPathOptions(shared_prefix=False))
    assert unshared == full


@pytest.mark.parametrize("seed", range(40))
def test_the_floor_never_passes_the_exact_work_and_is_exact_without_sharing(seed):
    rng = random.Random(seed)
    tokens = random_request(rng)
    shared, full = WorkFloor(True), WorkFloor(False)
    for qi, question in enumerate(tokens):
        for seq in question:
            shared.add(qi, seq)
            full.add(qi, seq)
    for options in (FastPathOptions(), FastPathOptions(share_tails=False), FastPathOptions(max_tokens=128),
                    FastPathOptions(min_shared_tokens=64)):
        assert shared.total <= count_work_tokens(tokens, fast=True, options=options)
    assert full.total == count_work_tokens(tokens, fast=False)
    assert shared.total <= full.total


def test_the_conformance_255_option_choice_fits_the_default_cap_on_either_path(tiny_model):
    parsed = parse_request(conformance_choice())
    model = ByteLevel(tiny_model)
    reference = tokenize_request(model, parsed, max_total_tokens=DEFAULT_MAX_REQUEST_TOKENS, fast=False)
    assert reference.parsed.candidate_count == 255 and reference.input_tokens > 65536  # over the old default
    fast = tokenize_request(model, parsed, max_total_tokens=DEFAULT_MAX_REQUEST_TOKENS, fast=True,
                            options=FastPathOptions())
    assert fast.tokens == reference.tokens


def test_the_cap_counts_the_work_of_the_path_that_runs(tiny_model):
    parsed = parse_request(conformance_choice())
    full = sum(len(seq) for seq in tokenize_request(tiny_model, parsed).sequences)
    work = count_work_tokens(tokenize_request(tiny_model, parsed).tokens, fast=True)
    assert work < full // 3
    cap = (work + full) // 2  # admits the fast path's work, not every sequence in full
    admitted = tokenize_request(tiny_model, parsed, max_total_tokens=cap, fast=True, options=FastPathOptions())
    assert admitted.input_tokens == full
    with pytest.raises(RequestError) as info:
        tokenize_request(tiny_model, parsed, max_total_tokens=cap, fast=False)
    assert info.value.status == 413 and info.value.message.startswith(MSG_TOO_MANY_TOKENS)
    assert f"input tokens > max_request_tokens={cap}" in info.value.message
    with pytest.raises(RequestError) as info:  # below the work: refused on the fast path too, counted as work
        tokenize_request(tiny_model, parsed, max_total_tokens=work - 1, fast=True, options=FastPathOptions())
    assert info.value.status == 413 and f"at least {work} tokens of work" in info.value.message


def test_the_fast_path_floor_stops_tokenizing_a_request_far_over_the_cap(tiny_model):
    calls = []
    encode = tiny_model.encode

    class Counting:
        def __getattr__(self, name):
            return getattr(tiny_model, name)

        def encode(self, text):
            calls.append(text)
            return encode(text)

    questions = {f"q{i}": {"type": "choice", "instructions": f"Question {i} " + "why " * 50,
                           "criteria": {"a": None, "b": None}} for i in range(200)}
    parsed = parse_request({"state": "s", "questions": questions})
    with pytest.raises(RequestError) as info:
        tokenize_request(Counting(), parsed, max_total_tokens=2000, fast=True, options=FastPathOptions())
    assert info.value.status == 413 and len(calls) < 40  # stopped near the cap, not after 400 candidates


# -- batches bounded by tokens ----------------------------------------------------------------------------------------


def test_padded_batches_keep_rows_times_the_longest_under_the_bound():
    lengths = [10, 10, 10, 100, 5, 5, 30, 30, 30, 30]
    batches = split_padded(lengths, max_rows=32, max_tokens=100)
    assert [list(r) for r in batches] == [[0, 1, 2], [3], [4, 5, 6], [7, 8, 9]]
    for rows in batches:
        assert len(rows) * max(lengths[i] for i in rows) <= 100


def test_padded_batches_respect_max_rows_and_put_a_longer_sequence_alone():
    assert [list(r) for r in split_padded([1] * 5, max_rows=2, max_tokens=1000)] == [[0, 1], [2, 3], [4]]
    assert [list(r) for r in split_padded([5, 300, 5], max_rows=8, max_tokens=100)] == [[0], [1], [2]]
    assert split_padded([], max_rows=4, max_tokens=10) == []


def test_summed_batches_are_lazy_and_bounded():
    seen = []

    def cost(n):
        seen.append(n)
        return n

    batches = split_by_tokens(iter([3, 3, 3, 10, 1, 1]), cost, max_items=10, max_tokens=6)
    assert next(batches) == [3, 3] and seen == [3, 3, 3]  # the third item is costed, then the batch is out
    assert list(batches) == [[3], [10], [1, 1]]
    assert list(split_by_tokens(range(5), lambda _x: 1, max_items=2, max_tokens=100)) == [[0, 1], [2, 3], [4]]


def test_the_default_holds_one_max_length_16384_sequence():
    assert DEFAULT_BATCH_TOKENS >= 16384


@pytest.mark.parametrize("bad", [0, -1, 1.5, "16", True, None])
def test_check_batch_tokens(bad):
    with pytest.raises(ValueError, match="my_option must be a positive integer"):
        check_batch_tokens(bad, "my_option")
    assert check_batch_tokens(7) == 7

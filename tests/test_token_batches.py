"""hf_openjev.token_batches: consecutive batches bounded by a count and by tokens (padded, or summed)."""

from __future__ import annotations

import pytest

from hf_openjev.token_batches import DEFAULT_BATCH_TOKENS, check_batch_tokens, split_by_tokens, split_padded


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

"""hf_openjev/packing/graph_buckets.py: buckets fix sequences, tokens and chunks; padding never empties a sequence."""

import random

import pytest

from hf_openjev.packing.graph_buckets import bucket_sequences, bucket_tokens, chunks, dummy_lengths, pad_level


def test_bucket_sequences_is_the_next_power_of_two():
    assert [bucket_sequences(n) for n in (0, 1, 2, 3, 4, 5, 16, 17)] == [1, 1, 2, 4, 4, 8, 16, 32]


def test_bucket_tokens_steps():
    assert [bucket_tokens(t) for t in (1, 32, 33, 64, 65, 512, 513, 1025, 2049, 3400, 4096, 4097, 5000)] == \
        [32, 32, 64, 64, 96, 512, 544, 1056, 2080, 3424, 4096, 5120, 5120]


@pytest.mark.parametrize("padding,count", [(1, 1), (5, 5), (64, 1), (65, 1), (130, 3), (200, 2), (7, 3)])
def test_dummy_lengths(padding, count):
    lengths = dummy_lengths(padding, count)
    assert len(lengths) == count and sum(lengths) == padding and min(lengths) >= 1
    assert chunks(lengths) == max(count, -(-padding // 64))


def test_too_little_padding_is_refused():
    with pytest.raises(ValueError):
        dummy_lengths(2, 3)


def test_padded_levels_with_equal_real_chunk_counts_share_a_bucket():
    rng = random.Random(0)
    for _ in range(500):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 20))]
        if bucket_sequences(len(lengths)) == len(lengths) and bucket_tokens(sum(lengths)) == sum(lengths):
            continue  # a level that fills its bucket (test below)
        dummies = pad_level(lengths)
        padded = lengths + dummies
        n_b, t_b = len(padded), sum(padded)
        assert n_b == bucket_sequences(len(lengths) + 1)
        assert t_b == bucket_tokens(sum(lengths) + len(dummies))
        # the padded chunk count is a function of (real chunks, padding, dummies): same key for same real shape
        assert chunks(padded) == chunks(lengths) + max(len(dummies), -(-(t_b - sum(lengths)) // 64))
        assert min(dummies) >= 1


@pytest.mark.parametrize("lengths", [[640], [64], [448], [30, 34], [100, 28, 1, 127]])
def test_a_level_that_fills_its_bucket_gets_no_dummy(lengths):
    """A power-of-two number of sequences holding a bucket's token count (e.g. one prefix shared at a multiple of
    64 tokens) is its own bucket; one token more or one sequence fewer needs dummies again."""
    assert pad_level(lengths) == []
    assert pad_level(lengths + [1]) != [] and pad_level([*lengths[:-1], lengths[-1] + 1]) != []

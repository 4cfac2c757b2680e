"""Shape buckets for CUDA-graph replay of packed forwards (pure functions, tested on the CPU).

A captured graph fixes, per level of a pack: the number of sequences, of tokens and of 64-token chunks (fla-core
0.6's gated-delta-rule kernels size their grids from the chunk count and have no sentinel rows to skip). Each
level is therefore padded with *dummy sequences* (>= 1 token each, zero initial state, outputs never read) whose
lengths bring the level to ``N_b`` sequences and ``T_b`` tokens with a chunk count that only depends on the real
chunk count, the padding and the number of dummies; a level that already fills a bucket gets none.
"""

from __future__ import annotations

CHUNK = 64
# (up to, granularity); beyond: 1024. Past ~200 tokens a pack's GEMMs are compute-bound, so padding costs its share
# of time. 32-token steps pad the JevBench workload's packs by 2.1% of their tokens for 110 graph buckets (3.6% and
# 120 with share_tails); 64 up to 512 then 128 padded 5.2% for 86, and that padding cost a
# measurable share of a request's time (recipes/RESULTS.md). More buckets cost capture time, once per bucket.
TOKEN_STEPS = ((4096, 32),)


def bucket_sequences(n: int) -> int:
    """The next power of two >= n (at least 1)."""
    size = 1
    while size < n:
        size *= 2
    return size


def bucket_tokens(t: int) -> int:
    """Round ``t`` up to the token step of its range (``TOKEN_STEPS``; 1,024 past the last)."""
    for limit, step in TOKEN_STEPS:
        if t <= limit:
            return -(-t // step) * step
    return -(-t // 1024) * 1024


def dummy_lengths(padding_tokens: int, count: int) -> list[int]:
    """``count`` lengths >= 1 summing to ``padding_tokens``, with max(count, ceil(padding/64)) chunks in total."""
    if count < 1 or padding_tokens < count:
        raise ValueError(f"cannot split {padding_tokens} padding tokens into {count} non-empty dummy sequences")
    if -(-padding_tokens // CHUNK) >= count:  # full 64-token dummies, the rest in the last one
        return [CHUNK] * (count - 1) + [padding_tokens - CHUNK * (count - 1)]
    base, extra = divmod(padding_tokens, count)  # every dummy within 1..64 tokens: one chunk each
    return [base + 1] * extra + [base] * (count - extra)


def chunks(lengths) -> int:
    return sum(-(-length // CHUNK) for length in lengths)


def pad_level(lengths: list[int], buckets=None, *, rows_before: int = 0) -> list[int]:
    """Dummy sequence lengths that pad a level with these real sequence lengths to its bucket.

    Empty when the level already fills a bucket: a power-of-two number of sequences and a bucket's token count. The
    commonest case is one shared prefix, which the planner cuts at a multiple of 64: a dummy there would cost a
    whole token step of every layer's GEMMs (JevBench, then with 64/128-token steps: 8.1% -> 5.2% padding).

    ``buckets`` (a :class:`~.bucket_policy.BucketPolicy`, for a pack's last level; None: the fixed token steps):
    the level's token bucket is what brings the pack's rows, ``rows_before`` of earlier levels included, to the
    policy's cheapest measured row count (``BucketPolicy.pack_rows``).
    """
    def bucket(tokens: int) -> int:
        return bucket_tokens(tokens) if buckets is None else buckets.pack_rows(rows_before + tokens) - rows_before

    n, tokens = len(lengths), sum(lengths)
    if bucket_sequences(n) == n and bucket(tokens) == tokens:
        return []
    count = bucket_sequences(n + 1) - n  # >= 1 dummy, so any padding has somewhere to go
    padded_tokens = bucket(tokens + count)
    return dummy_lengths(padded_tokens - tokens, count)

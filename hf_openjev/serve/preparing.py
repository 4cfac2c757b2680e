"""Where requests are prepared: tiny work on the event loop itself, the rest on thread pools sized by the work so
that small requests never wait behind big ones.

Preparing a request (strict JSON, validation, tokenization) is CPU work that runs on threads: the tokenizer
releases the GIL, so several requests tokenize at once. It comes in two steps, each sent to a pool by its size:
parsing by the body's bytes, tokenization by the characters of its candidate texts. Work of at most
``big_work`` runs on the ``small`` pool, bigger work on the ``big`` one. A client sending 4 MiB bodies (even
ones that are refused, which cost little since an over-long candidate stops at a clean prefix:
:mod:`hf_openjev.tokenizer.prefix_cuts`) then only queues behind other big work; a small request finds a free
small worker.

Tiny work (at most ``inline_work`` bytes or characters: a short request's body, a few candidates of a few hundred
tokens) runs on the event loop: a trip to a pool and back costs more than that work (two thread wake-ups, and the
wait for the GIL in each), and it holds the loop for well under a millisecond (recipes/server_time.py). So a short
request is parsed, validated and tokenized where it was read, and its answer built there too
(:meth:`PreparePools.answers_inline`); anything bigger still goes to its pool.

:class:`PreparePools` is also an ``Executor`` (its ``submit`` uses the small pool) so that the server hands it
to ``run_in_executor`` for its other short jobs (building answers) and shuts both pools down with it.
"""

from __future__ import annotations

from concurrent.futures import Executor, ThreadPoolExecutor

__all__ = ["DEFAULT_BIG_WORK", "DEFAULT_INLINE_CANDIDATES", "DEFAULT_INLINE_WORK", "PreparePools",
           "measure_tokenize_work"]

DEFAULT_BIG_WORK = 256 * 1024  # body bytes, or characters to tokenize: ~0.1 s of tokenization and more is "big"
DEFAULT_INLINE_WORK = 4096  # body bytes, or characters to tokenize: this much and less runs on the event loop
DEFAULT_INLINE_CANDIDATES = 64  # answers of this many candidates and fewer are built on the event loop


class PreparePools(Executor):
    """Two thread pools: ``small`` (``workers`` threads) and ``big`` (``big_workers`` threads, for work above
    ``big_work`` bytes or characters); work of at most ``inline_work`` (0: none; never more than ``big_work``) and answers of at most
    ``inline_candidates`` candidates run on the event loop instead."""

    def __init__(self, *, workers: int = 2, big_workers: int = 2, big_work: int = DEFAULT_BIG_WORK,
                 inline_work: int = DEFAULT_INLINE_WORK, inline_candidates: int = DEFAULT_INLINE_CANDIDATES):
        if big_work < 1:
            raise ValueError("big_work must be at least 1")
        if inline_work < 0 or inline_candidates < 0:
            raise ValueError("inline_work and inline_candidates must be at least 0")
        self.big_work = int(big_work)
        self.inline_work = min(int(inline_work), self.big_work)  # big work never runs on the event loop
        self.inline_candidates = int(inline_candidates)
        self.small = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="jev-prepare")
        self.big = ThreadPoolExecutor(max_workers=max(1, big_workers), thread_name_prefix="jev-prepare-big")

    def runs_inline(self, work: int) -> bool:
        """Whether a job of ``work`` bytes or characters runs on the event loop rather than on a pool."""
        return work <= self.inline_work

    def answers_inline(self, candidates: int) -> bool:
        """Whether the answer of a request of ``candidates`` candidates is built on the event loop."""
        return candidates <= self.inline_candidates

    def pick(self, work: int) -> ThreadPoolExecutor:
        """The pool for a job of ``work`` bytes or characters."""
        return self.big if work > self.big_work else self.small

    def submit(self, fn, /, *args, **kwargs):
        return self.small.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.small.shutdown(wait=wait, cancel_futures=cancel_futures)
        self.big.shutdown(wait=wait, cancel_futures=cancel_futures)


def measure_tokenize_work(parsed) -> int:
    """Characters a validated request sends to the tokenizer (its candidate prompts, without the chat halves)."""
    return sum(len(prompt) for question in parsed.questions for prompt in question.prompts)

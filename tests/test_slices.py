"""A request's work in bounded slices (hf_openjev.serve.slices and the batcher's scheduling of them, issue 36
item 6): a small request is scored before a heavy one's remaining slices, a cancelled (timed-out or abandoned) heavy
request stops at its next slice, and a lone request's sliced answer is its unsliced one to the bit."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from test_batcher import FakePrepared, Scorer, expected_scores, request

from hf_openjev.contract import parse_request
from hf_openjev.scoring import score_prepared, tokenize_request
from hf_openjev.serve.batcher import Batcher
from hf_openjev.serve.slices import RequestSlice, default_slice_tokens, fits_one_slice, join_scores, split_request
from hf_openjev.work_tokens import count_work_tokens


class Calls(Scorer):
    """Records, per call, (request name, candidates scored) of every part; calls wait for ``gate`` until it opens."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[list[tuple[str, int]]] = []

    def __call__(self, model, prepared, *, fast):
        self.calls.append([(p.name, sum(len(q) for q in p.tokens)) for p in prepared])
        return super().__call__(model, prepared, fast=fast)


def wait_idle(batcher) -> None:
    deadline = time.monotonic() + 10
    while batcher.in_flight or batcher.waiting:
        assert time.monotonic() < deadline, "the batcher did not settle"
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------- cutting and joining

@pytest.mark.parametrize("seed", range(20))
def test_parts_hold_every_candidate_once_in_order_within_the_slice(seed):
    rng = random.Random(seed)
    p = FakePrepared([[[rng.randrange(9) for _ in range(rng.randint(1, 90))] for _ in range(rng.randint(1, 9))]
                      for _ in range(rng.randint(1, 5))], "r")
    size, align = rng.choice([1, 50, 200, 1000]), rng.choice([1, 3, 32])
    parts, works = split_request(p, size, shares_prefixes=rng.random() < 0.5, align=align)
    flat = [seq for part in parts for seq in part.sequences] if len(parts) > 1 else [s for q in p.tokens for s in q]
    assert flat == [s for q in p.tokens for s in q]
    if len(parts) > 1:
        assert all(isinstance(part, RequestSlice) and part.name == "r" for part in parts)
        starts = [sum(len(part.sequences) for part in parts[:i]) for i in range(len(parts))]
        assert all(start % align == 0 for start in starts)
        for part, work in zip(parts, works):  # over the slice only when its first block alone is
            assert work <= size or len(part.sequences) <= align
            assert work <= count_work_tokens(part.tokens, fast=False)
    scores = [expected_scores(part) for part in parts]
    assert (join_scores(p, scores) if len(parts) > 1 else scores[0]) == expected_scores(p)


@pytest.mark.parametrize("seed", range(60))
def test_a_request_said_to_fit_one_slice_is_one_the_cut_leaves_whole(seed):
    """fits_one_slice bounds split_request's count from above: when it says yes, the cut leaves the request whole
    (often it says yes where counting every sequence in full would not: shared prefixes)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(9) for _ in range(rng.randint(0, 120))]
    shared = [prefix[:rng.randint(0, len(prefix))] for _ in range(rng.randint(1, 4))]  # each question's prefix
    p = FakePrepared([[head + [rng.randrange(9) for _ in range(rng.randint(0 if head else 1, 30))]
                       for _ in range(rng.randint(1, 9))] for head in shared], "r")
    shares, size = rng.random() < 0.7, rng.choice([50, 150, 400])
    if fits_one_slice(p.tokens, size, shares_prefixes=shares):
        for align in (1, 32):
            assert split_request(p, size, shares_prefixes=shares, align=align)[0] == [p]
    else:
        assert p.input_tokens > size


def test_a_request_long_in_input_tokens_but_sharing_its_prefix_is_not_cut(monkeypatch):
    """Six candidates of 3,400 tokens sharing 3,360 (a JevBench long choice): over a slice counted in full, within
    one counted as the fast path runs it; the batcher sees that without cutting it."""
    import hf_openjev.serve.batcher as batcher_module

    cuts = []
    monkeypatch.setattr(batcher_module, "split_request", lambda *a, **k: cuts.append(a) or split_request(*a, **k))
    scorer = Calls()
    batcher = Batcher(object(), max_wait_ms=0, fast=True, score_fn=scorer, slice_tokens=8192)
    prefix = list(range(3360))
    long_choice = FakePrepared([[prefix + [10_000 + 40 * i + j for j in range(40)] for i in range(6)]], "choice")
    assert long_choice.input_tokens > 8192 and fits_one_slice(long_choice.tokens, 8192, shares_prefixes=True)
    outcome = asyncio.run(asyncio.wait_for(batcher.submit(long_choice), 20))
    batcher.close(timeout=5)
    assert cuts == [] and scorer.calls == [[("choice", 6)]]
    assert outcome.scores == expected_scores(long_choice)


def test_a_request_within_one_slice_is_not_cut_and_a_long_candidate_runs_as_one():
    p = request("r", 5, 7, 9)
    assert split_request(p, 21, shares_prefixes=False) == ([p], [21])
    parts, works = split_request(request("r", 5, 300, 9), 100, shares_prefixes=False)
    assert [len(part.sequences) for part in parts] == [1, 1, 1] and works == [5, 300, 9]


def test_the_default_slice_depends_on_the_device_kind():
    assert default_slice_tokens("cuda:1") > default_slice_tokens("cpu") == default_slice_tokens(None)


# ------------------------------------------------------------------------------------------ scheduling (batcher)

def test_a_small_request_is_scored_before_a_heavy_ones_remaining_slices():
    """Default slices (fast path: one candidate at a time): heavy's 10 x 500 tokens run in several groups; a small
    request of another client that arrives while heavy's first slice runs is in the next group."""
    gate = threading.Event()
    scorer = Calls(gate=gate)
    batcher = Batcher(object(), max_wait_ms=0, fast=True, score_fn=scorer)
    heavy, small = request("heavy", *[500] * 10), request("small", 3)

    async def main():
        first = asyncio.ensure_future(batcher.submit(heavy, client="a"))
        while not scorer.entered.is_set():
            await asyncio.sleep(0.005)
        second = asyncio.ensure_future(batcher.submit(small, client="b"))
        await asyncio.sleep(0.05)  # admitted while heavy's first slice still runs
        gate.set()
        return await first, await second

    heavy_out, small_out = asyncio.run(asyncio.wait_for(main(), 20))
    batcher.close(timeout=5)
    assert heavy_out.scores == expected_scores(heavy) and small_out.scores == expected_scores(small)
    heavy_calls = [i for i, call in enumerate(scorer.calls) if any(name == "heavy" for name, _ in call)]
    small_call = next(i for i, call in enumerate(scorer.calls) if ("small", 1) in call)
    assert len(heavy_calls) >= 3  # sliced: 10 x 500 tokens over a 2048-token slice
    assert small_call == 1 and heavy_calls[-1] > small_call  # one slice of heavy before it, the rest after
    assert sum(n for call in scorer.calls for name, n in call if name == "heavy") == 10  # each candidate once


def test_a_request_is_cut_on_the_event_loop_unless_it_is_very_long(monkeypatch):
    """Cutting is O(tokens): a request of up to SPLIT_INLINE_TOKENS input tokens is cut where it is submitted (no trip
    to a thread and back), a longer one on a thread; both are scored whole, in their slices."""
    import hf_openjev.serve.batcher as batcher_module

    where = []

    def spy(*args, **kwargs):
        where.append(threading.current_thread() is threading.main_thread())
        return split_request(*args, **kwargs)

    monkeypatch.setattr(batcher_module, "split_request", spy)
    scorer = Calls()
    batcher = Batcher(object(), max_wait_ms=0, fast=True, score_fn=scorer, slice_tokens=1000)
    short = request("short", *[600] * 4)  # 2,400 input tokens: over a slice, under SPLIT_INLINE_TOKENS
    long = request("long", *[2000] * (batcher_module.SPLIT_INLINE_TOKENS // 2000 + 1))

    async def main():
        return await batcher.submit(short), await batcher.submit(long)

    short_out, long_out = asyncio.run(asyncio.wait_for(main(), 20))
    batcher.close(timeout=5)
    assert where == [True, False]
    assert short_out.scores == expected_scores(short) and long_out.scores == expected_scores(long)
    assert sum(n for call in scorer.calls for name, n in call if name == "short") == 4 < len(scorer.calls)


@pytest.mark.parametrize("how", ["client left", "deadline passed"])
def test_a_cancelled_heavy_request_stops_at_its_next_slice(how):
    gate = threading.Event()
    scorer = Calls(gate=gate)
    batcher = Batcher(object(), max_wait_ms=0, fast=True, score_fn=scorer)
    heavy = request("heavy", *[500] * 10)

    async def main():
        if how == "client left":
            task = asyncio.ensure_future(batcher.submit(heavy))
            while not scorer.entered.is_set():
                await asyncio.sleep(0.005)
            task.cancel()
        else:
            task = asyncio.ensure_future(asyncio.wait_for(batcher.submit(heavy), 0.2))
            while not scorer.entered.is_set():
                await asyncio.sleep(0.005)
        with pytest.raises((asyncio.CancelledError, asyncio.TimeoutError)):
            await task
        gate.set()

    asyncio.run(asyncio.wait_for(main(), 20))
    wait_idle(batcher)
    batcher.close(timeout=5)
    scored = sum(n for call in scorer.calls for name, n in call if name == "heavy")
    assert len(scorer.calls) == 1 and 0 < scored < 10  # the slice that ran, none after it
    assert batcher.stats()["stopped"] == 1 and batcher.requests == 0


# --------------------------------------------------------------------------------------- answers (tiny model)

def test_a_sliced_answer_is_the_unsliced_one_to_the_bit(tiny_model):
    """The reference path (CPU): 70 candidates of ~100 tokens, over the CPU's default slice, in several groups;
    the parts start on the reference path's batch boundaries, so every forward is the unsliced run's."""
    rng = random.Random(0)
    criteria = {f"option {i}": " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(5, 40)))
                for i in range(70)}
    parsed = parse_request({"state": "The customer writes about a double charge. " * 3,
                            "questions": {"q": {"type": "choice", "instructions": "Which?", "criteria": criteria}}})
    prepared = tokenize_request(tiny_model, parsed)
    assert prepared.input_tokens > 2 * default_slice_tokens("cpu")
    unsliced = score_prepared(tiny_model, [prepared], fast=False).scores[0]
    batcher = Batcher(tiny_model, max_wait_ms=0)
    sliced = asyncio.run(asyncio.wait_for(batcher.submit(prepared), 120))
    batcher.close(timeout=5)
    assert batcher.groups >= 2 and batcher.requests == 1
    assert sliced.scores == unsliced


def test_on_the_fast_path_a_sliced_answer_equals_the_unsliced_one_within_rounding(tiny_checkpoint):
    """The fast path plans each part on its own (its shared prefix once per part): the same scores within the
    rounding of differently shaped packs, and the same decisions."""
    import hf_openjev
    from hf_openjev.scoring import prepare_path

    model = hf_openjev.load_export(tiny_checkpoint.export, dtype="float32", device="cpu")  # patched: a copy
    prepare_path(model, True)
    criteria = {f"option {i}": f"queue {i} " * (i % 7 + 1) for i in range(40)}
    parsed = parse_request({"state": "The customer writes about a double charge. " * 4,
                            "questions": {"q": {"type": "choice", "instructions": "Which?", "criteria": criteria}}})
    prepared = tokenize_request(model, parsed)
    unsliced = score_prepared(model, [prepared], fast=True).scores[0]
    batcher = Batcher(model, max_wait_ms=0, fast=True, slice_tokens=prepared.input_tokens // 8)
    sliced = asyncio.run(asyncio.wait_for(batcher.submit(prepared), 120))
    batcher.close(timeout=5)
    assert batcher.groups >= 3 and sliced.method == "fast"
    assert sliced.scores[0] == pytest.approx(unsliced[0], abs=1e-4)
    assert max(range(40), key=sliced.scores[0].__getitem__) == max(range(40), key=unsliced[0].__getitem__)

"""The batcher's admission (issue 28, finding 1): round-robin across clients (hf_openjev.serve.batching_policy), and
requests cancelled while they wait (client gone, deadline passed) leave the queue unscored."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from test_batcher import Scorer, request

from hf_openjev.serve.batcher import Batcher, QueueFull
from hf_openjev.serve.batching_policy import FairQueue


def _item(client, tokens, t):
    return SimpleNamespace(client=client, tokens=tokens, enqueued=t)


def test_fair_queue_interleaves_clients_and_rotates_the_served_ones():
    queue = FairQueue()
    heavy = [_item("heavy", 100, i) for i in range(4)]
    small = _item("small", 1, 10)
    for item in [*heavy, small]:
        queue.append(item)
    assert list(queue) == [heavy[0], small, heavy[1], heavy[2], heavy[3]]
    group, full = queue.plan(100)
    assert group == [heavy[0]] and full
    queue.take(group)
    group, _ = queue.plan(100)
    assert group[0] is small  # the served lane went to the back: the small client is next, not heavy[1]
    assert queue.oldest() is heavy[1] and len(queue) == 4
    assert queue.remove(small) and not queue.remove(small) and len(queue) == 3
    assert queue.clear() == heavy[1:] and not queue


def test_a_heavy_clients_backlog_does_not_hold_a_small_request_back():
    gate = threading.Event()
    scorer = Scorer(gate=gate)
    batcher = Batcher(object(), max_wait_ms=0, max_batch_tokens=50, score_fn=scorer)

    async def main():
        heavy = [asyncio.ensure_future(batcher.submit(request(f"heavy{i}", 50), client="A")) for i in range(5)]
        await asyncio.sleep(0.05)
        assert scorer.entered.wait(5)  # heavy0 is being scored; heavy1..4 wait
        small = asyncio.ensure_future(batcher.submit(request("small", 3), client="B"))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(small, *heavy)

    asyncio.run(asyncio.wait_for(main(), 20))
    batcher.close(timeout=5)
    assert scorer.groups[:2] == [["heavy0"], ["small"]]  # FIFO would have scored heavy1..heavy4 first


def test_cancelled_waiting_requests_are_never_scored_and_free_the_queue():
    gate = threading.Event()
    scorer = Scorer(gate=gate)
    batcher = Batcher(object(), max_wait_ms=0, max_queue=2, score_fn=scorer)

    async def main():
        first = asyncio.ensure_future(batcher.submit(request("first", 5), client="x"))
        await asyncio.sleep(0.05)
        assert scorer.entered.wait(5)
        gone = [asyncio.ensure_future(batcher.submit(request(f"gone{i}", 5), client="y")) for i in range(2)]
        await asyncio.sleep(0.05)
        try:
            await batcher.submit(request("refused", 5))
            raise AssertionError("the queue was not full")
        except QueueFull:
            pass
        for task in gone:
            task.cancel()
        await asyncio.gather(*gone, return_exceptions=True)
        assert batcher.waiting == 0 and batcher.withdrawn == 2
        late = asyncio.ensure_future(batcher.submit(request("late", 5)))  # admitted: the abandoned ones left
        await asyncio.sleep(0.05)
        first.cancel()  # in flight: its group finishes, its answer is dropped
        gate.set()
        await late
        await asyncio.gather(first, return_exceptions=True)

    asyncio.run(asyncio.wait_for(main(), 20))
    batcher.close(timeout=5)
    assert scorer.groups == [["first"], ["late"]]
    assert batcher.stats()["withdrawn"] == 2

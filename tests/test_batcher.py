"""Cross-request batching (hf_openjev.serve.batcher) with a stand-in scorer: grouping, budget, failures, admission, drain."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from hf_openjev.errors import InferenceError
from hf_openjev.serve.batcher import Batcher, BatcherClosed, QueueFull


@dataclass
class FakePrepared:
    tokens: list  # [question][candidate] -> token ids
    name: str = ""

    @property
    def input_tokens(self) -> int:
        return sum(len(seq) for q in self.tokens for seq in q)


def request(name: str, *lengths: int, questions: int = 1) -> FakePrepared:
    base = sum(map(ord, name))
    return FakePrepared([[[base + i + j for j in range(n)] for i, n in enumerate(lengths)] for _ in range(questions)],
                        name)


def expected_scores(p: FakePrepared) -> list:
    return [[sum(seq) / 1000.0 + len(seq) for seq in q] for q in p.tokens]


class Scorer:
    """Scores every sequence on its own (like the reference path); records the groups; can block or fail."""

    def __init__(self, *, fail: bool = False, gate: threading.Event | None = None, delay: float = 0.0):
        self.groups: list[list[str]] = []
        self.fail = fail
        self.gate = gate
        self.delay = delay
        self.entered = threading.Event()

    def __call__(self, model, prepared, *, fast):
        self.groups.append([p.name for p in prepared])
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10), "test gate never opened"
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("CUDA error: device-side assert")
        scores = [expected_scores(p) for p in prepared]
        return SimpleNamespace(scores=scores, seconds=0.001, prefix_cache=[{"enabled": False} for _ in prepared],
                               path="fast" if fast else "reference")  # like score_prepared's ScoreResult


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_concurrent_requests_share_a_forward_and_get_their_own_scores():
    scorer = Scorer()
    batcher = Batcher(object(), max_wait_ms=200, max_batch_tokens=10_000, score_fn=scorer, fast=False)
    reqs = [request(f"r{i}", 3 + i, 5, questions=1 + i % 3) for i in range(8)]

    async def main():
        return await asyncio.gather(*(batcher.submit(p) for p in reqs))

    outcomes = run(main())
    batcher.close(timeout=5)
    assert [o.scores for o in outcomes] == [expected_scores(p) for p in reqs]  # split back exactly, in order
    assert len(scorer.groups) == 1 and scorer.groups[0] == [p.name for p in reqs]  # FIFO, one shared forward
    assert all(o.batch_requests == 8 for o in outcomes)
    assert outcomes[0].batch_tokens == sum(p.input_tokens for p in reqs)
    assert outcomes[0].method == "reference"


def test_answers_do_not_depend_on_company():
    target = request("target", 4, 7, 2, questions=2)
    alone_scorer, crowd_scorer = Scorer(), Scorer()

    async def alone():
        b = Batcher(object(), max_wait_ms=0, score_fn=alone_scorer)
        try:
            return await b.submit(target)
        finally:
            b.close(timeout=5)

    async def crowd():
        b = Batcher(object(), max_wait_ms=100, score_fn=crowd_scorer)
        others = [request(f"o{i}", 9, 1, questions=3) for i in range(5)]
        try:
            results = await asyncio.gather(*(b.submit(p) for p in [others[0], others[1], target, *others[2:]]))
            return results[2]
        finally:
            b.close(timeout=5)

    a, c = run(alone()), run(crowd())
    assert a.batch_requests == 1 and c.batch_requests == 6
    assert a.scores == c.scores == expected_scores(target)


def test_token_budget_splits_groups_and_a_big_request_runs_alone():
    scorer = Scorer()
    batcher = Batcher(object(), max_wait_ms=100, max_batch_tokens=10, score_fn=scorer)
    reqs = [request("a", 4), request("b", 4), request("c", 4), request("big", 25), request("d", 3)]

    async def main():
        return await asyncio.gather(*(batcher.submit(p) for p in reqs))

    outcomes = run(main())
    batcher.close(timeout=5)
    assert scorer.groups == [["a", "b"], ["c"], ["big"], ["d"]]
    assert [o.scores for o in outcomes] == [expected_scores(p) for p in reqs]


def test_lone_request_does_not_wait_when_no_company_is_coming():
    scorer = Scorer()
    batcher = Batcher(object(), max_wait_ms=2000, score_fn=scorer, company_hint=lambda: 0)
    start = time.monotonic()
    outcome = run(batcher.submit(request("solo", 3)))
    batcher.close(timeout=5)
    assert time.monotonic() - start < 1.0
    assert outcome.queue_seconds < 1.0


def test_max_wait_bounds_the_wait_for_company():
    scorer = Scorer()
    batcher = Batcher(object(), max_wait_ms=60, score_fn=scorer)  # no hint: always waits up to max_wait
    outcome = run(batcher.submit(request("solo", 3)))
    batcher.close(timeout=5)
    assert 0.05 <= outcome.queue_seconds < 2.0


def test_a_request_arriving_wakes_the_workers_not_the_deadline_watchdog(monkeypatch):
    """The watchdog wakes when a group starts (a new deadline to watch) or on its own timeout, never for a request
    queued or a group ended: a thread that takes the GIL on every request would cost every request a hop."""
    import hf_openjev.serve.batcher as batcher_module

    waits: list[str] = []

    class CountingCondition(threading.Condition):
        def wait(self, timeout=None):
            waits.append(threading.current_thread().name)
            return super().wait(timeout)

    monkeypatch.setattr(batcher_module, "threading", SimpleNamespace(
        Condition=CountingCondition, RLock=threading.RLock, Thread=threading.Thread))
    scorer = Scorer(delay=0.002)
    batcher = Batcher(object(), max_wait_ms=0, score_fn=scorer, group_deadline_s=300.0, name="w")

    async def one_at_a_time():
        for i in range(20):
            await batcher.submit(request(f"r{i}", 3))

    run(one_at_a_time())
    batcher.close(timeout=5)
    assert len(scorer.groups) == 20
    # one wake-up per group started, its first wait and at most one timeout (1 s) or spurious wake-up
    assert waits.count("w-deadline") <= 20 + 2, waits.count("w-deadline")


def test_failure_fails_the_whole_group_and_the_worker_survives():
    scorer = Scorer(fail=True)
    batcher = Batcher(object(), max_wait_ms=100, score_fn=scorer)
    reqs = [request(f"r{i}", 3) for i in range(4)]

    async def main():
        return await asyncio.gather(*(batcher.submit(p) for p in reqs), return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, InferenceError) for r in results)
    assert "model inference failed" in str(results[0])
    assert batcher.failures == 1
    scorer.fail = False
    assert run(batcher.submit(request("after", 2))).scores == expected_scores(request("after", 2))
    batcher.close(timeout=5)


def test_scorer_returning_the_wrong_number_of_results_is_an_inference_error():
    def bad(model, prepared, *, fast):
        return SimpleNamespace(scores=[], seconds=0.0, prefix_cache=[], path="reference")

    batcher = Batcher(object(), max_wait_ms=0, score_fn=bad)
    with pytest.raises(InferenceError):
        run(batcher.submit(request("x", 2)))
    batcher.close(timeout=5)


def test_full_queue_refuses_at_once_and_loses_no_admitted_request():
    gate = threading.Event()
    scorer = Scorer(gate=gate)
    batcher = Batcher(object(), max_queue=2, max_wait_ms=0, max_batch_tokens=3, score_fn=scorer)

    async def main():
        first = asyncio.ensure_future(batcher.submit(request("first", 3)))
        while not scorer.entered.is_set():  # the worker holds "first"; the queue is empty again
            await asyncio.sleep(0.005)
        queued = [asyncio.ensure_future(batcher.submit(request(f"q{i}", 3))) for i in range(2)]
        await asyncio.sleep(0.01)
        assert batcher.waiting == 2 and batcher.in_flight == 1
        with pytest.raises(QueueFull):
            await batcher.submit(request("refused", 3))
        gate.set()
        return await asyncio.gather(first, *queued)

    outcomes = run(main())
    batcher.close(timeout=5)
    assert len(outcomes) == 3 and all(o.scores for o in outcomes)
    assert scorer.groups == [["first"], ["q0"], ["q1"]]


def test_close_drains_admitted_requests_then_refuses():
    gate = threading.Event()
    scorer = Scorer(gate=gate)
    batcher = Batcher(object(), max_wait_ms=0, max_batch_tokens=3, score_fn=scorer)

    async def main():
        futures = [asyncio.ensure_future(batcher.submit(request(f"r{i}", 3))) for i in range(4)]
        while not scorer.entered.is_set():
            await asyncio.sleep(0.005)
        closing = asyncio.ensure_future(batcher.aclose(timeout=10))
        await asyncio.sleep(0.02)
        assert not closing.done()  # waits for the admitted requests
        with pytest.raises(BatcherClosed):
            await batcher.submit(request("late", 3))
        gate.set()
        outcomes = await asyncio.gather(*futures)
        assert await closing is True
        return outcomes

    outcomes = run(main())
    assert len(outcomes) == 4 and len(scorer.groups) == 4
    assert not batcher._thread.is_alive()


def test_a_cancelled_request_is_not_scored():
    gate = threading.Event()
    scorer = Scorer(gate=gate)
    batcher = Batcher(object(), max_wait_ms=0, max_batch_tokens=3, score_fn=scorer)

    async def main():
        first = asyncio.ensure_future(batcher.submit(request("first", 3)))
        while not scorer.entered.is_set():
            await asyncio.sleep(0.005)
        doomed = asyncio.ensure_future(batcher.submit(request("doomed", 3)))
        kept = asyncio.ensure_future(batcher.submit(request("kept", 3)))
        await asyncio.sleep(0.01)
        doomed.cancel()
        gate.set()
        return await asyncio.gather(first, kept)

    run(main())
    batcher.close(timeout=5)
    assert scorer.groups == [["first"], ["kept"]]


@pytest.mark.parametrize("kwargs", [{"max_queue": 0}, {"max_batch_tokens": 0}, {"max_wait_ms": -1}])
def test_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        Batcher(object(), **kwargs)


# ------------------------------------------------------------------------------------------ replicas (--devices)

class Replica:
    """A stand-in model copy: its name shows which replica scored a group."""

    def __init__(self, name: str):
        self.name = name
        self.device = name  # not a torch.device: bind_device leaves the thread alone


class ReplicaScorer(Scorer):
    """Records (replica, request names) per group and the replica threads that were scoring at the same time."""

    def __init__(self, *, broken: set[str] = frozenset(), **kwargs):
        super().__init__(**kwargs)
        self.broken = set(broken)
        self.by_replica: dict[str, list[str]] = {}
        self.busy = 0
        self.most_busy = 0
        self.lock = threading.Lock()

    def __call__(self, model, prepared, *, fast):
        with self.lock:
            self.by_replica.setdefault(model.name, []).extend(p.name for p in prepared)
            self.busy += 1
            self.most_busy = max(self.most_busy, self.busy)
        try:
            if model.name in self.broken:
                if self.delay:  # a broken GPU takes its time too: else it drains the queue before the other wakes
                    time.sleep(self.delay)
                raise RuntimeError(f"CUDA error on {model.name}: an illegal memory access was encountered")
            return super().__call__(model, prepared, fast=fast)
        finally:
            with self.lock:
                self.busy -= 1


def _submit_all(batcher, reqs):
    async def main():
        return await asyncio.gather(*(batcher.submit(p) for p in reqs), return_exceptions=True)

    return run(main())


def test_replicas_score_groups_at_the_same_time_and_the_wall_time_halves():
    reqs = [request(f"r{i}", 3) for i in range(12)]
    timings = {}
    for n in (1, 2):
        scorer = ReplicaScorer(delay=0.1)
        replicas = [Replica(f"gpu{i}") for i in range(n)]
        batcher = Batcher(replicas[0], replicas=replicas, max_wait_ms=0, max_batch_tokens=3, score_fn=scorer)
        start = time.monotonic()
        outcomes = _submit_all(batcher, reqs)
        timings[n] = time.monotonic() - start
        batcher.close(timeout=5)
        assert [o.scores for o in outcomes] == [expected_scores(p) for p in reqs]
        assert scorer.most_busy == n and set(scorer.by_replica) == {r.name for r in replicas}
    assert timings[1] >= 1.2 and timings[2] < 0.7 * timings[1], timings  # 12 groups of 0.1 s: 1.2 s vs ~0.6 s
    assert len(batcher._threads) == 2 and not any(t.is_alive() for t in batcher._threads)


def test_a_failing_replica_answers_its_own_requests_with_500_and_the_other_keeps_serving():
    scorer = ReplicaScorer(broken={"gpu1"}, delay=0.01)
    replicas = [Replica("gpu0"), Replica("gpu1")]
    batcher = Batcher(replicas[0], replicas=replicas, max_wait_ms=0, max_batch_tokens=3, score_fn=scorer,
                      retire_after_failures=None, retire_failure_rate=None, retry_on_another=False)
    reqs = [request(f"r{i}", 3) for i in range(40)]
    results = _submit_all(batcher, reqs)
    failed = {p.name for p, r in zip(reqs, results) if isinstance(r, InferenceError)}
    assert failed == set(scorer.by_replica["gpu1"]) and failed  # exactly the broken replica's requests
    assert all(r.scores == expected_scores(p) for p, r in zip(reqs, results) if p.name not in failed)
    assert all(str(r).startswith("model inference failed") for r in results if isinstance(r, InferenceError))
    stats = {r["name"]: r for r in batcher.stats()["replicas"]}
    assert stats["1:gpu1"]["failures"] == len(failed) and stats["0:gpu0"]["failures"] == 0
    assert stats["0:gpu0"]["requests"] == 40 - len(failed) == batcher.requests
    gpu1_before = len(scorer.by_replica["gpu1"])
    later = _submit_all(batcher, [request(f"later{i}", 3) for i in range(10)])  # both workers still take groups
    assert sum(isinstance(r, InferenceError) for r in later) == len(scorer.by_replica["gpu1"]) - gpu1_before
    assert any(not isinstance(r, BaseException) for r in later)
    batcher.close(timeout=5)


def test_a_replica_failing_group_after_group_retires_and_the_last_one_never_does():
    scorer = ReplicaScorer(broken={"gpu1"}, delay=0.01)
    replicas = [Replica("gpu0"), Replica("gpu1")]
    batcher = Batcher(replicas[0], replicas=replicas, max_wait_ms=0, max_batch_tokens=3, score_fn=scorer,
                      retire_after_failures=2, retry_on_another=False)
    results = _submit_all(batcher, [request(f"r{i}", 3) for i in range(30)])
    assert sum(isinstance(r, InferenceError) for r in results) == 2 == len(scorer.by_replica["gpu1"])
    assert [r["retired"] for r in batcher.stats()["replicas"]] == [False, True]
    more = _submit_all(batcher, [request(f"m{i}", 3) for i in range(10)])
    assert not any(isinstance(r, BaseException) for r in more) and len(scorer.by_replica["gpu1"]) == 2
    batcher.close(timeout=5)

    scorer = ReplicaScorer(broken={"gpu0", "gpu1"})  # every replica broken: the last one keeps answering (500s)
    batcher = Batcher(replicas[0], replicas=replicas, max_wait_ms=0, max_batch_tokens=3, score_fn=scorer,
                      retire_after_failures=1)
    results = _submit_all(batcher, [request(f"r{i}", 3) for i in range(10)])
    assert all(isinstance(r, InferenceError) for r in results)
    assert sum(r["retired"] for r in batcher.stats()["replicas"]) == 1
    batcher.close(timeout=5)


def test_replicas_under_concurrent_load_answer_every_request_exactly_once():
    rng = __import__("random").Random(0)

    class Jittery(ReplicaScorer):
        def __call__(self, model, prepared, *, fast):
            time.sleep(rng.random() * 0.004)
            return super().__call__(model, prepared, fast=fast)

    scorer = Jittery()
    replicas = [Replica(f"gpu{i}") for i in range(3)]
    batcher = Batcher(replicas[0], replicas=replicas, max_wait_ms=1, max_batch_tokens=20, max_queue=1000,
                      score_fn=scorer)
    reqs = [request(f"r{i}", 1 + i % 7, 2, questions=1 + i % 2) for i in range(300)]

    async def main():
        async def client(chunk):
            out = []
            for p in chunk:
                out.append(await batcher.submit(p))
                await asyncio.sleep(0)
            return out

        chunks = [reqs[k::12] for k in range(12)]
        answered = await asyncio.gather(*(client(c) for c in chunks))
        return {p.name: o for c, outs in zip(chunks, answered) for p, o in zip(c, outs)}

    outcomes = run(main())
    batcher.close(timeout=5)
    scored = [name for names in scorer.by_replica.values() for name in names]
    assert sorted(scored) == sorted(p.name for p in reqs)  # each scored once: none lost, none twice
    assert all(outcomes[p.name].scores == expected_scores(p) for p in reqs)  # each got its own scores
    assert len(scorer.by_replica) == 3 and batcher.requests == 300 and batcher.waiting == batcher.in_flight == 0


def test_rejects_an_empty_replica_list_and_a_zero_retirement():
    with pytest.raises(ValueError):
        Batcher(object(), replicas=[])
    with pytest.raises(ValueError):
        Batcher(object(), retire_after_failures=0)


def test_each_worker_binds_its_replicas_gpu(monkeypatch):
    """Streams, graph pools and Triton launches use the thread's current device: each worker sets its replica's."""
    import torch

    from hf_openjev.serve.batcher import use_device

    bound, entered = [], []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: bound.append((threading.current_thread().name,
                                                                                str(device))))
    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext(
        entered.append(str(device))))
    replicas = [SimpleNamespace(device=torch.device("cuda", i), name=f"gpu{i}") for i in (1, 3)]
    batcher = Batcher(replicas[0], replicas=replicas, max_wait_ms=0, score_fn=ReplicaScorer(), name="w")
    assert _submit_all(batcher, [request("a", 2)])[0].scores == expected_scores(request("a", 2))
    batcher.close(timeout=5)
    assert sorted(bound) == [("w-0", "cuda:1"), ("w-1", "cuda:3")]
    with use_device(replicas[1]), use_device(object()), use_device(SimpleNamespace(device=torch.device("cpu"))):
        pass
    assert entered == ["cuda:3"]

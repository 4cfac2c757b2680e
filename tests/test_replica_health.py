"""Replica health (hf_openjev.serve.replica_health and the batcher's group accounting): every failure counts
(non-finite scores included), a failed group is retried once on another replica, retirement by streak and by rate,
a deadline per group, and the states /health and /metrics show."""

from __future__ import annotations

import math
import threading
import time
from types import SimpleNamespace

import pytest
from test_batcher import Replica, ReplicaScorer, _submit_all, expected_scores, request

from hf_openjev.errors import InferenceError
from hf_openjev.serve.batcher import Batcher
from hf_openjev.serve.replica_health import HealthPolicy, ReplicaHealth, check_finite_scores


class NanScorer(ReplicaScorer):
    """The replicas named in ``nan`` return NaN scores (a broken device that does not raise)."""

    def __init__(self, *, nan=frozenset(), every_other=frozenset(), **kwargs):
        super().__init__(**kwargs)
        self.nan = set(nan)
        self.every_other = set(every_other)
        self.calls: dict[str, int] = {}

    def __call__(self, model, prepared, *, fast):
        result = super().__call__(model, prepared, fast=fast)
        with self.lock:
            self.calls[model.name] = self.calls.get(model.name, 0) + 1
            odd = self.calls[model.name] % 2 == 1
        if model.name in self.nan or (model.name in self.every_other and odd):
            result.scores = [[[math.nan for _ in q] for q in s] for s in result.scores]
        return result


def test_a_nan_returning_replica_counts_failures_is_retired_and_its_groups_are_retried():
    scorer = NanScorer(nan={"gpu1"}, delay=0.01)
    replicas = [Replica("gpu0"), Replica("gpu1")]
    batcher = Batcher(replicas[0], replicas=replicas, max_wait_ms=0, max_batch_tokens=3, score_fn=scorer)
    reqs = [request(f"r{i}", 3) for i in range(30)]
    results = _submit_all(batcher, reqs)
    batcher.close(timeout=5)
    assert all(r.scores == expected_scores(p) for p, r in zip(reqs, results))  # every one retried on gpu0
    stats = {r["name"]: r for r in batcher.stats()["replicas"]}
    assert stats["1:gpu1"]["failures"] == 3 and stats["1:gpu1"]["retired"] and stats["1:gpu1"]["state"] == "retired"
    assert stats["1:gpu1"]["requests"] == 0 and stats["0:gpu0"]["requests"] == 30
    assert batcher.stats()["replica_states"] == {"ok": 1, "degraded": 0, "retired": 1}


def test_a_replica_failing_every_other_group_is_retired_by_its_failure_rate():
    scorer = NanScorer(every_other={"gpu1"}, delay=0.005)
    replicas = [Replica("gpu0"), Replica("gpu1")]
    batcher = Batcher(replicas[0], replicas=replicas, max_wait_ms=0, max_batch_tokens=3, score_fn=scorer)
    reqs = [request(f"r{i}", 3) for i in range(60)]
    results = _submit_all(batcher, reqs)
    batcher.close(timeout=5)
    assert not any(isinstance(r, BaseException) for r in results)
    stats = {r["name"]: r for r in batcher.stats()["replicas"]}
    assert stats["1:gpu1"]["retired"] and "of its last" in stats["1:gpu1"]["retired_because"]
    assert scorer.calls["gpu1"] <= 10 < scorer.calls["gpu0"]  # it stopped drawing traffic


def test_a_group_is_retried_once_only():
    scorer = ReplicaScorer(broken={"gpu0", "gpu1"})
    replicas = [Replica("gpu0"), Replica("gpu1")]
    batcher = Batcher(replicas[0], replicas=replicas, max_wait_ms=0, max_batch_tokens=3, score_fn=scorer,
                      retire_after_failures=None, retire_failure_rate=None)
    results = _submit_all(batcher, [request("only", 3)])
    batcher.close(timeout=5)
    assert isinstance(results[0], InferenceError)
    assert sorted(scorer.by_replica) == ["gpu0", "gpu1"] and sum(map(len, scorer.by_replica.values())) == 2


def test_a_hung_replica_loses_its_group_at_the_deadline_and_another_answers_it():
    release, hung = threading.Event(), threading.Event()
    scorer = ReplicaScorer()

    def score(model, prepared, *, fast):
        if model.name == "gpu1":
            hung.set()
            release.wait(10)  # hangs
        else:
            assert hung.wait(5)  # gpu1 has taken a group before gpu0 answers any
        return scorer(model, prepared, fast=fast)

    replicas = [Replica("gpu1"), Replica("gpu0")]
    batcher = Batcher(replicas[0], replicas=replicas, max_wait_ms=0, max_batch_tokens=3, score_fn=score,
                      group_deadline_s=0.3)
    batcher.start()
    time.sleep(0.05)
    started = time.monotonic()
    results = _submit_all(batcher, [request(f"r{i}", 3) for i in range(4)])
    took = time.monotonic() - started
    stats = {r["name"]: r for r in batcher.stats()["replicas"]}
    release.set()
    batcher.close(timeout=5)
    assert all(r.scores == expected_scores(request(f"r{i}", 3)) for i, r in enumerate(results)), results
    assert took < 3.0 and stats["0:gpu1"]["failures"] == 1 and stats["0:gpu1"]["state"] == "retired"
    assert stats["0:gpu1"]["retired_because"] == "did not answer a group within 0.3 s"
    assert batcher.in_flight == 0


def test_the_deadline_fails_the_group_of_a_lone_hung_replica():
    release = threading.Event()

    def score(model, prepared, *, fast):
        release.wait(10)
        return SimpleNamespace(scores=[expected_scores(p) for p in prepared], seconds=0.0,
                               prefix_cache=[{} for _ in prepared], path="reference")

    batcher = Batcher(object(), max_wait_ms=0, score_fn=score, group_deadline_s=0.2)
    results = _submit_all(batcher, [request("x", 2)])
    release.set()
    batcher.close(timeout=5)
    assert isinstance(results[0], InferenceError) and "within 0.2 s" in str(results[0])
    assert batcher.failures == 1 and not batcher.replicas[0].retired  # the last replica never retires


def test_health_policy_rules():
    health = ReplicaHealth(HealthPolicy(streak=3, rate=0.3, window=10))
    for ok in (True, False, True, False):
        health.record(ok)
    assert health.state == "degraded" and health.retire_reason() == ""  # 4 groups known: too few for a rate
    health.record(True)
    assert health.retire_reason() == "failed 2 of its last 5 groups"
    streak = ReplicaHealth(HealthPolicy(streak=2, rate=None))
    streak.record(False)
    assert streak.retire_reason() == ""
    streak.record(False)
    assert streak.retire_reason() == "failed 2 groups in a row"
    with pytest.raises(ValueError, match="retire_failure_rate"):
        HealthPolicy(rate=1.5)
    with pytest.raises(ValueError, match="non-finite"):
        check_finite_scores([[[0.5, math.inf]]])

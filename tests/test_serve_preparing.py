"""Preparing requests off the event loop without head-of-line blocking (hf_openjev.serve.preparing): the pools by
size, tokenization from several threads at once, and a live server answering a small request within a second
while eight clients flood it with 4 MiB over-long bodies."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import JSON, NOUL, live_server, make_request

from hf_openjev.scoring import prepare_request
from hf_openjev.serve.app import create_app
from hf_openjev.serve.edge import MAX_BODY_BYTES
from hf_openjev.serve.preparing import (
    DEFAULT_BIG_WORK,
    DEFAULT_INLINE_CANDIDATES,
    DEFAULT_INLINE_WORK,
    PreparePools,
    measure_tokenize_work,
)


def test_pools_by_size_and_shutdown():
    pools = PreparePools(workers=1, big_workers=1)
    assert pools.pick(0) is pools.pick(DEFAULT_BIG_WORK) is pools.small
    assert pools.pick(DEFAULT_BIG_WORK + 1) is pools.big
    assert pools.submit(lambda: threading.current_thread().name).result().startswith("jev-prepare_")
    assert pools.big.submit(lambda: threading.current_thread().name).result().startswith("jev-prepare-big")
    pools.shutdown()
    with pytest.raises(RuntimeError):
        pools.big.submit(print)
    with pytest.raises(ValueError):
        PreparePools(big_work=0)


def test_tiny_work_runs_inline_and_never_more_than_big_work():
    pools = PreparePools(workers=1, big_workers=1)
    assert pools.runs_inline(0) and pools.runs_inline(DEFAULT_INLINE_WORK)
    assert not pools.runs_inline(DEFAULT_INLINE_WORK + 1)
    assert pools.answers_inline(DEFAULT_INLINE_CANDIDATES) and not pools.answers_inline(DEFAULT_INLINE_CANDIDATES + 1)
    assert PreparePools(big_work=100, inline_work=1000).inline_work == 100  # big work stays off the event loop
    assert not PreparePools(inline_work=0).runs_inline(1)
    with pytest.raises(ValueError):
        PreparePools(inline_work=-1)
    pools.shutdown()


def _threads_of_each_step(app, request: dict) -> dict[str, str]:
    """step (parse, tokenize, finish) -> the name of the thread that ran it, for one request answered 200."""
    from starlette.testclient import TestClient

    state, seen = app.state.jev, {}

    def spy(step, fn):
        def run(*args):
            seen[step] = threading.current_thread().name
            return fn(*args)
        return run

    for step in ("parse", "tokenize", "finish"):
        setattr(state, step, spy(step, getattr(state, step)))
    with TestClient(app) as client:
        response = client.post("/v1/systemone", json=request)
    assert response.status_code == 200, response.text
    return seen


def _pooled(name: str) -> bool:
    return name.startswith("jev-prepare")


def test_a_small_request_is_prepared_and_answered_on_the_event_loop(tiny_model):
    seen = _threads_of_each_step(create_app(tiny_model, max_wait_ms=0), make_request(0))
    assert not any(_pooled(name) for name in seen.values()), seen


def test_bigger_work_goes_to_its_pool_and_is_tokenized_where_it_was_parsed(tiny_model):
    state = {"ticket": 7, "body": "Refund please, I was charged twice. " * 120}  # 4.3 kB: over the inline work
    seen = _threads_of_each_step(create_app(tiny_model, max_wait_ms=0), {"state": state, "questions": {"q": NOUL}})
    assert seen["parse"].startswith("jev-prepare_") and seen["tokenize"] == seen["parse"], seen
    app = create_app(tiny_model, max_wait_ms=0)
    app.state.jev.executor = PreparePools(workers=1, big_workers=1, big_work=4200)  # the same work is big here
    seen = _threads_of_each_step(app, {"state": state, "questions": {"q": NOUL}})
    assert seen["parse"].startswith("jev-prepare-big") and seen["tokenize"].startswith("jev-prepare-big"), seen


def test_an_answer_of_many_candidates_is_built_on_a_pool(tiny_model):
    options = {f"team {i}": None for i in range(DEFAULT_INLINE_CANDIDATES + 1)}
    request = {"state": "x", "questions": {"q": {"type": "choice", "instructions": "Which?", "criteria": options}}}
    seen = _threads_of_each_step(create_app(tiny_model, max_wait_ms=0), request)
    assert _pooled(seen["finish"]) and not _pooled(seen["parse"]), seen


def test_tokenize_work_counts_candidate_characters(tiny_model):
    parsed = prepare_request(tiny_model, make_request(2)).parsed
    assert measure_tokenize_work(parsed) == sum(len(p) for q in parsed.questions for p in q.prompts) > 0


def test_requests_prepared_on_many_threads_at_once_equal_serial_ones(tiny_model):
    """The tokenizer is shared by the preparing threads with no lock: same tokens as one thread."""
    requests = [{"state": {"ticket": i, "body": "Refund please, I was charged twice. " * (1 + i % 40)},
                 "questions": make_request(i)["questions"]} for i in range(64)]
    serial = [prepare_request(tiny_model, r).tokens for r in requests]
    with ThreadPoolExecutor(max_workers=8) as pool:
        parallel = list(pool.map(lambda r: prepare_request(tiny_model, r).tokens, requests))
    assert parallel == serial


def _big_over_long_body(kind: str) -> bytes:
    """Refused for max_length: 4 MiB of words (refused after a short clean prefix), or 1 MiB of one long word (no
    cut before the prompt's tail: tokenized in full, ~0.7 s each; only the pools keep small requests clear of
    those; 1 MiB, not 4, keeps the test short)."""
    if kind == "words":
        size = MAX_BODY_BYTES - 200
        state = "word " * (size // 5)
    else:
        size = MAX_BODY_BYTES // 4
        state = "x" * size
    body = json.dumps({"state": state, "questions": {"q1": NOUL}}).encode()
    assert size < len(body) <= MAX_BODY_BYTES
    return body


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["words", "one-word"])
def test_small_requests_are_not_queued_behind_eight_clients_sending_4_mib_bodies(tiny_model, kind):
    big = _big_over_long_body(kind)
    stop = threading.Event()
    big_statuses: list[int] = []
    small_seconds: list[float] = []

    def flood(url):
        with httpx.Client(base_url=url, timeout=120) as http:
            while not stop.is_set():
                response = http.post("/v1/systemone", content=big, headers=JSON)
                big_statuses.append(response.status_code)
                if response.status_code != 422 or "exceeds max_length=4096" not in response.text:
                    raise AssertionError(response.text[:300])

    with live_server(create_app(tiny_model, max_wait_ms=5)) as (_, url):
        with ThreadPoolExecutor(max_workers=8) as pool:
            floods = [pool.submit(flood, url) for _ in range(8)]
            try:
                deadline = time.monotonic() + 60
                while len(big_statuses) < 8:  # the flood is on: every client has had a body answered
                    assert time.monotonic() < deadline and not any(f.done() for f in floods)
                    time.sleep(0.01)
                with httpx.Client(base_url=url, timeout=60) as http:
                    for i in range(6):
                        start = time.perf_counter()
                        response = http.post("/v1/systemone", json=make_request(i))
                        small_seconds.append(time.perf_counter() - start)
                        assert response.status_code == 200, response.text
                        time.sleep(0.05)
            finally:
                stop.set()
            for f in floods:
                f.result(timeout=120)
    assert len(big_statuses) >= 8
    # Without the pools a small request queues behind the 8 big ones' tokenization (8 x ~0.7 s here, twice that
    # on a slow CI machine); with them it waits ~0.3 s here. The bound sits between the two with room for a loaded
    # 2-core machine; the latency itself is measured by recipes/probe_big_bodies.py, not asserted.
    assert max(small_seconds) < 3.0, small_seconds

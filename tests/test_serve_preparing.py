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
from hf_openjev.serve.preparing import DEFAULT_BIG_WORK, PreparePools, measure_tokenize_work


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

"""The HTTP server (hf_openjev.serve.app, .edge, .startup): in-process, then a real uvicorn server on 127.0.0.1 with concurrent clients,
bad inputs, overload and shutdown; the official typesafe-sdk client and a jevcompat subset against it.

The model is the tiny random export, loaded once per module on CPU in float32.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from live_server import serving
from starlette.testclient import TestClient

from hf_openjev.export.tiny import build_tiny_checkpoint
from hf_openjev.model import load_export
from hf_openjev.scoring import answer_requests, score_prepared
from hf_openjev.serve.app import create_app
from hf_openjev.serve.edge import MAX_BODY_BYTES

JSON = {"content-type": "application/json"}
MSG_JSON = "request body is not valid JSON: "
# Scores of one candidate computed in differently shaped forwards (other requests' sequences padded alongside)
# agree to fp32 rounding, not bit for bit: ~1e-6 on a score, ~1e-7 on a probability.
COMPANY_TOL = 1e-5

CHOICE = {"type": "choice", "instructions": "Which team should handle this ticket?",
          "criteria": {"billing": "Payments, invoices, refunds", "technical": None, "sales": {"owns": ["pricing"]}}}
SCORE = {"type": "score", "instructions": "How frustrated is the customer?", "criteria": ["Calm", "Frustrated", "Angry"]}
NOUL = {"type": "noul", "instructions": "Does the customer want money back?",
        "criteria": {"true": "a refund", "false": "anything else"}}


def make_request(i: int = 0, *, model: str | None = "jev-latest") -> dict:
    """Requests of different shapes (so that batching pads them against each other)."""
    state = ["I was charged twice.", {"ticket": i, "body": "Refund please " * (1 + i % 4)}, ["a", "b", str(i)]][i % 3]
    questions = [{"team": CHOICE}, {"anger": SCORE, "refund": NOUL}, {"refund": NOUL, "team": CHOICE, "anger": SCORE}][i % 3]
    request = {"state": state, "questions": questions}
    if model is not None:
        request["model"] = model
    return request


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tiny = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-server"))
    return load_export(tiny.export, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def client(model):
    with TestClient(create_app(model)) as c:
        yield c


class _Reference(dict):
    """Answers of make_request(i) scored alone, as the pipeline does (computed on first use)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def __missing__(self, i):
        self[i] = answer_requests(self.model, [make_request(i)], fast=False)[0]
        return self[i]


@pytest.fixture(scope="module")
def reference(model):
    return _Reference(model)


def assert_same_answers(got: dict, want: dict, tol: float = 0.0) -> None:
    assert list(got["answers"]) == list(want["answers"])
    assert got["usage"] == want["usage"]
    assert got["model"] == want["model"]
    for qid, answer in want["answers"].items():
        other = got["answers"][qid]
        assert other["type"] == answer["type"]
        if answer["type"] == "noul":
            assert math.isclose(other["noul"], answer["noul"], rel_tol=0, abs_tol=tol)
            continue
        assert list(other["probabilities"]) == list(answer["probabilities"])
        for key, p in answer["probabilities"].items():
            assert math.isclose(other["probabilities"][key], p, rel_tol=0, abs_tol=tol), (qid, key)
        assert math.isclose(other["confidence"], answer["confidence"], rel_tol=0, abs_tol=10 * tol + 1e-15)
        if answer["type"] == "score":
            assert other["legend"] == answer["legend"]
            assert math.isclose(other["score"], answer["score"], rel_tol=0, abs_tol=10 * tol + 1e-15)


def assert_error(response, status: int, message: str | None = None, *, prefix: str | None = None,
                 loc: list | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error", "detail"}
    if message is not None:
        assert body["error"] == message
    if prefix is not None:
        assert body["error"].startswith(prefix), body["error"]
    [detail] = body["detail"]
    assert detail["msg"] == body["error"] and isinstance(detail["type"], str) and isinstance(detail["loc"], list)
    if status == 422:
        assert detail["loc"][:1] == ["body"]
    if loc is not None:
        assert detail["loc"] == loc
    assert response.headers["x-request-id"]
    return body


# ------------------------------------------------------------------------------------------------ in-process

def test_health_and_models(client, model):
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == list(model.served_model_names)
    assert all(m["object"] == "model" for m in body["data"])
    assert body["data"][0]["id"] == model.model_id and "jev-latest" in body["data"][0]["aliases"]
    names = [m["name"] for m in body["models"]]  # the TypeSafe shape
    assert names == list(model.served_model_names)
    assert all(len(m["release_date"]) == 10 and m["description"] for m in body["models"])


def test_answer_equals_the_pipeline_and_carries_the_request_id(client, reference):
    for path in ("/v1/systemone", "/v1/inference"):
        response = client.post(path, json=make_request(2), headers={"X-Request-Id": "req-42.a"})
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/json"
        assert response.headers["x-request-id"] == response.headers["x-typesafe-request-id"] == "req-42.a"
        body = response.json()
        assert_same_answers(body, reference[2])  # alone in its batch: bit for bit
        meta = body["metadata"]
        assert meta["request_id"] == "req-42.a"
        assert meta["method"] == "reference" and meta["candidate_sequences"] == 7
        assert meta["batch"]["requests"] >= 1
        assert list(body) == ["model", "answers", "usage", "metadata"]


def test_request_id_is_generated_when_absent_or_unsafe(client):
    a = client.post("/v1/systemone", json=make_request(0))
    b = client.post("/v1/systemone", json=make_request(0), headers={"X-Request-Id": "bad id\twith spaces"})
    ids = {a.headers["x-request-id"], b.headers["x-request-id"], a.json()["metadata"]["request_id"]}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)
    assert a.json()["metadata"]["request_id"] == a.headers["x-request-id"]


def test_content_type_variants_and_encodings(client, reference):
    body = json.dumps(make_request(0)).encode()
    ok = client.post("/v1/systemone", content=body, headers={"content-type": "Application/JSON; charset=UTF-8"})
    assert ok.status_code == 200
    zipped = client.post("/v1/systemone", content=gzip.compress(body),
                         headers={**JSON, "content-encoding": "gzip"})
    assert zipped.status_code == 200
    assert_same_answers(zipped.json(), reference[0])


def test_zstd_bodies_as_the_typesafe_sdk_sends_them(client, reference):
    """typesafe-sdk compresses bodies of 1 KiB and more with zstd when it can (Python 3.14, or backports.zstd)."""
    from hf_openjev.serve.edge import _zstd_decompressor

    body = json.dumps(make_request(0)).encode()
    headers = {**JSON, "content-encoding": "zstd"}
    if _zstd_decompressor() is None:
        assert_error(client.post("/v1/systemone", content=body, headers=headers), 415,
                     loc=["header", "content-encoding"])
        return
    try:
        from compression import zstd
    except ImportError:
        from backports import zstd
    response = client.post("/v1/systemone", content=zstd.compress(body), headers=headers)
    assert response.status_code == 200, response.text
    assert_same_answers(response.json(), reference[0])
    assert_error(client.post("/v1/systemone", content=zstd.compress(b" " * (MAX_BODY_BYTES + 1)), headers=headers), 413)
    assert_error(client.post("/v1/systemone", content=b"\x28\xb5\x2f\xfd garbage", headers=headers), 422,
                 prefix=MSG_JSON)


def _question_with_long_state(model) -> dict:
    return {"state": "word " * (model.max_length + 10), "questions": {"q1": dict(NOUL)}}


BAD_REQUESTS = [
    # (id, body, headers, status, message or prefix, loc)
    ("no-content-type", b'{"state": "x"}', {}, 415, "Content-Type must be application/json", ["header", "content-type"]),
    ("text-plain", b'{"state": "x"}', {"content-type": "text/plain"}, 415, "Content-Type must be application/json", None),
    ("json-suffix", b'{"state": "x"}', {"content-type": "application/problem+json"}, 415, None, None),
    ("415-before-413", b" " * (MAX_BODY_BYTES + 1), {"content-type": "text/plain"}, 415, None, None),
    ("too-large", b" " * (MAX_BODY_BYTES + 1), JSON, 413, "request body size is outside server limits", None),
    ("gzip-bomb", gzip.compress(b" " * (MAX_BODY_BYTES + 10)), {**JSON, "content-encoding": "gzip"}, 413, None, None),
    ("bad-gzip", b"not gzip", {**JSON, "content-encoding": "gzip"}, 422, MSG_JSON, ["body"]),
    ("unknown-encoding", b"{}", {**JSON, "content-encoding": "br"}, 415, None, None),
    ("syntax", b'{"state": "x", ', JSON, 422, MSG_JSON, ["body"]),
    ("empty", b"", JSON, 422, MSG_JSON, None),
    ("duplicate-key", b'{"state": "x", "state": "y", "questions": {}}', JSON, 422, MSG_JSON + "duplicate key 'state'", None),
    ("nan", b'{"state": NaN}', JSON, 422, MSG_JSON + "NaN is not a JSON value", None),
    ("infinity", b'{"state": "x", "questions": {"q": {"type": "noul", "instructions": [-Infinity]}}}', JSON, 422, MSG_JSON,
     None),
    ("overflow", b'{"state": [1e999]}', JSON, 422, MSG_JSON, None),
    ("invalid-utf8", b'{"state": "\xc3\x28"}', JSON, 422, MSG_JSON + "invalid UTF-8 at byte 11", None),
    ("lone-surrogate", b'{"state": "\\udc00", "questions": {}}', JSON, 422, MSG_JSON, None),
    ("deep", b"[" * 5000 + b"]" * 5000, JSON, 422, MSG_JSON, None),
    ("top-level-array", b"[]", JSON, 422, "request body must be a JSON object", ["body"]),
    ("dup-beats-model", b'{"model": "gpt-4", "model": "x"}', JSON, 422, MSG_JSON, None),
    ("unknown-model", b'{"model": "gpt-4", "state": "x", "questions": {}}', JSON, 422, "requested model is not loaded",
     ["body", "model"]),
    ("missing-state", b'{"questions": {}}', JSON, 422, "request requires state", ["body", "state"]),
    ("state-number", b'{"state": 3, "questions": {}}', JSON, 422, "state must be text, a JSON object, or an array",
     ["body", "state"]),
    ("empty-questions", b'{"state": "x", "questions": {}}', JSON, 422,
     "questions must be nonempty and within the server question limit", ["body", "questions"]),
    ("bad-type", json.dumps({"state": "x", "questions": {"ok": NOUL, "q2": {"type": "boolean", "instructions": "?"}}}).encode(),
     JSON, 422, "question type must be choice, score, or noul", ["body", "questions", "q2"]),
    ("choice-256", json.dumps({"state": "x", "questions": {"c": {"type": "choice", "instructions": "?",
                                                                  "criteria": {str(i): None for i in range(256)}}}}).encode(),
     JSON, 422, "Choice requires between 1 and 255 candidates", ["body", "questions", "c"]),
    ("score-null-level", json.dumps({"state": "x", "questions": {"s": {"type": "score", "instructions": "?",
                                                                        "criteria": ["a", None]}}}).encode(),
     JSON, 422, "instructions and descriptions must be text, an object, or an array", ["body", "questions", "s"]),
    ("noul-one-sided", json.dumps({"state": "x", "questions": {"n": {"type": "noul", "instructions": "?",
                                                                      "criteria": {"true": "yes"}}}}).encode(),
     JSON, 422, "Noul criteria must contain true and false descriptions", ["body", "questions", "n"]),
]


@pytest.mark.parametrize("name, body, headers, status, message, loc", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_the_contract_error(client, name, body, headers, status, message, loc):
    response = client.post("/v1/systemone", content=body, headers=headers)
    if message is not None and message.endswith(": "):
        assert_error(response, status, prefix=message, loc=loc)
    else:
        assert_error(response, status, message, loc=loc)


def test_over_long_candidate_is_rejected_before_inference(client, model):
    response = client.post("/v1/systemone", json=_question_with_long_state(model))
    body = assert_error(response, 422, loc=["body", "questions", "q1"])
    assert body["error"].startswith("question q1: ")
    assert body["error"].endswith(f"tokens exceeds max_length={model.max_length}; no silent truncation")


def test_unknown_routes_and_methods_are_json(client):
    assert_error(client.get("/v1/systemone"), 405)
    assert_error(client.get("/nope"), 404)


def _run_async(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_the_fast_path_is_set_up_when_the_app_is_created_and_scores_with_its_options(tiny_checkpoint):
    from hf_openjev.fast_options import FastPathOptions
    from hf_openjev.packing.planner import plan_requests
    from hf_openjev.patches import patch_record
    from hf_openjev.scoring import prepare_request

    own = load_export(tiny_checkpoint.export, dtype=torch.float32, device="cpu")
    assert patch_record(own) is None
    options = FastPathOptions(share_tails=False, min_shared_tokens=64)  # aligned sharing: not the default
    app = create_app(own, fast=True, options=options)
    assert patch_record(own).options == options  # patched at creation, before any request
    request = make_request(2)
    tokens = prepare_request(own, request).tokens
    aligned = plan_requests([tokens], share_tails=False, min_shared_tokens=64).shared_tokens[0]
    assert aligned != plan_requests([tokens]).shared_tokens[0]  # the options show in the response
    with TestClient(app) as c:
        body = c.post("/v1/systemone", json=request, headers=JSON).json()
    assert body["metadata"]["method"] == "fast"
    assert body["metadata"]["prefix_cache"] == {"enabled": True, "mode": "prefix-tree", "shared_tokens": aligned}


def test_model_failure_is_500_for_the_whole_group_and_nothing_partial(model):
    def broken(model, prepared, *, fast):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    app = create_app(model, score_fn=broken, max_wait_ms=100)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await asyncio.gather(*(c.post("/v1/systemone", json=make_request(i)) for i in range(3)))

    for response in _run_async(main()):
        body = assert_error(response, 500, "model inference failed")
        assert "answers" not in body and "CUDA" not in response.text
    assert app.state.jev.batcher.failures >= 1


def test_non_finite_score_is_an_inference_failure(model):
    def nan_scores(model, prepared, *, fast):
        result = score_prepared(model, prepared, fast=False)
        result.scores[0][0][0] = float("nan")
        return result

    with TestClient(create_app(model, score_fn=nan_scores)) as c:
        assert_error(c.post("/v1/systemone", json=make_request(0)), 500, "model inference failed")


def test_answers_do_not_depend_on_company(model, reference):
    """Concurrent requests share forwards; each answer equals the request scored alone (to fp32 rounding)."""
    app = create_app(model, max_wait_ms=300)
    requests = [make_request(i) for i in range(6)]

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await asyncio.gather(*(c.post("/v1/systemone", json=r) for r in requests))

    responses = _run_async(main())
    assert all(r.status_code == 200 for r in responses)
    bodies = [r.json() for r in responses]
    assert max(b["metadata"]["batch"]["requests"] for b in bodies) > 1  # they really were batched
    for i, body in enumerate(bodies):
        assert_same_answers(body, reference[i], tol=COMPANY_TOL)


def test_shutdown_drains_in_flight_requests_and_refuses_new_ones(model):
    gate = threading.Event()
    entered = threading.Event()

    def gated(model, prepared, *, fast):
        entered.set()
        assert gate.wait(20)
        return score_prepared(model, prepared, fast=False)

    app = create_app(model, score_fn=gated, max_wait_ms=0)

    async def main():
        receive, send = asyncio.Queue(), asyncio.Queue()
        await receive.put({"type": "lifespan.startup"})
        lifespan = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                             receive.get, send.put))
        assert (await send.get())["type"] == "lifespan.startup.complete"
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            in_flight = [asyncio.ensure_future(c.post("/v1/systemone", json=make_request(i))) for i in range(3)]
            while not entered.is_set():
                await asyncio.sleep(0.01)
            await receive.put({"type": "lifespan.shutdown"})
            await asyncio.sleep(0.05)
            late = await c.post("/v1/systemone", json=make_request(0))
            late_bad = await c.post("/v1/systemone", content=b"{", headers=JSON)
            health = await c.get("/health")
            assert not lifespan.done()  # still draining
            gate.set()
            answered = await asyncio.gather(*in_flight)
        assert (await send.get())["type"] == "lifespan.shutdown.complete"
        await lifespan
        return answered, late, late_bad, health

    answered, late, late_bad, health = _run_async(main())
    assert [r.status_code for r in answered] == [200, 200, 200]
    assert all(r.json()["answers"] for r in answered)
    assert_error(late, 503, "server is shutting down")
    assert late.headers["retry-after"] == "1"
    assert_error(late_bad, 422)  # bad input is still a 4xx
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert not app.state.jev.batcher._thread.is_alive()


# ------------------------------------------------------------------------------------------------ live server

@contextlib.contextmanager
def live_server(app):
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=20)
    server = uvicorn.Server(config)
    with serving(server) as (url, thread):
        yield server, url
    assert not thread.is_alive(), "uvicorn did not stop"


LIVE_BAD = [(b, h, s) for _, b, h, s, _, _ in BAD_REQUESTS if len(b) < 100_000] + [
    (b" " * (MAX_BODY_BYTES + 1), JSON, 413),
]


def _post(http: httpx.Client, item):
    kind, payload = item
    if kind == "good":
        return kind, payload, http.post("/v1/systemone", json=make_request(payload))
    body, headers, status = payload
    return kind, status, http.post("/v1/systemone", content=body, headers=headers)


def _post_concurrently(url: str, work: list, *, workers: int) -> list:
    """``_post`` every item of ``work`` from ``workers`` threads, one keep-alive client per thread."""
    local = threading.local()

    def call(item):
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=url, timeout=60)
        return _post(local.http, item)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(call, work))


def test_live_server_concurrent_clients_and_bad_inputs(model, reference):
    work = [("good", i % 6) for i in range(12)] + [("bad", b) for b in LIVE_BAD]
    work = [work[(7 * k) % len(work)] for k in range(len(work))]  # interleave good and bad
    assert len({id(w) for w in work}) == len(work)
    with live_server(create_app(model, max_wait_ms=20)) as (_, url):
        results = _post_concurrently(url, work, workers=8)
        with httpx.Client(base_url=url, timeout=30) as http:
            chunks = (b" " * 65536 for _ in range(80))  # chunked, no Content-Length, 5 MiB
            chunked = http.post("/v1/systemone", content=chunks, headers=JSON)
            models = http.get("/v1/models")
            health = http.get("/health")
    assert_error(chunked, 413)
    assert models.status_code == 200 and health.status_code == 200
    for kind, expected, response in results:
        assert response.status_code < 500, response.text
        if kind == "good":
            assert response.status_code == 200, response.text
            body = response.json()
            assert_same_answers(body, reference[expected], tol=COMPANY_TOL)
        else:
            assert response.status_code == expected, response.text
            assert_error(response, expected)


def test_live_server_overload_gets_only_200_or_503_and_loses_nothing(model):
    def slow(model, prepared, *, fast):
        time.sleep(0.05)
        return score_prepared(model, prepared, fast=False)

    app = create_app(model, score_fn=slow, max_queue=2, max_wait_ms=0, max_batch_tokens=1)  # one request per forward
    work = [("good", i % 3) for i in range(40)] + [("bad", (b'{"state": NaN}', JSON, 422))] * 8
    work = [work[(7 * k) % len(work)] for k in range(len(work))]
    with live_server(app) as (_, url):
        results = _post_concurrently(url, work, workers=16)
        stats = app.state.jev.batcher.stats()
    statuses = [(kind, r.status_code) for kind, _, r in results]
    assert len(results) == len(work)
    assert all(s in (200, 503) for k, s in statuses if k == "good"), statuses
    assert all(s == 422 for k, s in statuses if k == "bad"), statuses  # bad input is never a 503
    accepted = [r for kind, _, r in results if kind == "good" and r.status_code == 200]
    refused = [r for kind, _, r in results if kind == "good" and r.status_code == 503]
    assert accepted and refused, statuses
    for r in refused:
        assert_error(r, 503, "server is busy")
        assert r.headers["retry-after"] == "1"
    for r in accepted:  # every admitted request was answered in full
        body = r.json()
        assert body["answers"] and body["usage"]["input_tokens"] > 0
    assert stats["requests"] == len(accepted) and stats["failures"] == 0


def test_live_server_graceful_shutdown_answers_the_request_in_flight(model):
    gate, entered = threading.Event(), threading.Event()

    def gated(model, prepared, *, fast):
        entered.set()
        assert gate.wait(20)
        return score_prepared(model, prepared, fast=False)

    with live_server(create_app(model, score_fn=gated, max_wait_ms=0)) as (server, url):
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(httpx.post, url + "/v1/systemone", json=make_request(1), timeout=60)
            assert entered.wait(20)
            server.should_exit = True  # what SIGTERM does
            time.sleep(0.2)
            assert not pending.done()
            gate.set()
            response = pending.result(timeout=30)
    assert response.status_code == 200 and set(response.json()["answers"]) == {"anger", "refund"}


# ------------------------------------------------------------------------------------------------ ecosystem clients

@pytest.fixture(scope="module")
def live_url(model):
    with live_server(create_app(model)) as (_, url):
        yield url


def test_typesafe_sdk_parses_answers(live_url):
    sdk = pytest.importorskip("typesafe_sdk")
    questions = {
        "refund": sdk.Noul(instructions="Does the customer want money back?"),
        "team": sdk.Choice(instructions="Which team?", criteria={"Billing": "Payments", "Technical": None}),
        "anger": sdk.Score(instructions="How frustrated?", criteria=["Calm", {"label": "Frustrated"}, ["Very", "angry"]]),
    }
    with sdk.TypeSafeClient(api_key="local", base_url=live_url, timeout=60,
                            retry=sdk.RetryPolicy(max_retries=0)) as client:
        # over 1 KiB: the SDK sends it zstd-compressed where it can (Python 3.14 or backports.zstd)
        state = {"ticket": "I was charged twice 😡", "history": [f"message {i}: still no refund" for i in range(40)]}
        response = client.system_one(state=state, questions=questions)
        assert 0.0 <= response.nouls["refund"].noul <= 1.0
        team = response.choices["team"]
        assert team.choice in ("Billing", "Technical") and math.isclose(sum(team.probabilities.values()), 1.0)
        anger = response.scores["anger"]
        assert anger.legend == {0: "Calm", 1: {"label": "Frustrated"}, 2: ["Very", "angry"]}
        assert set(anger.probabilities) == {0, 1, 2}
        assert response.usage.input_tokens > 0 and response.usage.output_tokens == 0
        assert len(response.request_id) == 32
        assert "jev-latest" in [m.name for m in client.models.list().models]
        with pytest.raises(sdk.TypeSafeUnprocessableEntityError) as info:
            client.system_one(state="x", questions={"s": sdk.Score(instructions="?", criteria=["only one"])})
        assert info.value.status == 422 and "Score requires 2 to 10 descriptive levels" in str(info.value)


# docs/contract.md §2 rejects one-sided noul criteria (as Open-Jev does); jevcompat's noul.criteria MUST accepts them.
KNOWN_DEVIATIONS = {"noul.criteria"}


@pytest.mark.slow
def test_jevcompat_conformance_suite(live_url):
    """The whole jevcompat suite (PyPI; ~60 requests, a few seconds on an idle CPU), official SDK check included."""
    runner = pytest.importorskip("jevcompat.runner")
    report = runner.run(live_url, timeout=120)
    assert report.aborted is None and not report.case_errors and not report.inconclusive
    assert report.untested_musts == []
    results = {r.id: r for r in report.results}
    failed_musts = {r.id for r in report.results if r.level == "MUST" and r.status == "fail"}
    assert failed_musts <= KNOWN_DEVIATIONS, {rid: [f.message for f in results[rid].findings] for rid in failed_musts}
    for rid in ("errors.no-5xx", "dropin.sdk-python", "request.model-alias", "choice.options", "score.levels",
                "semantics.question-id", "semantics.batching", "semantics.question-order", "http.models",
                "errors.validation-shape", "errors.reject-invalid", "confidence.formula"):
        assert results[rid].status == "pass", (rid, results[rid].status, [f.message for f in results[rid].findings])


# ------------------------------------------------------------------------------------------------ command line

def test_serve_arguments_reach_serve(monkeypatch):
    import argparse

    from hf_openjev.serve import cli as serve_cli
    from hf_openjev.serve import startup

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    seen = {}
    monkeypatch.setattr(startup, "serve", lambda model_dir, **kw: seen.update(model_dir=model_dir, **kw) or 0)
    args = parser.parse_args(["--model", "/x", "--port", "9001", "--max-queue", "3", "--max-wait-ms", "2.5",
                              "--max-batch-tokens", "100", "--reference", "--dtype", "float32"])
    assert serve_cli.run(args) == 0
    assert seen["model_dir"] == "/x" and seen["port"] == 9001 and seen["host"] == "127.0.0.1"
    assert (seen["max_queue"], seen["max_wait_ms"], seen["max_batch_tokens"]) == (3, 2.5, 100)
    assert seen["fast"] is False and seen["dtype"] == "float32"
    assert parser.parse_args(["--model", "/x"]).fast is None
    assert seen["warm_up_shapes"] is None
    serve_cli.run(parser.parse_args(["--model", "/x", "--warm-up", "shapes.json"]))
    assert seen["warm_up_shapes"] == "shapes.json"


@pytest.mark.slow
def test_cli_server_drains_on_sigterm(model, tmp_path):
    """``hf-openjev serve`` in a subprocess: a request in flight when SIGTERM arrives is still answered, and the
    server shuts down cleanly (the gated version of this, deterministic, is the live-server shutdown test above)."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    export = model.backbone.config._name_or_path
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hf_openjev.cli", "serve", "--model", export, "--port", str(port),
                                 "--device", "cpu", "--dtype", "float32", "--reference"],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "the server did not come up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(httpx.post, url + "/v1/systemone", json=make_request(2), timeout=120)
            while not pending.done():  # SIGTERM once the server holds the request (or it is already answered)
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=5).json()["active_requests"] >= 1:
                        break
                time.sleep(0.005)
            proc.send_signal(signal.SIGTERM)
            response = pending.result(timeout=120)
        assert proc.wait(timeout=60) == 0  # a clean drain: the signal is not raised again
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert response.status_code == 200 and list(response.json()["answers"]) == ["refund", "team", "anger"]
    text = (tmp_path / "server.log").read_text()
    assert "shutdown complete" in text and "Traceback" not in text

"""What an operator expects of the server (hf_openjev.serve.middleware, .keys, .lifecycle): readiness, Prometheus metrics,
drain on SIGTERM, JSON access logs with the request id, API keys (jevcompat's auth checks included).

The model is the session's tiny random export (fp32, CPU), scored on the reference path.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import serving
from prometheus_client.parser import text_string_to_metric_families

from hf_openjev.errors import CheckpointError, InputFileError, UsageError
from hf_openjev.scoring import score_prepared
from hf_openjev.serve.app import create_app
from hf_openjev.serve.keys import API_KEYS_ENV, KeyChecker, read_api_keys
from hf_openjev.serve.lifecycle import LoadingApp, begin_drain, build_server
from hf_openjev.serve.middleware import ACCESS_LOGGER, OpsMiddleware, ServerOps

NOUL = {"type": "noul", "instructions": "Does the customer want money back?"}
REQUEST = {"state": "I was charged twice.", "questions": {"refund": NOUL}}
KEYS = ("key-alpha-0123456789", "key-beta-9876543210", "key-gamma-5555555555")


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


class _Lifespan:
    """Drives an ASGI app's lifespan by hand (startup, then shutdown), as uvicorn does."""

    def __init__(self, app):
        self.app, self.inbox, self.outbox = app, asyncio.Queue(), asyncio.Queue()

    async def start(self):
        self.task = asyncio.ensure_future(self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                   self.inbox.get, self.outbox.put))
        await self.inbox.put({"type": "lifespan.startup"})
        assert (await self.outbox.get())["type"] == "lifespan.startup.complete"

    async def stop(self):
        await self.inbox.put({"type": "lifespan.shutdown"})
        assert (await self.outbox.get())["type"] == "lifespan.shutdown.complete"
        await self.task


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def _metrics(text: str) -> dict:
    """``{(sample name, frozenset(labels)): value}`` through prometheus_client's own text parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def _sample(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


# ------------------------------------------------------------------------------------------------ readiness

def test_health_is_503_starting_until_the_lifespan_ran_then_200(tiny_model):
    app = create_app(tiny_model)

    async def main():
        async with _client(app) as c:
            before = await c.get("/health")
            live = await c.get("/health/live")
            lifespan = _Lifespan(app)
            await lifespan.start()
            ready = await c.get("/health")
            await lifespan.stop()
            after = await c.get("/health")
        return before, live, ready, after

    before, live, ready, after = _run(main())
    assert before.status_code == 503 and before.json()["status"] == "starting" and before.json()["ready"] is False
    assert live.status_code == 200 and live.json() == {"status": "alive"}
    assert ready.status_code == 200 and ready.json()["status"] == "ok" and ready.json()["ready"] is True
    assert after.status_code == 503 and after.json()["status"] == "draining"


def test_loading_app_answers_503_while_loading_and_warming_up_then_serves(tiny_model):
    loaded, warming, release = threading.Event(), threading.Event(), threading.Event()

    def build(report_stage):
        assert loaded.wait(20)
        report_stage("warming_up")
        warming.set()
        assert release.wait(20)
        return create_app(tiny_model)

    loading = LoadingApp(build)
    seen = []

    async def main():
        lifespan = _Lifespan(loading)
        await lifespan.start()
        async with _client(loading) as c:
            seen.append(await c.get("/health"))
            seen.append(await c.post("/v1/systemone", json=REQUEST))
            loaded.set()
            while not warming.is_set():
                await asyncio.sleep(0.01)
            seen.append(await c.get("/health"))
            release.set()
            for _ in range(2000):
                ready = await c.get("/health")
                if ready.status_code == 200:
                    break
                await asyncio.sleep(0.01)
            seen.append(ready)
            seen.append(await c.post("/v1/systemone", json=REQUEST))
        await lifespan.stop()

    _run(main())
    loading_health, early, warming_health, ready, answered = seen
    assert loading_health.status_code == 503 and loading_health.json()["status"] == "loading"
    assert early.status_code == 503 and early.json()["error"] == "server is starting"
    assert early.headers["retry-after"]
    assert warming_health.status_code == 503 and warming_health.json()["status"] == "warming_up"
    assert ready.status_code == 200 and ready.json()["status"] == "ok"
    assert answered.status_code == 200 and answered.json()["answers"]["refund"]["type"] == "noul"
    assert loading.app.state.jev.draining  # its lifespan was shut down with the loader's
    assert not loading.app.state.jev.batcher._thread.is_alive()


def test_loading_failure_stops_the_server_and_keeps_the_error():
    stopped = []

    def build(report_stage):
        raise CheckpointError("/nope has no manifest.json")

    loading = LoadingApp(build, on_failure=lambda: stopped.append(True))

    async def main():
        lifespan = _Lifespan(loading)
        await lifespan.start()
        while not stopped:
            await asyncio.sleep(0.01)
        async with _client(loading) as c:
            health = await c.get("/health")
        await lifespan.stop()
        return health

    health = _run(main())
    assert isinstance(loading.error, CheckpointError) and stopped == [True]
    assert health.status_code == 503 and health.json()["status"] == "failed"


# ------------------------------------------------------------------------------------------------ metrics

def test_metrics_parse_and_count_requests_decisions_batches_and_device_time(tiny_model):
    app = create_app(tiny_model, max_wait_ms=0)
    other = create_app(tiny_model)  # a second app in the same process: its own registry

    async def main():
        lifespan = _Lifespan(app)
        await lifespan.start()
        async with _client(app) as c:
            ok = await c.post("/v1/systemone", json=REQUEST)
            bad = await c.post("/v1/inference", content=b"{", headers={"content-type": "application/json"})
            await c.get("/nope")
            scrape = await c.get("/metrics")
        async with _client(other) as c:
            other_scrape = await c.get("/metrics")
        await lifespan.stop()
        return ok, bad, scrape, other_scrape

    ok, bad, scrape, other_scrape = _run(main())
    assert ok.status_code == 200 and bad.status_code == 422
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    samples = _metrics(scrape.text)
    assert _sample(samples, "hf_openjev_requests_total", route="/v1/systemone", status="200") == 1
    assert _sample(samples, "hf_openjev_requests_total", route="/v1/inference", status="422") == 1
    assert _sample(samples, "hf_openjev_requests_total", route="other", status="404") == 1  # no path explosion
    assert _sample(samples, "hf_openjev_decisions_total", outcome="ok") == 1
    assert _sample(samples, "hf_openjev_decisions_total", outcome="rejected") == 1
    assert _sample(samples, "hf_openjev_request_seconds_count", route="/v1/systemone") == 1
    assert _sample(samples, "hf_openjev_batch_requests_count") == 1
    assert _sample(samples, "hf_openjev_batch_requests_sum") == 1
    assert _sample(samples, "hf_openjev_batch_tokens_sum") == ok.json()["usage"]["input_tokens"]
    assert _sample(samples, "hf_openjev_device_busy_seconds_total", device="cpu") > 0
    assert _sample(samples, "hf_openjev_queue_depth") == 0
    assert _sample(samples, "hf_openjev_requests_in_flight") == 0
    assert _sample(samples, "hf_openjev_ready") == 1
    other_samples = _metrics(other_scrape.text)
    assert _sample(other_samples, "hf_openjev_requests_total", route="/v1/systemone", status="200") is None
    assert _sample(other_samples, "hf_openjev_ready") == 0  # its lifespan never ran


def test_a_request_counts_on_counters_looked_up_once_per_route_and_status(monkeypatch):
    ops = ServerOps()
    lookups = []
    for metric in (ops.requests, ops.request_seconds, ops.decisions):
        real = metric.labels
        monkeypatch.setattr(metric, "labels", lambda *a, real=real, **k: lookups.append(k) or real(*a, **k))
    for _ in range(3):
        ops.record_request("/v1/systemone", 200, 0.01)
        ops.record_request("/nowhere", 404, 0.01)
        ops.record_request("/elsewhere", 404, 0.01)  # another unknown path: the same route, "other"
    assert len(lookups) == 3 + 2  # decision route: requests, seconds, outcome; "other": requests, seconds
    samples = _metrics(ops.render_metrics().decode())
    assert _sample(samples, "hf_openjev_requests_total", route="/v1/systemone", status="200") == 3
    assert _sample(samples, "hf_openjev_requests_total", route="other", status="404") == 6
    assert _sample(samples, "hf_openjev_decisions_total", outcome="ok") == 3
    assert _sample(samples, "hf_openjev_request_seconds_count", route="other") == 6


def test_queue_depth_and_in_flight_are_read_at_scrape_time(tiny_model):
    gate, entered = threading.Event(), threading.Event()

    def gated(model, prepared, *, fast):
        entered.set()
        assert gate.wait(20)
        return score_prepared(model, prepared, fast=False)

    app = create_app(tiny_model, score_fn=gated, max_wait_ms=0, max_batch_tokens=1)  # one request per forward

    async def main():
        lifespan = _Lifespan(app)
        await lifespan.start()
        async with _client(app) as c:
            pending = [asyncio.ensure_future(c.post("/v1/systemone", json=REQUEST)) for _ in range(3)]
            while not (entered.is_set() and app.state.jev.batcher.waiting == 2):
                await asyncio.sleep(0.01)
            scrape = await c.get("/metrics")
            gate.set()
            answered = await asyncio.gather(*pending)
        await lifespan.stop()
        return scrape, answered

    scrape, answered = _run(main())
    assert [r.status_code for r in answered] == [200, 200, 200]
    samples = _metrics(scrape.text)
    assert _sample(samples, "hf_openjev_queue_depth") == 2
    assert _sample(samples, "hf_openjev_requests_in_flight") == 3


# ------------------------------------------------------------------------------------------------ drain

def test_drain_refuses_new_requests_with_503_and_health_says_draining(tiny_model):
    app = create_app(tiny_model)

    async def main():
        lifespan = _Lifespan(app)
        await lifespan.start()
        async with _client(app) as c:
            before = await c.get("/health")
            assert begin_drain(app)
            health = await c.get("/health")
            late = await c.post("/v1/systemone", json=REQUEST)
            models = await c.get("/v1/models")
            scrape = await c.get("/metrics")
        await lifespan.stop()
        return before, health, late, models, scrape

    before, health, late, models, scrape = _run(main())
    assert before.status_code == 200
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert late.status_code == 503 and late.json()["error"] == "server is shutting down"
    assert late.headers["retry-after"] == "1"
    assert models.status_code == 200  # only new decisions are refused
    samples = _metrics(scrape.text)
    assert _sample(samples, "hf_openjev_decisions_total", outcome="unavailable") == 1
    assert _sample(samples, "hf_openjev_ready") == 0


def test_sigterm_marks_draining_at_once_and_the_request_in_flight_is_answered(tiny_model):
    """uvicorn's signal handler (build_server): draining starts with the signal, before uvicorn's own graceful
    wait; the request in flight is still answered, within the bounded drain."""
    import uvicorn

    gate, entered = threading.Event(), threading.Event()

    def gated(model, prepared, *, fast):
        entered.set()
        assert gate.wait(20)
        return score_prepared(model, prepared, fast=False)

    app = create_app(tiny_model, score_fn=gated, max_wait_ms=0, drain_timeout_s=10)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=10)
    server = build_server(config, on_exit=lambda: begin_drain(app))
    try:
        with serving(server) as (url, thread), ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(httpx.post, url + "/v1/systemone", json=REQUEST, timeout=60)
            assert entered.wait(20)
            assert not app.state.jev.draining
            server.handle_exit(signal.SIGTERM, None)  # what the signal does (signal handlers need the main thread)
            assert app.state.jev.draining and server.should_exit

            async def probe():
                async with _client(app) as c:
                    return await c.get("/health"), await c.post("/v1/systemone", json=REQUEST)

            health, late = _run(probe())
            assert health.status_code == 503 and health.json()["status"] == "draining"
            assert late.status_code == 503 and late.json()["error"] == "server is shutting down"
            gate.set()
            response = pending.result(timeout=30)
    finally:
        gate.set()
    assert not thread.is_alive()
    assert response.status_code == 200 and response.json()["answers"]["refund"]["type"] == "noul"


# ------------------------------------------------------------------------------------------------ access log

def _access_records(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]


def test_one_json_access_line_per_request_with_the_request_id(tiny_model, caplog):
    app = create_app(tiny_model)
    body = json.dumps(REQUEST).encode()

    async def main():
        async with _client(app) as c:
            given = await c.post("/v1/systemone", content=body,
                                 headers={"content-type": "application/json", "X-Request-Id": "req-7.a"})
            fresh = await c.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
            unsafe = await c.get("/v1/models", headers={"X-Request-Id": "bad id\twith tab"})
        return given, fresh, unsafe

    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        given, fresh, unsafe = _run(main())
    records = _access_records(caplog)
    assert len(records) == 3
    first, second, third = records
    assert set(first) == {"method", "path", "status", "duration_ms", "request_id", "client", "bytes_in", "bytes_out",
                          "questions", "candidates", "input_tokens", "batch", "queue_ms"}  # + the decision's shape
    assert first["request_id"] == "req-7.a" == given.headers["x-request-id"]
    assert (first["method"], first["path"], first["status"]) == ("POST", "/v1/systemone", 200)
    assert first["bytes_in"] == len(body) and first["bytes_out"] == len(given.content) > 0
    assert first["duration_ms"] > 0 and first["client"] == "127.0.0.1"
    # a fresh id, the same in the log, the response headers and the body
    assert second["request_id"] == fresh.headers["x-request-id"] == fresh.json()["metadata"]["request_id"]
    assert len(second["request_id"]) == 32
    assert third["request_id"] == unsafe.headers["x-request-id"] != "bad id\twith tab"
    assert third["status"] == 200 and third["path"] == "/v1/models"


# ------------------------------------------------------------------------------------------------ keys

def _assert_auth_error(response, message_part: str) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["www-authenticate"].startswith("Bearer")
    body = response.json()
    assert body["detail"]["error_type"] == "authentication_error"  # the shape jevcompat checks
    assert message_part in body["detail"]["message"] and body["error"] == body["detail"]["message"]
    assert response.headers["x-request-id"]


def test_keys_missing_or_wrong_get_401_health_stays_open_and_keys_are_never_logged(tiny_model, caplog):
    app = create_app(tiny_model, api_keys=KEYS)
    wrong = "not-a-key-4242424242"

    async def main():
        async with _client(app) as c:
            return {
                "missing": await c.post("/v1/systemone", json=REQUEST),
                "wrong": await c.post("/v1/systemone", json=REQUEST, headers={"Authorization": f"Bearer {wrong}"}),
                "basic": await c.get("/v1/models", headers={"Authorization": f"Basic {KEYS[0]}"}),
                "right": await c.post("/v1/systemone", json=REQUEST, headers={"Authorization": f"Bearer {KEYS[1]}"}),
                "lower": await c.get("/v1/models", headers={"Authorization": f"bearer {KEYS[2]}"}),
                "models": await c.get("/v1/models"),
                "unknown": await c.get("/nope"),
                "health": await c.get("/health"),
                "live": await c.get("/health/live"),
                "metrics": await c.get("/metrics"),
            }

    with caplog.at_level(logging.DEBUG):
        got = _run(main())
    _assert_auth_error(got["missing"], "missing API key")
    _assert_auth_error(got["wrong"], "invalid API key")
    _assert_auth_error(got["basic"], "missing API key")
    _assert_auth_error(got["models"], "missing API key")
    _assert_auth_error(got["unknown"], "missing API key")
    assert got["right"].status_code == 200 and got["lower"].status_code == 200
    assert got["health"].status_code == 503 and got["health"].json()["status"] == "starting"  # open: not 401
    assert got["live"].status_code == 200 and got["metrics"].status_code == 200  # /metrics open by default
    text = caplog.text + "".join(str(r.args) + str(r.__dict__) for r in caplog.records)
    assert caplog.records and all(key not in text for key in (*KEYS, wrong))
    assert [r["status"] for r in _access_records(caplog)][:2] == [401, 401]
    assert _sample(_metrics(got["metrics"].text), "hf_openjev_decisions_total", outcome="unauthorized") == 2


def test_metrics_auth_protects_metrics_and_needs_keys(tiny_model):
    app = create_app(tiny_model, api_keys=KEYS[:1], metrics_auth=True)

    async def main():
        async with _client(app) as c:
            return (await c.get("/metrics"),
                    await c.get("/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}),
                    await c.get("/health/live"))

    bare, keyed, live = _run(main())
    _assert_auth_error(bare, "missing API key")
    assert keyed.status_code == 200 and "hf_openjev_requests_total" in keyed.text
    assert live.status_code == 200
    with pytest.raises(UsageError, match="--metrics-auth needs API keys"):
        ServerOps(metrics_auth=True)


def test_every_key_is_compared_in_constant_time_without_early_exit(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def recording(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    checker = KeyChecker(KEYS)
    assert checker.matches(KEYS[0].encode()) and len(calls) == 3  # matched the first key, compared all three
    calls.clear()
    assert not checker.matches(b"short") and len(calls) == 3
    assert set(calls) == {(32, 32)}  # digests: the presented key's length does not reach the comparison
    assert checker.matches(KEYS[2].encode())
    assert checker.bearer_token(b"Bearer  abc ") == b"abc" and checker.bearer_token(b"Bearer ") is None
    assert checker.bearer_token(b"Token abc") is None and checker.bearer_token(None) is None


def test_read_api_keys_from_file_and_environment(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# production keys\n\n  key-one-aaaaaaaa  \nkey-two-bbbbbbbb\n# old: key-zero\nkey-one-aaaaaaaa\n")
    assert read_api_keys(keys, environ={}) == ("key-one-aaaaaaaa", "key-two-bbbbbbbb")
    assert read_api_keys(None, environ={}) == ()
    assert read_api_keys(None, environ={API_KEYS_ENV: " env-1 , env-2,, "}) == ("env-1", "env-2")
    assert read_api_keys(keys, environ={API_KEYS_ENV: "env-1"})[-1] == "env-1"
    with pytest.raises(UsageError, match="holds no key"):
        read_api_keys(None, environ={API_KEYS_ENV: " , "})
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing but a comment\n   \n")
    with pytest.raises(InputFileError, match="holds no key"):
        read_api_keys(empty, environ={})
    with pytest.raises(InputFileError, match="no such file"):
        read_api_keys(tmp_path / "absent", environ={})
    spaced = tmp_path / "spaced"
    spaced.write_text("good-key-cccccccc\nsecret with spaces\n")
    with pytest.raises(InputFileError, match="line 2") as info:
        read_api_keys(spaced, environ={})
    assert "secret" not in str(info.value)


def test_bad_key_file_is_a_one_line_error_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from hf_openjev.cli import main

    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    empty = tmp_path / "keys.txt"
    empty.write_text("# no keys yet\n")
    # the model directory does not exist: the key file is checked first
    assert main(["serve", "--model", str(tmp_path / "no-export"), "--api-key-file", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-openjev serve: error: --api-key-file") and "holds no key" in err[0]
    assert main(["serve", "--model", str(tmp_path / "no-export"), "--metrics-auth"]) == 2
    assert "--metrics-auth needs API keys" in capsys.readouterr().err


def test_outer_and_inner_middleware_count_a_request_once(tiny_model):
    ops = ServerOps()
    app = OpsMiddleware(create_app(tiny_model, ops=ops), ops)  # as serve wraps its loader

    async def main():
        async with _client(app) as c:
            await c.get("/v1/models")
            return await c.get("/metrics")

    samples = _metrics(_run(main()).text)
    assert _sample(samples, "hf_openjev_requests_total", route="/v1/models", status="200") == 1


def test_jevcompat_auth_checks_pass_against_a_live_server_with_a_key(tiny_model, caplog):
    """jevcompat's own auth case (missing key, wrong key: 401 with authentication_error) and its preflight with
    --key (the key read from Authorization: Bearer), on uvicorn; neither key reaches any log."""
    runner = pytest.importorskip("jevcompat.runner")
    import uvicorn

    config = uvicorn.Config(create_app(tiny_model, api_keys=KEYS[:1]), host="127.0.0.1", port=0, log_level="warning",
                            lifespan="on")
    with caplog.at_level(logging.DEBUG), serving(uvicorn.Server(config)) as (url, _):
        report = runner.run(url, key=KEYS[0], timeout=60, sdk=False, only={"auth"})
    assert report.aborted is None, report.aborted
    results = {r.id: r for r in report.results}
    for rid in ("auth.bearer", "auth.missing", "auth.invalid"):
        assert results[rid].status == "pass", (rid, results[rid].status, [f.message for f in results[rid].findings])
    text = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert KEYS[0] not in text and "jevcompat-wrong-key" not in text

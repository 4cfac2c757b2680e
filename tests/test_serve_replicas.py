"""One server over several devices (hf-openjev serve --devices): replicas behind the one batcher queue, with two
tiny CPU models standing in for two GPUs; the flag, its checks, loading and warming every replica."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from serve_cli_args import forbid_loading, serve_parser
from test_server import COMPANY_TOL, assert_same_answers, make_request

from hf_openjev.errors import UsageError
from hf_openjev.scoring import score_prepared
from hf_openjev.serve import cli as serve_cli
from hf_openjev.serve.app import create_app
from hf_openjev.serve.replicas import load_replicas, parse_devices, warm_up_replicas


@pytest.fixture(scope="module")
def replicas(tiny_checkpoint):
    return load_replicas(tiny_checkpoint.export, ["cpu", "cpu"], dtype=torch.float32)


def _post_all(app, requests):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/systemone", json=r) for r in requests))

    return asyncio.run(asyncio.wait_for(main(), 120))


def _slow(seconds: float, seen: list, broken=None):
    """score_prepared that takes a while (so both replicas get work) and records which replica scored."""
    lock = threading.Lock()

    def score(model, prepared, *, fast):
        with lock:
            seen.append(id(model))
        time.sleep(seconds)
        if model is broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return score_prepared(model, prepared, fast=False)

    return score


def test_two_replicas_share_the_traffic_and_answer_like_one_model(replicas, tiny_model):
    from hf_openjev.scoring import answer_requests

    seen = []
    app = create_app(replicas[0], replicas=replicas, max_wait_ms=0, max_batch_tokens=1, score_fn=_slow(0.05, seen))
    requests = [make_request(i) for i in range(12)]
    responses = _post_all(app, requests)
    assert [r.status_code for r in responses] == [200] * 12
    reference = answer_requests(tiny_model, requests, fast=False)
    for response, want in zip(responses, reference):
        assert_same_answers(response.json(), want, tol=COMPANY_TOL)
    assert {id(m) for m in replicas} == set(seen) and len(seen) == 12  # one request per group, both replicas
    stats = app.state.jev.batcher.stats()["replicas"]
    assert [s["requests"] > 0 for s in stats] == [True, True] and sum(s["requests"] for s in stats) == 12


def test_a_failing_replica_is_retried_elsewhere_retired_and_shown_in_health_and_metrics(replicas):
    seen = []
    app = create_app(replicas[0], replicas=replicas, max_wait_ms=0, max_batch_tokens=1,
                     score_fn=_slow(0.02, seen, broken=replicas[1]))
    responses = _post_all(app, [make_request(i) for i in range(16)])
    assert [r.status_code for r in responses] == [200] * 16  # each failed group answered by the healthy replica
    stats = app.state.jev.batcher.stats()["replicas"]
    assert stats[0]["failures"] == 0 and 1 <= stats[1]["failures"] <= 3 and stats[1]["requests"] == 0
    assert stats[1]["retired"] == (stats[1]["failures"] == 3)  # 3 failed groups in a row: it takes no more requests
    if not stats[1]["retired"]:  # it drew fewer than 3 groups: make it draw more
        _post_all(app, [make_request(i) for i in range(16)])
    assert all(r.status_code == 200 for r in _post_all(app, [make_request(i) for i in range(6)]))

    async def scrape():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.get("/health"), await c.get("/metrics")

    health, metrics = asyncio.run(scrape())
    batcher = health.json()["batcher"]
    assert batcher["replica_states"] == {"ok": 1, "degraded": 0, "retired": 1}
    assert [r["state"] for r in batcher["replicas"]] == ["ok", "retired"]
    assert 'hf_openjev_replicas{state="retired"} 1.0' in metrics.text
    assert 'hf_openjev_replicas{state="ok"} 1.0' in metrics.text


def test_a_hung_replicas_requests_are_answered_by_the_healthy_one_and_health_says_degraded(replicas):
    """Issue 36 item 9: with --request-timeout 2 (and the group deadline derived from it) a replica that never
    answers loses its group in time: every request gets its answer from the other one, /health and /metrics show it."""
    from hf_openjev.serve.limits import RequestLimits

    release, entered = threading.Event(), threading.Event()

    def score(model, prepared, *, fast):
        if model is replicas[1]:
            entered.set()
            release.wait(30)  # hangs (until the test ends)
        else:
            assert entered.wait(10)  # the hung replica has taken a group before the healthy one answers any
        return score_prepared(model, prepared, fast=False)

    app = create_app(replicas[0], replicas=replicas, max_wait_ms=0, max_batch_tokens=1, score_fn=score,
                     limits=RequestLimits(request_timeout_s=2.0))
    app.state.jev.ready = True  # as the lifespan does (httpx's ASGI transport runs none)
    try:
        responses = _post_all(app, [make_request(i) for i in range(4)])

        async def scrape():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
                return await c.get("/health"), await c.get("/metrics")

        health, metrics = asyncio.run(scrape())
    finally:
        release.set()
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert health.status_code == 200 and health.json()["status"] == "degraded" and health.json()["ready"]
    hung = health.json()["batcher"]["replicas"][1]
    assert hung["state"] == "retired" and hung["hung"] and hung["failures"] == 1
    assert health.json()["batcher"]["group_deadline_s"] == 0.5
    assert 'hf_openjev_replicas{state="retired"} 1.0' in metrics.text


def test_create_app_sets_every_replica_up_for_the_fast_path(tiny_checkpoint):
    from hf_openjev.fast_options import FastPathOptions
    from hf_openjev.patches import patch_record

    models = load_replicas(tiny_checkpoint.export, ["cpu", "cpu"], dtype=torch.float32)
    options = FastPathOptions(share_tails=True)
    app = create_app(models[0], replicas=models, fast=True, options=options)
    assert [patch_record(m).options for m in models] == [options, options]
    responses = _post_all(app, [make_request(i) for i in range(4)])
    assert all(r.status_code == 200 and r.json()["metadata"]["method"] == "fast" for r in responses)


def test_warm_up_runs_on_every_replica(tiny_checkpoint):
    from hf_openjev.patches import patch_record

    models = load_replicas(tiny_checkpoint.export, ["cpu", "cpu"], dtype=torch.float32)
    reports = warm_up_replicas(models, [(4, [3, 5]), (2, [6])])
    assert [r["requests"] for r in reports] == [2, 2]
    assert all(patch_record(m) is not None for m in models)


# ------------------------------------------------------------------------------------------------ the flag

def test_devices_flag_reaches_serve_and_excludes_device(monkeypatch, capsys):
    from hf_openjev.serve import startup

    seen = {}
    monkeypatch.setattr(startup, "serve", lambda model_dir, **kw: seen.update(kw) or 0)
    assert serve_cli.run(serve_parser().parse_args(["--model", "/x", "--devices", "cpu,cpu"])) == 0
    assert seen["devices"] == "cpu,cpu" and seen["device"] is None
    serve_cli.run(serve_parser().parse_args(["--model", "/x"]))
    assert seen["devices"] is None
    with pytest.raises(SystemExit) as info:
        serve_parser().parse_args(["--model", "/x", "--device", "cpu", "--devices", "cpu,cpu"])
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("cuda:0,cuda:1", "CUDA is not available on this machine"),
    ("cpu,,cpu", "comma-separated list"),
    ("", "comma-separated list"),
    ("cpu,tpu:0", "unknown device 'tpu:0'"),
])
def test_bad_devices_are_refused_before_loading(text, message, tiny_checkpoint, monkeypatch, capsys):
    if message.startswith("CUDA") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    forbid_loading(monkeypatch, "device check")
    args = serve_parser().parse_args(["--model", str(tiny_checkpoint.export), "--devices", text, "--port", "0"])
    assert serve_cli.run(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-openjev serve: error: ") and message in err and "\n" not in err


def test_parse_devices_rules(monkeypatch, tiny_checkpoint):
    assert parse_devices("cpu, cpu") == ["cpu", "cpu"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert parse_devices("cuda:0,cuda:3") == ["cuda:0", "cuda:3"]
    with pytest.raises(UsageError, match="lists cuda:0 twice"):
        parse_devices("cuda,cuda:0")
    with pytest.raises(UsageError, match="mixes cpu and cuda"):
        parse_devices("cuda:1,cpu")
    with pytest.raises(UsageError, match="this machine has 4 CUDA GPU"):
        parse_devices("cuda:0,cuda:4")
    from hf_openjev.serve import startup

    with pytest.raises(UsageError, match="--device or --devices, not both"):
        startup.serve(tiny_checkpoint.export, device="cpu", devices="cpu,cpu")


@pytest.mark.slow
def test_cli_serves_with_two_cpu_replicas(tiny_checkpoint, tmp_path):
    """``hf-openjev serve --devices cpu,cpu`` in a subprocess: both replicas load, concurrent requests are
    answered, /health shows the two replicas' counters."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hf_openjev.cli", "serve",
                                 "--model", str(tiny_checkpoint.export), "--port", str(port), "--devices", "cpu,cpu", "--dtype", "float32", "--reference",
                                 "--max-batch-tokens", "1", "--max-wait-ms", "0"],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server did not come up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        with ThreadPoolExecutor(max_workers=8) as pool:
            responses = list(pool.map(lambda i: httpx.post(url + "/v1/systemone", json=make_request(i), timeout=60),
                                      range(24)))
        health = httpx.get(url + "/health", timeout=5).json()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [r.status_code for r in responses] == [200] * 24
    replicas = health["batcher"]["replicas"]
    assert [r["name"] for r in replicas] == ["0:cpu", "1:cpu"] and sum(r["requests"] for r in replicas) == 24
    assert "Traceback" not in log_path.read_text()

"""The server's HTTP edge (issue 36): clients that never read their answer are disconnected (``--write-timeout``),
connections past ``--max-connections`` get a JSON 503, the fair queue's lanes follow the API key whatever the
header's spelling, each request is logged once, and what an idle kept-alive connection gets after SIGTERM. CPU, the
tiny model, loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
import time

import httpx
import pytest
from live_server import HTTP_STACKS, address, configured_server, listening_socket, raw_request, serving
from serve_cli_args import forbid_loading, serve_parser

from hf_openjev.scoring import score_prepared
from hf_openjev.serve import cli as serve_cli
from hf_openjev.serve.app import create_app
from hf_openjev.serve.middleware import ACCESS_LOGGER
from hf_openjev.serve.startup import _uvicorn_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NOUL = {"type": "noul", "instructions": "Does the customer want a refund?"}
REQUEST = {"state": "I was charged twice.", "questions": {"refund": NOUL}}
KEY = "key-alpha-0123456789"
SPELLINGS = (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"BeArEr {KEY}", f"bEARER {KEY}", f"Bearer  {KEY}",
             f"Bearer   {KEY}", f"bearer    {KEY}")





def _big_answer_request(answer_bytes: int) -> bytes:
    """A valid request whose answer is over ``answer_bytes`` long (one question, its id that long: echoed in the
    answer; one sequence to score)."""
    return json.dumps({"state": "s", "questions": {"q" * answer_bytes: NOUL}}).encode()


def _read_all(sock) -> int:
    """Bytes read until the server closes or resets the connection (each read bounded by the socket's timeout)."""
    got = 0
    with contextlib.suppress(ConnectionResetError):
        for _ in range(100_000):
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            got += len(chunk)
    return got


def _read_response(sock) -> tuple[bytes, bytes]:
    """One response on a kept-alive connection: ``(head, body)``, the body as long as its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                  if line.startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed within a body"
        body += chunk
    return head, body


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# ------------------------------------------------------------------------------ item 7: slow readers

@pytest.mark.parametrize("stack", HTTP_STACKS)
def test_slow_readers_are_closed_by_the_write_timeout_and_their_answers_dropped(tiny_model, stack):
    app = create_app(tiny_model, max_wait_ms=0)
    body = _big_answer_request(1_000_000)
    server = configured_server(app, write_timeout_s=0.5, **stack)
    with serving(server, sockets=[listening_socket(16384)]) as (url, _):
        readers = []
        for _ in range(4):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the server's sends block at once
            sock.settimeout(10)
            sock.connect(address(url))
            sock.sendall(raw_request(body))
            readers.append(sock)
        _wait_for(lambda: server.server_state.total_requests >= 4, 60, "the answers were never sent")
        _wait_for(lambda: not server.server_state.connections, 10, "the slow readers' connections stayed open")
        received = [_read_all(sock) for sock in readers]
        for sock in readers:
            sock.close()
        assert httpx.post(url + "/v1/systemone", json=REQUEST, timeout=30).status_code == 200
    assert all(got < 500_000 for got in received), received  # most of each answer was dropped, never sent


def test_a_reader_that_keeps_reading_gets_its_whole_answer_past_the_write_timeout(tiny_model):
    app = create_app(tiny_model, max_wait_ms=0)
    body = _big_answer_request(600_000)
    with serving(configured_server(app, write_timeout_s=2), sockets=[listening_socket(16384)]) as (url, _):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
            sock.settimeout(10)
            sock.connect(address(url))
            sock.sendall(raw_request(body, "Connection: close\r\n"))
            got = b""
            for _ in range(100_000):  # at most 32 KiB every 0.1 s: seconds for the answer, each pause far below 2 s
                chunk = sock.recv(32768)
                if not chunk:
                    break
                got += chunk
                time.sleep(0.1)
    head, _, answer = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and len(json.loads(answer)["answers"]["q" * 600_000]) > 0


# ------------------------------------------------------------------------------ item 7: connection cap

@pytest.mark.parametrize("stack", HTTP_STACKS)
def test_connections_past_max_connections_get_a_json_503_and_the_others_are_served(tiny_model, stack):
    app = create_app(tiny_model, max_wait_ms=0)
    body = json.dumps(REQUEST).encode()
    server = configured_server(app, max_connections=3, **stack)
    with serving(server) as (url, _):
        held = [socket.create_connection(address(url), timeout=30) for _ in range(3)]
        for sock in held:  # each answered and kept alive: three connections open
            sock.sendall(raw_request(body))
            assert _read_response(sock)[0].startswith(b"HTTP/1.1 200")
        with socket.create_connection(address(url), timeout=30) as extra:
            extra.sendall(raw_request(body))
            refused = b""
            for _ in range(100):
                chunk = extra.recv(65536)
                if not chunk:
                    break
                refused += chunk
        head, _, error = refused.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head.lower()
        assert b"retry-after: 1" in head.lower()
        error = json.loads(error)
        assert error["error"] == "server is busy" and "--max-connections" in error["detail"][0]["ctx"]["reason"]
        held[0].sendall(raw_request(body))  # the connections already open are still served
        assert _read_response(held[0])[0].startswith(b"HTTP/1.1 200")
        held.pop().close()
        _wait_for(lambda: len(server.server_state.connections) < 3, 10, "the closed connection was still counted")
        assert httpx.post(url + "/v1/systemone", json=REQUEST, timeout=30).status_code == 200  # room again
        for sock in held:
            sock.close()


# ------------------------------------------------------------------------------ item 8: lanes per key

class _Recorder:
    """A scorer that blocks until ``gate`` is set and records each group's requests (their first question's id)."""

    def __init__(self):
        self.gate, self.entered, self.groups = threading.Event(), threading.Event(), []

    def __call__(self, model, prepared, *, fast):
        self.groups.append([p.parsed.questions[0].id for p in prepared])
        self.entered.set()
        assert self.gate.wait(30), "test gate never opened"
        return score_prepared(model, prepared, fast=False)


@pytest.mark.parametrize("keys", [(KEY, "key-other-0123456789", "key-third-0123456789"), ()],
                         ids=["keys-configured", "no-keys"])
def test_eight_spellings_of_one_key_share_one_lane(tiny_model, keys):
    """Key A sends eight requests, one per spelling of its header, then key B sends one, while a third client's
    request is being scored; one request per group. Sharing one lane, A's requests let B's through second; as
    eight clients, B would wait behind all eight."""
    scorer = _Recorder()
    app = create_app(tiny_model, score_fn=scorer, max_wait_ms=0, max_batch_tokens=1, api_keys=keys)
    batcher = app.state.jev.batcher
    other, third = "key-other-0123456789", "key-third-0123456789"

    def request(name: str, authorization: str):  # ``name``: its question's id, what the scorer records
        return client.post("/v1/systemone", json={**REQUEST, "questions": {name: NOUL}},
                           headers={"Authorization": authorization})

    async def queued(count: int) -> None:
        for _ in range(2000):
            if batcher.waiting >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"only {batcher.waiting} requests queued, expected {count}")

    async def main():
        task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                         inbox.get, outbox.put))
        await inbox.put({"type": "lifespan.startup"})
        await outbox.get()
        first = asyncio.ensure_future(request("third client", f"Bearer {third}"))
        while not scorer.entered.is_set():
            await asyncio.sleep(0.01)
        spelt = [asyncio.ensure_future(request(f"A spelling {i}", s)) for i, s in enumerate(SPELLINGS)]
        await queued(8)
        small = asyncio.ensure_future(request("B", f"Bearer {other}"))
        await queued(9)
        scorer.gate.set()
        answers = await asyncio.gather(first, *spelt, small)
        await inbox.put({"type": "lifespan.shutdown"})
        await task
        return answers

    inbox, outbox = asyncio.Queue(), asyncio.Queue()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)
    answers = asyncio.run(asyncio.wait_for(main(), 120))
    assert [a.status_code for a in answers] == [200] * 10
    order = [states[0] for states in scorer.groups]
    # B's request right after A's first (which spelling is first depends on the tokenizing threads, not the lanes)
    assert order[0] == "third client" and order[1].startswith("A spelling") and order[2] == "B", order


# ------------------------------------------------------------------------------ item 16: one log line

def test_each_request_is_logged_once_with_its_shape_and_batch(tiny_model, caplog):
    app = create_app(tiny_model, max_wait_ms=0)
    bad = {"state": "x", "questions": {}}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            return [await c.post("/v1/systemone", json=REQUEST, headers={"X-Request-Id": "req-first-1"}),
                    await c.post("/v1/systemone", json=bad, headers={"X-Request-Id": "req-second-2"}),
                    await c.get("/v1/models", headers={"X-Request-Id": "req-third-3"})]

    with caplog.at_level(logging.DEBUG):
        responses = asyncio.run(asyncio.wait_for(main(), 60))
    assert [r.status_code for r in responses] == [200, 422, 200]
    server_side = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]  # not the client's
    for request_id in ("req-first-1", "req-second-2", "req-third-3"):
        lines = [r for r in server_side if request_id in r.getMessage()]
        assert [r.name for r in lines] == [ACCESS_LOGGER], [(r.name, r.getMessage()) for r in lines]
    records = {json.loads(r.getMessage())["request_id"]: json.loads(r.getMessage())
               for r in caplog.records if r.name == ACCESS_LOGGER}
    assert records["req-first-1"]["questions"] == 1 and records["req-first-1"]["candidates"] == 1
    assert records["req-first-1"]["input_tokens"] > 0 and records["req-first-1"]["batch"] == 1 and records["req-first-1"]["queue_ms"] >= 0
    assert records["req-second-2"]["status"] == 422 and "questions" in records["req-second-2"]["error"]


# ------------------------------------------------------------------------------ item 16: SIGTERM, idle keep-alive

@pytest.mark.parametrize("stack", HTTP_STACKS)
def test_after_sigterm_an_idle_kept_alive_connection_gets_the_503_then_the_server_stops(tiny_model, stack):
    """Nothing in flight: the drain ends at once, yet the server keeps listening while a kept-alive connection is
    open (up to uvicorn's keep-alive timeout), so the request sent on it 0.3 s later gets the JSON 503 and
    ``Connection: close``; then the server stops."""
    app = create_app(tiny_model, max_wait_ms=0)
    server = configured_server(app, **stack)
    body = json.dumps(REQUEST).encode()
    with serving(server) as (url, thread), socket.create_connection(address(url), timeout=10) as kept:
        kept.sendall(raw_request(body))
        assert _read_response(kept)[0].startswith(b"HTTP/1.1 200")  # now idle and kept alive
        server.handle_exit(signal.SIGTERM, None)
        time.sleep(0.3)
        kept.sendall(raw_request(body))
        head, answer = _read_response(kept)
        assert kept.recv(65536) == b""  # then closed
        thread.join(30)
        assert not thread.is_alive()
    assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head.lower()
    assert json.loads(answer)["error"] == "server is shutting down"
    assert server._captured_signals == []  # a clean drain: exit code 0


# ------------------------------------------------------------------------------ the options

async def _never_served(scope, receive, send):  # an app for a config that is only built
    raise AssertionError("not served")


def test_without_httptools_serve_runs_h11_with_the_same_head_cap(monkeypatch):
    """httptools and uvloop are dependencies, but where they are missing ``serve`` falls back to h11 and asyncio,
    the protocol's guards and the 16 KiB head cap kept (h11's own)."""
    import sys

    from uvicorn.protocols.http.h11_impl import H11Protocol

    from hf_openjev.serve.head_limit import MAX_HEAD_BYTES

    monkeypatch.setitem(sys.modules, "httptools", None)  # import httptools: ImportError
    monkeypatch.delitem(sys.modules, "uvicorn.protocols.http.httptools_impl", raising=False)
    config = _uvicorn_config(_never_served, host="127.0.0.1", port=0, log_level="warning", drain_timeout_s=1,
                             limit_concurrency=None, header_timeout_s=10)
    assert issubclass(config.http, H11Protocol) and config.h11_max_incomplete_event_size == MAX_HEAD_BYTES == 16384
    assert config.http.__name__ == "ConnectionLimitWriteDeadlineHeaderDeadlineH11Protocol"


def test_write_timeout_and_max_connections_reach_serve(monkeypatch):
    from hf_openjev.serve import startup

    seen = {}
    monkeypatch.setattr(startup, "serve", lambda model_dir, **kw: seen.update(kw) or 0)
    parser = serve_parser()
    assert serve_cli.run(parser.parse_args(["--model", "/x", "--write-timeout", "2.5", "--max-connections", "7"])) == 0
    assert (seen["write_timeout_s"], seen["max_connections"]) == (2.5, 7)
    assert serve_cli.run(parser.parse_args(["--model", "/x"])) == 0
    assert (seen["write_timeout_s"], seen["max_connections"]) == (30.0, 512)


@pytest.mark.parametrize("option, value", [("--write-timeout", "0"), ("--write-timeout", "nan"),
                                           ("--max-connections", "0"), ("--max-connections", "-3")])
def test_bad_edge_options_are_refused_before_binding_or_loading(monkeypatch, tmp_path, capsys, option, value):
    forbid_loading(monkeypatch, f"{option} check")
    monkeypatch.setattr("hf_openjev.serve.startup.check_port_free",
                        lambda *a: (_ for _ in ()).throw(AssertionError("port checked before the options")))
    args = serve_parser().parse_args(["--model", str(tmp_path / "no-export"), option, value])
    assert serve_cli.run(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-openjev serve: error: ") and option in err and "\n" not in err

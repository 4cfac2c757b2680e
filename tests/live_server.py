"""A uvicorn server running on a thread for tests that need real HTTP (port 0: the OS picks a free one; or a
listening socket the test made), built as ``serve`` builds it (:func:`configured_server`), a stand-in for its run that
starts and stops the app's lifespan without a socket, the two HTTP stacks the protocol-level tests run on
(:data:`HTTP_STACKS`), and raw-socket helpers (:func:`address`, :func:`raw_request`)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

# uvicorn's HTTP protocol and event loop, as ``_uvicorn_config(http=..., loop=...)`` takes them: what ``serve`` runs
# (httptools and uvloop, the package's dependencies) and the h11 path it falls back to where they are not installed.
HTTP_STACKS = [pytest.param({"http": "httptools", "loop": "uvloop"}, id="httptools"),
               pytest.param({"http": "h11", "loop": "asyncio"}, id="h11")]


def configured_server(app, **options):
    """A uvicorn server for ``app`` as ``serve`` configures it (header and write deadlines, connection cap, drain
    before uvicorn's shutdown); ``options`` are ``_uvicorn_config``'s (``drain_timeout_s`` and
    ``header_timeout_s`` default to 10 s)."""
    from hf_openjev.serve.lifecycle import begin_drain, build_server, finish_drain
    from hf_openjev.serve.startup import _uvicorn_config

    config = _uvicorn_config(app, host="127.0.0.1", port=0, log_level="warning",
                             drain_timeout_s=options.pop("drain_timeout_s", 10), limit_concurrency=None,
                             header_timeout_s=options.pop("header_timeout_s", 10), **options)
    return build_server(config, on_exit=lambda: begin_drain(app), drain=lambda: finish_drain(app))


def address(url: str) -> tuple[str, int]:
    """``(host, port)`` of a :func:`serving` URL."""
    host, port = url.rsplit("//", 1)[1].split(":")
    return host, int(port)


def raw_request(body: bytes, extra: str = "") -> bytes:
    """A POST /v1/systemone with ``body`` as raw bytes; ``extra`` header lines (each ending in CRLF) after the
    usual ones."""
    head = (f"POST /v1/systemone HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n")
    return head.encode() + body


@contextlib.contextmanager
def serving(server, sockets=None):
    """Run ``server`` (a ``uvicorn.Server``, or ``build_server``'s) on a daemon thread, on ``sockets`` when given
    (listening sockets made by the test), else on the port its config names; yield ``(url, thread)`` once it
    listens (30 s at most); on exit ask it to stop and join the thread (30 s at most)."""
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", thread
    finally:
        server.should_exit = True
        thread.join(30)


def listening_socket(send_buffer: int) -> socket.socket:
    """A loopback listening socket (port 0) for :func:`serving` whose connections keep at most about
    ``send_buffer`` bytes in the kernel (set, so never autotuned): an answer the client does not read stays in the
    server's own buffers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def run_lifespan_without_a_socket(server) -> None:
    """A stand-in for ``uvicorn.Server.run``: the app's lifespan starts (``serve`` loads and warms up the model on
    its loading thread), then stops once the model is ready or failed; no socket is opened."""
    import asyncio

    from hf_openjev.serve.lifecycle import _LifespanDriver

    async def start_and_stop():
        app = server.config.app  # the ops middleware around the loading app
        driver = _LifespanDriver(app)
        await driver.start()
        while app.app.stage not in ("ready", "failed"):
            await asyncio.sleep(0.01)
        await driver.stop()

    asyncio.run(start_and_stop())

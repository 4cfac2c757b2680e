"""A server on this machine's loopback for a recipe: a free port to start it on, and the wait until it is ready.

Standard library only for the recipes that start ``hf-openjev serve`` in a process of their own; those that serve an
app in process (:func:`serve_in_thread`) import uvicorn there.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until ``GET url/health`` answers 200; RuntimeError if ``proc`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the server was not healthy within {timeout:.0f} s")


def serve_in_thread(app, *, name: str, timeout: float = 120, **config):
    """uvicorn serving ``app`` on 127.0.0.1 in a daemon thread ``name`` (``config``: more of ``uvicorn.Config``'s
    arguments, e.g. ``http``, ``loop``), once it has started: (server, thread, port); RuntimeError naming ``name`` if
    it stops or ``timeout`` seconds pass first."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                           lifespan="on", **config))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{name}: the server did not start on 127.0.0.1:{port}")
        time.sleep(0.01)
    return server, thread, port

"""A deadline for a request's headers, on the connection itself: a half-open or trickling connection is closed.

uvicorn's ``timeout_keep_alive`` runs only between requests once a response has been sent, and stops as soon as
any byte arrives: a client that connects and sends nothing, or half a request line, holds the connection (and
its file descriptor) forever. The app never sees such a connection (it has no scope yet), so the guard lives in
uvicorn's HTTP protocol: :func:`with_header_timeout` subclasses it (h11 or httptools, as uvicorn would pick) so
that a connection waiting for a request's headers (just opened, or idle after a response) for longer than the
timeout is closed. Once the headers are in, the app's own deadlines take over (``--body-timeout``,
``--request-timeout``). An idle keep-alive connection is thus closed after the shorter of uvicorn's keep-alive
timeout and this one.
"""

from __future__ import annotations

import time

__all__ = ["DEFAULT_HEADER_TIMEOUT_S", "pick_http_protocol", "with_header_timeout"]

DEFAULT_HEADER_TIMEOUT_S = 10.0


def pick_http_protocol(name: str = "auto"):
    """uvicorn's HTTP protocol class named ``name`` (``"h11"``, ``"httptools"``); ``"auto"`` is uvicorn's own
    choice: httptools when installed, else h11."""
    if name not in ("auto", "h11", "httptools"):
        raise ValueError(f"an HTTP protocol is 'auto', 'h11' or 'httptools', got {name!r}")
    if name == "auto":
        try:
            import httptools  # noqa: F401
        except ImportError:
            name = "h11"
    if name == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


def with_header_timeout(base, seconds: float):
    """``base`` (a uvicorn HTTP protocol class) closing connections that wait longer than ``seconds`` for a
    request's headers; checked every ``seconds / 4`` (at most 1 s)."""
    period = min(1.0, seconds / 4)

    class HeaderDeadlineProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._jev_waiting_since = time.monotonic()
            self._jev_timer = self.loop.call_later(period, self._jev_check)

        def _jev_check(self) -> None:
            self._jev_timer = None
            if self.transport is None or self.transport.is_closing():
                return
            cycle = self.cycle
            now = time.monotonic()
            if cycle is not None and not cycle.response_complete:  # a request in progress: the app's deadlines
                self._jev_waiting_since = None
            elif self._jev_waiting_since is None:
                self._jev_waiting_since = now
            elif now - self._jev_waiting_since >= seconds:
                self.transport.close()
                return
            self._jev_timer = self.loop.call_later(period, self._jev_check)

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_jev_timer", None)
            if timer is not None:
                timer.cancel()
                self._jev_timer = None
            super().connection_lost(exc)

    HeaderDeadlineProtocol.__name__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadlineProtocol

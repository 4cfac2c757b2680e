"""A deadline for a response's bytes, on the connection itself: a client that stops reading is disconnected.

uvicorn hands a response's body to the connection's asyncio transport, which keeps whatever the socket does not
take at once in memory, for as long as the client does not read. A client that posts a valid request and never
reads a big answer thus holds that answer in the server's memory, and closing such a connection (uvicorn's
keep-alive timeout, :mod:`~hf_openjev.serve.header_timeout`, shutdown) only waits for the bytes to be sent: the
connection stays open. :func:`with_write_timeout` subclasses uvicorn's HTTP protocol (as the header timeout does)
so that a connection whose unsent bytes have not shrunk for ``seconds`` is reset: its bytes are dropped, the
server's and the kernel's (``SO_LINGER`` 0, so no orphaned socket keeps them), and the client sees a reset. A client that reads, however slowly, keeps its connection: the
deadline runs from the last time its unsent bytes shrank (as nginx's ``send_timeout``), not over the whole answer.
"""

from __future__ import annotations

import logging
import socket
import struct
import time

__all__ = ["DEFAULT_WRITE_TIMEOUT_S", "with_write_timeout"]

logger = logging.getLogger("hf_openjev.serve.server")

DEFAULT_WRITE_TIMEOUT_S = 30.0


def with_write_timeout(base, seconds: float):
    """``base`` (a uvicorn HTTP protocol class) aborting connections whose unsent bytes have not shrunk for
    ``seconds``; checked every ``seconds / 4`` (at most 1 s)."""
    period = min(1.0, seconds / 4)

    class WriteDeadlineProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._jev_unsent = 0
            self._jev_progress = time.monotonic()  # the last time the unsent bytes shrank (or were none)
            self._jev_write_timer = self.loop.call_later(period, self._jev_check_writes)

        def _jev_check_writes(self) -> None:
            self._jev_write_timer = None
            transport = self.transport
            unsent = transport.get_write_buffer_size()
            now = time.monotonic()
            if unsent == 0 or unsent < self._jev_unsent:
                self._jev_progress = now
            self._jev_unsent = unsent
            if unsent and now - self._jev_progress >= seconds:
                logger.info("%s did not read its answer for %g s (--write-timeout): %d unsent bytes dropped, "
                            "connection closed", _peer(self), seconds, unsent)
                _reset(transport)
                return
            if unsent or not transport.is_closing():
                self._jev_write_timer = self.loop.call_later(period, self._jev_check_writes)

        def connection_lost(self, exc) -> None:
            timer = getattr(self, "_jev_write_timer", None)
            if timer is not None:
                timer.cancel()
                self._jev_write_timer = None
            super().connection_lost(exc)

    WriteDeadlineProtocol.__name__ = f"WriteDeadline{base.__name__}"
    return WriteDeadlineProtocol


def _reset(transport) -> None:
    """Close at once with a reset (``SO_LINGER`` 0): the bytes the kernel still holds for the client are dropped
    too, instead of an orphaned socket trying to deliver them."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:  # already closed underneath: abort() is all there is to do
            pass
    transport.abort()


def _peer(protocol) -> str:
    client = getattr(protocol, "client", None)
    return f"client {client[0]}:{client[1]}" if client else "a client"

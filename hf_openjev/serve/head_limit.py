"""A request head's rules on httptools, as h11 keeps them: a cap on its size, and the Host header of HTTP/1.1.

A head (request line and headers) longer than the cap gets a 400 and its connection is closed; so does an HTTP/1.1
request without a Host header (RFC 9112 section 3.2: a server MUST answer it with 400), which httptools passes on.

h11 keeps at most ``max_incomplete_event_size`` bytes of a head it has not finished parsing (16 KiB, its
default) and refuses the request past it. httptools keeps no such cap: its parser gathers a header's name and value
(and uvicorn the URL) for as long as they come, so one connection sending an endless header line held all of it in
the server's memory until the header timeout (:mod:`~hf_openjev.serve.header_timeout`) closed it (about 95 MiB
in 10 s on loopback in one test; a fast client sends much more). :func:`with_head_limit` subclasses uvicorn's
httptools protocol (as the header timeout does) so that the bytes received while a request's head is incomplete
are counted, and past :data:`MAX_HEAD_BYTES` the request gets uvicorn's own plain 400 and the connection is
closed, as h11 does (``serve`` passes the same cap to h11 as uvicorn's ``h11_max_incomplete_event_size``).

Counted: every chunk read that ends with a head still incomplete. A chunk in which a new request began counts
nothing (its bytes may be earlier requests'), so the cap is exact up to one read (256 KiB at most): what the
server holds of one head stays under :data:`MAX_HEAD_BYTES` plus one read.
"""

from __future__ import annotations

__all__ = ["MAX_HEAD_BYTES", "MISSING_HOST", "with_head_limit"]

MAX_HEAD_BYTES = 16 * 1024  # h11's own default (h11.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)
HEAD_TOO_LARGE = "Request line and headers too large."
MISSING_HOST = "Missing mandatory Host: header"  # h11's words for the same refusal


class _HeadRefused(Exception):
    """Raised in a parser callback to stop parsing: httptools turns it into the parse error uvicorn answers."""


def with_head_limit(base, limit: int = MAX_HEAD_BYTES):
    """``base`` (a uvicorn HTTP protocol class) refusing with a 400 the requests whose head passes ``limit`` bytes
    and the HTTP/1.1 requests without a Host header; h11's protocol is returned as it is (h11 caps the head itself,
    ``h11_max_incomplete_event_size``, and refuses a missing Host)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: base is h11's
        return base
    if not issubclass(base, HttpToolsProtocol):
        return base

    class HeadLimitProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._jev_in_head = True  # the next bytes are a request's head
            self._jev_head_bytes = 0
            self._jev_began = False  # a request began in the chunk being parsed
            self._jev_refusal: str | None = None  # why the head was refused, for uvicorn's 400

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._jev_in_head, self._jev_began = True, True

        def on_headers_complete(self) -> None:
            self._jev_in_head = False
            if self.parser.get_http_version() == "1.1" and not any(name == b"host" for name, _ in self.headers):
                self._jev_refusal = MISSING_HOST
                raise _HeadRefused(MISSING_HOST)  # uvicorn answers the parse error: send_400_response below
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            super().send_400_response(self._jev_refusal or msg)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._jev_in_head, self._jev_began = True, True

        def data_received(self, data: bytes) -> None:
            self._jev_began = False
            super().data_received(data)
            if not self._jev_in_head or self._jev_began:
                self._jev_head_bytes = 0
                return
            self._jev_head_bytes += len(data)
            if self._jev_head_bytes > limit and not self.transport.is_closing():
                self.logger.warning("%s (over %d bytes)", HEAD_TOO_LARGE, limit)
                self.send_400_response(HEAD_TOO_LARGE)

    HeadLimitProtocol.__name__ = f"HeadLimit{base.__name__}"
    return HeadLimitProtocol

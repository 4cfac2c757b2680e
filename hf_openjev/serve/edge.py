"""The server's HTTP edge: the words of its answers and how a request's body is read.

What every layer of the server shares about HTTP, written once: the error response (:class:`HTTPError`,
:func:`error_body`: docs/contract.md §7), the request-id rule (:func:`sane_request_id`: the client's
``X-Request-Id`` when it is sane, else a fresh one; :mod:`~hf_openjev.serve.middleware` applies it to every request,
the routes of :mod:`~hf_openjev.serve.app` read it back), the bounded drain of a refused body
(:func:`drain_body`: read and dropped so that the client gets to read the refusal), and steps 1 and 2 of a decision
request (:mod:`hf_openjev.serve.app`): ``Content-Type`` (415), the body read within ``--body-timeout`` (408) under
``--max-body-bytes`` (413) and its ``Content-Encoding`` undone under the same cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
import zlib
from collections.abc import AsyncIterator

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .bounded import DeadlinePassed, run_bounded
from .limits import DEFAULT_MAX_BODY_BYTES, RequestLimits
from .strict_json import MSG_INVALID_JSON, dumps

__all__ = ["MAX_BODY_BYTES", "HTTPError", "drain_body", "error_body", "read_body_in_time", "sane_request_id"]

MAX_BODY_BYTES = DEFAULT_MAX_BODY_BYTES  # the default of --max-body-bytes
DISCARD_LIMIT_BYTES = 64 * 1024 * 1024  # a refused body is read and dropped up to this, so the client sees the answer
DISCARD_SECONDS = 5.0  # ... and for at most this long
MSG_CONTENT_TYPE = "Content-Type must be application/json"
MSG_TOO_LARGE = "request body size is outside server limits"
MSG_BUSY = "server is busy"
MSG_SHUTTING_DOWN = "server is shutting down"
MSG_INFERENCE = "model inference failed"
MSG_INTERNAL = "internal server error"
MSG_DEADLINE = "request deadline exceeded"
MSG_BODY_TIMEOUT = "request body read timed out"
REQUEST_ID_HEADER = "X-Request-Id"
TYPESAFE_REQUEST_ID_HEADER = "x-typesafe-request-id"
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def sane_request_id(given: str | bytes | None) -> str:
    """The request id to use: ``given`` (an ``X-Request-Id`` value, text or raw header bytes) when it is 1 to 128
    of ``A-Z a-z 0-9 . _ : -``, else a fresh one (32 hex digits)."""
    if isinstance(given, bytes):
        try:
            given = given.decode("ascii")
        except UnicodeDecodeError:
            given = None
    if given and _REQUEST_ID_RE.fullmatch(given):
        return given
    return uuid.uuid4().hex


async def drain_body(chunks: AsyncIterator[bytes], *, seen: int, limit_bytes: int, seconds: float) -> None:
    """Read and drop ``chunks`` (what the client still sends of a refused body) until it ends, ``seen`` plus what
    was read passes ``limit_bytes``, or ``seconds`` pass; a client that left or a stream already consumed ends it
    too. So the client gets to read the refusal; past either bound, the answer is sent anyway."""
    async def drain() -> None:
        total = seen
        async for chunk in chunks:
            total += len(chunk)
            if total > limit_bytes:
                return

    with contextlib.suppress(ClientDisconnect, OSError, RuntimeError, asyncio.TimeoutError):
        await asyncio.wait_for(drain(), timeout=seconds)


class HTTPError(Exception):
    """An error response: status, message, a machine-readable type and the location of the problem."""

    def __init__(self, status: int, message: str, *, type: str, loc: list | None = None,
                 headers: dict | None = None, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.loc = loc if loc is not None else ["body"]
        self.headers = headers or {}
        self.reason = reason


def error_body(message: str, *, type: str, loc: list, reason: str | None = None) -> dict:
    """``{"error": msg, "detail": [{"msg": msg, "type": ..., "loc": [...]}]}`` (docs/contract.md §7).

    ``reason`` (a :class:`RequestError`'s ``detail``: the question and field at fault, or the served model names)
    goes into the entry's ``ctx`` as FastAPI does for context, ``{"ctx": {"reason": ...}}``: the contract's
    ``msg``/``error`` stay exactly as worded.
    """
    entry = {"msg": message, "type": type, "loc": list(loc)}
    if reason:
        entry["ctx"] = {"reason": reason}
    return {"error": message, "detail": [entry]}


def json_response(payload, status: int = 200, headers: dict | None = None) -> Response:
    body = payload if isinstance(payload, bytes) else dumps(payload)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def request_id_of(request: Request) -> str:
    """The request's id (:func:`sane_request_id` of its ``X-Request-Id``)."""
    return sane_request_id(request.headers.get(REQUEST_ID_HEADER))


def id_headers(request_id: str) -> dict:
    return {REQUEST_ID_HEADER: request_id, TYPESAFE_REQUEST_ID_HEADER: request_id}


def is_json_media_type(value: str | None) -> bool:
    return value is not None and value.split(";", 1)[0].strip().lower() == "application/json"


def _zstd_decompressor():
    try:
        from compression import zstd  # Python 3.14+
    except ImportError:
        try:
            from backports import zstd  # the typesafe-sdk[zstd] extra
        except ImportError:
            return None
    return zstd.ZstdDecompressor


def too_large(limit: int, size: str) -> HTTPError:
    """413 with the contract's message; the limit and the body's size in ``detail[0].ctx.reason``."""
    return HTTPError(413, MSG_TOO_LARGE, type="request_too_large",
                     reason=f"this server accepts bodies of at most {limit} bytes (--max-body-bytes); {size}")


def decode_content(body: bytes, encoding_header: str | None, limit: int = MAX_BODY_BYTES) -> bytes:
    """Undo ``Content-Encoding`` (gzip, deflate, zstd when available) without ever holding more than ``limit``
    bytes."""
    codings = [c.strip().lower() for c in (encoding_header or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        if coding in ("gzip", "x-gzip", "deflate"):
            wbits = 31 if coding != "deflate" else 15
            try:
                decoder = zlib.decompressobj(wbits)
                out = decoder.decompress(body, limit + 1)
                if len(out) > limit:
                    raise too_large(limit, "decoded, this one is larger")
                if not decoder.eof:
                    raise zlib.error("truncated stream")
            except zlib.error as exc:
                raise HTTPError(422, f"{MSG_INVALID_JSON}: the body is not valid {coding} data ({exc})",
                                type="json_invalid") from None
            body = out
        elif coding == "zstd":
            factory = _zstd_decompressor()
            if factory is None:
                raise HTTPError(415, "Content-Encoding zstd is not supported by this server "
                                     "(install backports.zstd on Python < 3.14)",
                                type="unsupported_media_type", loc=["header", "content-encoding"])
            try:
                decoder = factory()
                out = decoder.decompress(body, max_length=limit + 1)
                if len(out) > limit:
                    raise too_large(limit, "decoded, this one is larger")
                if not decoder.eof:
                    raise ValueError("truncated stream")
            except HTTPError:
                raise
            except Exception as exc:  # noqa: BLE001 - ZstdError or ValueError
                raise HTTPError(422, f"{MSG_INVALID_JSON}: the body is not valid zstd data ({exc})",
                                type="json_invalid") from None
            body = out
        else:
            raise HTTPError(415, f"Content-Encoding {coding!r} is not supported", type="unsupported_media_type",
                            loc=["header", "content-encoding"])
    return body


async def discard_body(request: Request, already: int = 0) -> None:
    """Read and drop the rest of a refused body (:func:`drain_body`, bounded by :data:`DISCARD_LIMIT_BYTES` and
    :data:`DISCARD_SECONDS`), so that the client gets to read the error. A client waiting for ``100 Continue`` has
    sent nothing yet, and a declared length past the byte bound will not be read: both get the error at once."""
    if request.headers.get("expect", "").lower() == "100-continue":
        return
    with contextlib.suppress(ValueError, TypeError):
        if int(request.headers.get("content-length")) > DISCARD_LIMIT_BYTES:
            return
    await drain_body(request.stream(), seen=already, limit_bytes=DISCARD_LIMIT_BYTES, seconds=DISCARD_SECONDS)


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The raw body, refused (413, the rest drained) once it declares or reaches more than ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            too_big = False
        if too_big:
            await discard_body(request)
            raise too_large(limit, f"this one declares {declared}")
    chunks = bytearray()
    async for chunk in request.stream():
        chunks += chunk
        if len(chunks) > limit:
            seen = len(chunks)
            del chunks
            await discard_body(request, seen)
            raise too_large(limit, "this one is larger")
    return bytes(chunks)


async def read_json_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body of a decision request: ``Content-Type`` checked (415), read under the ``limit`` (413) and its
    ``Content-Encoding`` undone (steps 1 and 2 of the module docstring)."""
    if not is_json_media_type(request.headers.get("content-type")):
        await discard_body(request)
        raise HTTPError(415, MSG_CONTENT_TYPE, type="unsupported_media_type", loc=["header", "content-type"])
    return decode_content(await read_body(request, limit), request.headers.get("content-encoding"), limit)


async def read_body_in_time(request: Request, limits: RequestLimits, expired: asyncio.Future) -> bytes:
    """:func:`read_json_body` within ``--body-timeout`` (408, the connection closed) and until ``expired`` (the
    drain time runs out: :class:`~hf_openjev.serve.bounded.DrainExpired`)."""
    deadline = None if limits.body_timeout_s is None else time.monotonic() + limits.body_timeout_s
    try:
        return await run_bounded(read_json_body(request, limits.max_body_bytes), deadline=deadline, expired=expired)
    except DeadlinePassed:
        raise HTTPError(408, MSG_BODY_TIMEOUT, type="timeout", loc=["body"], headers={"Connection": "close"},
                        reason=f"the body did not arrive within {limits.body_timeout_s:g} s (--body-timeout)") from None


async def answer_http_exception(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (404, 405, ...) in the contract's error shape, with the request's id."""
    message = exc.detail if isinstance(exc.detail, str) else str(exc.status_code)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    headers = {**id_headers(request_id_of(request)), **(exc.headers or {})}
    return json_response(error_body(message, type=kind, loc=["path"]), exc.status_code, headers)


async def answer_internal_error(request: Request, exc: Exception) -> Response:
    """An exception that escaped a route: 500 ``internal server error``, nothing more said."""
    return json_response(error_body(MSG_INTERNAL, type="internal_error", loc=[]), 500)



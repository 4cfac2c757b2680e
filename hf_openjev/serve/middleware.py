"""What an operator needs from the server, as one ASGI middleware: API keys, Prometheus metrics, request ids and
structured access logs.

:class:`ServerOps` holds one app's configuration and its own :class:`prometheus_client.CollectorRegistry` (never
the global one, so two apps in one process keep separate counts). :class:`OpsMiddleware`, around the app, for each
HTTP request:

1. makes sure it has a request id: the client's ``X-Request-Id`` when it is sane, else a fresh one
   (:func:`~hf_openjev.serve.edge.sane_request_id`, the server's one rule) written into the request's headers, so
   that the route handlers, the response and the access log share it;
2. refuses a request carrying both ``Content-Length`` and ``Transfer-Encoding`` (400, the connection closed:
   proxies and servers may disagree on where it ends), and answers a request on a connection past
   ``--max-connections`` with a JSON 503 ``server is busy`` (:mod:`~hf_openjev.serve.connection_limit`);
3. answers ``GET /health/live`` (200 while the process serves) and ``GET /metrics`` (Prometheus text format) itself;
4. with keys configured, refuses every route but ``/health`` and ``/health/live`` (and ``/metrics`` unless
   ``metrics_auth``) without ``Authorization: Bearer <key>``: 401 ``{"error": msg, "detail": {"error_type":
   "authentication_error", "message": msg}}`` (the shape jevcompat checks), with ``WWW-Authenticate: Bearer``;
   an accepted key's id (its position among the keys) goes into the scope (:data:`KEY_ID`): the request's lane in
   the fair queue, however the header spells ``Bearer`` and its spaces;
5. counts the request (``hf_openjev_requests_total{route,status}``, ``hf_openjev_request_seconds{route}``,
   ``hf_openjev_decisions_total{outcome}`` for the decision routes; a client gone before its answer as status
   499, outcome ``abandoned``) and writes one JSON line on the logger
   ``hf_openjev.serve.access``: method, path (no query string), status, duration_ms, request_id, client, bytes_in,
   bytes_out, then what the app adds (a decision's questions, candidates, input_tokens, batch and queue_ms; an
   error's words): the request's only log line. Headers are never logged, so neither is a key.

The middleware may wrap an app that is itself wrapped by it (``serve`` wraps its loader and ``create_app`` the app
it builds, with the same :class:`ServerOps`): the inner one lets a request it has already seen pass.
"""

from __future__ import annotations

import json
import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..errors import UsageError
from .connection_limit import OVER_CONNECTION_LIMIT
from .edge import MSG_BUSY, drain_body, error_body, sane_request_id
from .keys import KeyChecker

__all__ = ["ABANDONED", "ACCESS_DETAIL", "ACCESS_LOGGER", "KEY_ID", "OpsMiddleware", "ServerOps",
           "configure_access_log"]

ACCESS_LOGGER = "hf_openjev.serve.access"
access_logger = logging.getLogger(ACCESS_LOGGER)

DECISION_PATHS = ("/v1/systemone", "/v1/inference")
OPEN_PATHS = ("/health", "/health/live")  # never behind a key: a load balancer's health check has none
METRICS_PATH = "/metrics"
ROUTES = (*DECISION_PATHS, "/v1/models", *OPEN_PATHS, METRICS_PATH)  # other paths are counted as route="other"
MSG_KEY_MISSING = "missing API key: send Authorization: Bearer <key>"
MSG_KEY_INVALID = "invalid API key"
_SEEN = "hf_openjev.middleware"  # scope key: this request already went through an OpsMiddleware
ABANDONED = "hf_openjev.abandoned"  # scope key: the client left and the app answers nothing (counted as 499)
KEY_ID = "hf_openjev.key_id"  # scope key: which configured key authenticated the request (its position)
ACCESS_DETAIL = "hf_openjev.access_detail"  # scope key: a dict the app adds to the request's access line
MSG_AMBIGUOUS_LENGTH = "request has both Content-Length and Transfer-Encoding"
_DISCARD_BYTES = 1024 * 1024  # a refused body is read and dropped up to this, so the client reads the 401
_DISCARD_SECONDS = 2.0
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = tuple(2 ** k for k in range(6, 18))  # 64 .. 131072


def _decision_outcome(status: int) -> str:
    if status == 200:
        return "ok"
    if status in (401, 403):
        return "unauthorized"
    if status == 499:
        return "abandoned"  # the client left before its answer: not its error, nor the server's
    if status == 503:
        return "unavailable"  # busy (queue full), starting or shutting down
    if status >= 500:
        return "failed"
    return "rejected"  # invalid input: 413, 415, 422, ...


def _device_name(model) -> str:
    return str(getattr(model, "device", "unknown"))


class ServerOps:
    """One app's keys, metrics registry and instruments. ``metrics_auth``: ``/metrics`` needs a key too."""

    def __init__(self, *, api_keys=(), metrics_auth: bool = False):
        if metrics_auth and not api_keys:
            raise UsageError("--metrics-auth needs API keys (--api-key-file or $HF_OPENJEV_API_KEYS)")
        self.keys = KeyChecker(api_keys)
        self.metrics_auth = bool(metrics_auth)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hf_openjev_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.request_seconds = Histogram("hf_openjev_request_seconds", "HTTP request duration (seconds)", ["route"],
                                         buckets=_SECONDS_BUCKETS, registry=r)
        self.decisions = Counter("hf_openjev_decisions", "decision requests by outcome (ok, rejected, unauthorized, "
                                 "unavailable, failed)", ["outcome"], registry=r)
        self.queue_depth = Gauge("hf_openjev_queue_depth", "requests admitted and waiting for the model", registry=r)
        self.in_flight = Gauge("hf_openjev_requests_in_flight", "decision requests the server holds now", registry=r)
        self.ready = Gauge("hf_openjev_ready", "1 when GET /health answers 200", registry=r)
        self.batch_requests = Histogram("hf_openjev_batch_requests", "requests per shared forward",
                                        buckets=_BATCH_BUCKETS, registry=r)
        self.batch_tokens = Histogram("hf_openjev_batch_tokens", "unpadded input tokens per shared forward",
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self.replicas = Gauge("hf_openjev_replicas", "model replicas by health state (ok, degraded: a recent failed "
                              "group, retired: takes no more groups)", ["state"], registry=r)
        self.device_busy = Counter("hf_openjev_device_busy_seconds", "seconds each device spent scoring",
                                   ["device"], registry=r)
        self._request_children: dict[tuple[str, int], tuple] = {}  # (route, status) -> its counters, looked up once

    # -- hooks for create_app ------------------------------------------------------------------------------
    def watch_server(self, state) -> None:
        """Read the gauges from a server state at scrape time: the batcher's queue, the requests held, readiness."""
        batcher = state.batcher
        self.queue_depth.set_function(lambda: getattr(batcher, "waiting", 0))
        self.in_flight.set_function(lambda: state.active)
        self.ready.set_function(lambda: float(bool(getattr(state, "ready", False)) and not state.draining))
        for name in ("ok", "degraded", "retired"):
            self.replicas.labels(state=name).set_function(
                lambda name=name: batcher.replica_states()[name] if hasattr(batcher, "replica_states") else 0)

    def time_scoring(self, score_fn):
        """``score_fn`` (the batcher's, one call per shared forward) that also records the batch's size and tokens
        and the seconds its device was busy (the device of the model it is called with)."""
        def timed(model, prepared, *args, **kwargs):
            started = time.perf_counter()
            try:
                return score_fn(model, prepared, *args, **kwargs)
            finally:
                self.device_busy.labels(device=_device_name(model)).inc(time.perf_counter() - started)
                self.batch_requests.observe(len(prepared))
                self.batch_tokens.observe(sum(int(getattr(p, "input_tokens", 0)) for p in prepared))

        return timed

    # -- per request ---------------------------------------------------------------------------------------
    def record_request(self, path: str, status: int, seconds: float) -> None:
        route = path if path in ROUTES else "other"
        children = self._request_children.get((route, status))
        if children is None:  # a few routes times the statuses the server answers: a small, bounded table
            children = self._request_children[(route, status)] = (
                self.requests.labels(route=route, status=str(status)), self.request_seconds.labels(route=route),
                self.decisions.labels(outcome=_decision_outcome(status)) if route in DECISION_PATHS else None)
        requests, request_seconds, decisions = children
        requests.inc()
        request_seconds.observe(seconds)
        if decisions is not None:
            decisions.inc()

    def render_metrics(self) -> bytes:
        return generate_latest(self.registry)


def configure_access_log() -> None:
    """Access lines as bare JSON on stderr (no time/level prefix), for a log shipper; ``serve`` calls it."""
    if access_logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    access_logger.addHandler(handler)
    access_logger.propagate = False


class _Exchange:
    """One request's receive/send, counting bytes and remembering the status."""

    def __init__(self, receive, send, request_id: str):
        self._receive, self._send, self.request_id = receive, send, request_id
        self.status = 500  # until a response starts: an exception escaped
        self.started = False
        self.bytes_in = 0
        self.bytes_out = 0

    async def receive(self):
        message = await self._receive()
        if message.get("type") == "http.request":
            self.bytes_in += len(message.get("body", b""))
        return message

    async def send(self, message):
        if message["type"] == "http.response.start":
            self.status, self.started = int(message["status"]), True
        elif message["type"] == "http.response.body":
            self.bytes_out += len(message.get("body", b""))
        await self._send(message)

    async def respond(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        raw = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
               (b"x-request-id", self.request_id.encode()), (b"x-typesafe-request-id", self.request_id.encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await self.send({"type": "http.response.start", "status": status, "headers": raw})
        await self.send({"type": "http.response.body", "body": body})

    async def discard_body(self) -> None:
        """Read and drop what the client still sends (:func:`~hf_openjev.serve.edge.drain_body`, bounded by
        :data:`_DISCARD_BYTES` and :data:`_DISCARD_SECONDS`), so that it gets to read a refusal."""
        await drain_body(self._body_chunks(), seen=self.bytes_in, limit_bytes=_DISCARD_BYTES,
                         seconds=_DISCARD_SECONDS)

    async def _body_chunks(self):
        """The chunks of the body still to come, until its last one (or a disconnect)."""
        while True:
            message = await self.receive()
            if message.get("type") != "http.request":
                return
            yield message.get("body", b"")
            if not message.get("more_body", False):
                return


def _with_request_id(scope) -> tuple[dict, str]:
    """The scope with a sane ``X-Request-Id`` header (the client's, else a fresh one) and that id."""
    headers = list(scope.get("headers") or [])
    given = next((v for k, v in headers if k.lower() == b"x-request-id"), None)
    request_id = sane_request_id(given)
    if given is not None and given == request_id.encode("ascii"):
        return {**scope, _SEEN: True}, request_id
    headers = [(k, v) for k, v in headers if k.lower() != b"x-request-id"] + [(b"x-request-id", request_id.encode())]
    return {**scope, "headers": headers, _SEEN: True}, request_id


def _header(scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers") or [] if k.lower() == name), None)


class OpsMiddleware:
    """Pure ASGI middleware: request ids, keys, ``/metrics``, ``/health/live``, metrics and access logs."""

    def __init__(self, app, ops: ServerOps):
        self.app = app
        self.ops = ops

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get(_SEEN):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        scope, request_id = _with_request_id(scope)
        exchange = _Exchange(receive, send, request_id)
        try:
            await self._dispatch(scope, exchange)
        finally:
            if scope.get(ABANDONED) and not exchange.started:
                exchange.status = 499
            seconds = time.perf_counter() - started
            self.ops.record_request(scope["path"], exchange.status, seconds)
            self._log(scope, exchange, seconds)

    async def _dispatch(self, scope, exchange: _Exchange) -> None:
        path, method = scope["path"], scope["method"]
        if _header(scope, b"content-length") is not None and _header(scope, b"transfer-encoding") is not None:
            body = json.dumps(error_body(MSG_AMBIGUOUS_LENGTH, type="bad_request", loc=["header", "transfer-encoding"],
                                         reason="send one of them (RFC 9112 §6.1: a request smuggling vector)"))
            await exchange.respond(400, body.encode(), "application/json", {"Connection": "close"})
            return
        if scope.get(OVER_CONNECTION_LIMIT) is not None:
            await self._refuse_over_limit(scope[OVER_CONNECTION_LIMIT], exchange)
            return
        if path == "/health/live" and method in ("GET", "HEAD"):
            await exchange.respond(200, b'{"status": "alive"}', "application/json")
            return
        needs_key = self.ops.keys.enabled and path not in OPEN_PATHS
        if path == METRICS_PATH and method in ("GET", "HEAD"):
            needs_key = needs_key and self.ops.metrics_auth
        if needs_key and not await self._authorized(scope, exchange):
            return
        if path == METRICS_PATH and method in ("GET", "HEAD"):
            await exchange.respond(200, self.ops.render_metrics(), CONTENT_TYPE_LATEST)
            return
        await self.app(scope, exchange.receive, exchange.send)

    async def _authorized(self, scope, exchange: _Exchange) -> bool:
        """Whether the request carries a configured key; if not, the 401 is sent."""
        token = self.ops.keys.bearer_token(_header(scope, b"authorization"))
        key_id = self.ops.keys.identify(token) if token is not None else None
        if key_id is not None:
            scope[KEY_ID] = key_id  # the fair queue's lane, whatever the header's spelling
            return True
        message = MSG_KEY_MISSING if token is None else MSG_KEY_INVALID
        challenge = "Bearer" if token is None else 'Bearer error="invalid_token"'
        body = json.dumps({"error": message, "detail": {"error_type": "authentication_error", "message": message}})
        await exchange.discard_body()
        await exchange.respond(401, body.encode(), "application/json", {"WWW-Authenticate": challenge})
        return False

    @staticmethod
    async def _refuse_over_limit(limit: int, exchange: _Exchange) -> None:
        """503 ``server is busy`` to a request on a connection past ``--max-connections``; then uvicorn closes it."""
        reason = f"this server keeps at most {limit} connections open (--max-connections); retry later"
        body = json.dumps(error_body(MSG_BUSY, type="server_busy", loc=[], reason=reason))
        await exchange.discard_body()
        await exchange.respond(503, body.encode(), "application/json", {"Retry-After": "1", "Connection": "close"})

    @staticmethod
    def _log(scope, exchange: _Exchange, seconds: float) -> None:
        """The request's one log line: at WARNING for a decision's 5xx, else INFO (a load balancer's ``/health``
        polls during loading stay quiet); what the app added (:data:`ACCESS_DETAIL`: the request's shape, its batch,
        its error) after the common fields."""
        level = logging.WARNING if exchange.status >= 500 and scope.get("path") in DECISION_PATHS else logging.INFO
        if not access_logger.isEnabledFor(level):
            return
        client = scope.get("client")
        record = {"method": scope.get("method"), "path": scope.get("path"), "status": exchange.status,
                  "duration_ms": round(seconds * 1000.0, 2), "request_id": exchange.request_id,
                  "client": client[0] if client else None, "bytes_in": exchange.bytes_in,
                  "bytes_out": exchange.bytes_out, **scope.get(ACCESS_DETAIL, {})}
        access_logger.log(level, json.dumps(record, ensure_ascii=False), extra={"access": record})

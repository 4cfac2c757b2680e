"""The server's app: its state, its routes and the decide path (a Jev-compatible Starlette app over a loaded export).

The server's layers: :mod:`~hf_openjev.serve.edge` (the HTTP vocabulary: error bodies, request ids, reading a body),
this module (:func:`create_app`: state, routes, the decide path: tokenize, submit to the batcher, build the answer),
:mod:`~hf_openjev.serve.middleware` (keys, metrics, access log, request ids, around the app),
:mod:`~hf_openjev.serve.startup` (``hf-openjev serve``: checks, loading, warm-up, uvicorn) and
:mod:`~hf_openjev.serve.batcher` with its policy (:mod:`~hf_openjev.serve.batching_policy`).

Routes (docs/contract.md §7):

* ``POST /v1/systemone`` (and its alias ``POST /v1/inference``): one decision request -> the response of
  docs/contract.md §6, with ``metadata.request_id`` and the batch it shared;
* ``GET /v1/models``: the served names, both as ``{"object": "list", "data": [{"id", "object", ...}]}``
  (OpenAI style) and as ``{"models": [{"name", "description", "release_date"}]}`` (what the TypeSafe SDK reads);
* ``GET /health``: readiness, for load balancers: 200 ``{"status": "ok", ...}`` once the lifespan has started the
  batcher (``"degraded"``, still 200, while a replica is hung, retired or failed a recent group); 503 ``{"status": "starting"}`` before, ``{"status": "draining"}`` from SIGTERM on (``serve`` answers
  ``"loading"`` / ``"warming_up"`` while the model loads: :mod:`hf_openjev.serve.lifecycle`);
* ``GET /health/live`` (liveness) and ``GET /metrics`` (Prometheus): :mod:`hf_openjev.serve.middleware`, which also
  checks API keys and writes the JSON access log.

A request goes through, in this order (docs/contract.md §2; the first error wins):

1. (:mod:`~hf_openjev.serve.edge`) ``Content-Type`` must be ``application/json`` (case-insensitive, parameters ignored) -> 415;
2. the body is read within ``--body-timeout`` (408) under a hard cap, ``--max-body-bytes`` (default 4 MiB; a larger
   ``Content-Length`` is refused before reading) -> 413 naming the cap; ``Content-Encoding`` gzip/deflate (and zstd
   where a decoder is installed) is decoded under the same cap;
3. strict JSON (:mod:`hf_openjev.serve.strict_json`) and validation, then tokenization
   (:func:`hf_openjev.scoring.tokenize_request`), off the event loop on thread pools picked by size (small requests
   never wait behind big ones; tiny work runs on the loop: :mod:`hf_openjev.serve.preparing`) -> 422; past ``--max-request-tokens`` input
   tokens -> 413 (tokenizing stops there);
4. admission to the :class:`~hf_openjev.serve.batcher.Batcher` in the client's lane (the id of its API key,
   however the ``Authorization`` header spells it; else its connection: :mod:`hf_openjev.serve.batching_policy`):
   a full queue -> 503 ``server is busy`` with ``Retry-After``;
   during shutdown -> 503 ``server is shutting down``;
5. scoring, shared with concurrent requests; a failure -> 500 ``model inference failed`` (nothing partial).

Steps 3 to 5 are bounded (:mod:`hf_openjev.serve.bounded`): past ``--request-timeout`` -> 504 ``request deadline
exceeded``; a client that disconnects gets nothing and its request leaves the queue unscored (logged as 499).

So invalid input always gets a 4xx, never a 5xx. Every error body is
``{"error": msg, "detail": [{"msg": msg, "type": ..., "loc": [...]}]}``, which Open-Jev clients (``error``) and
FastAPI-style clients (``detail``) both read. Each request has an id (the client's ``X-Request-Id`` when it is
sane, else a fresh one): it is logged, returned in ``X-Request-Id`` and ``x-typesafe-request-id`` and put in
``metadata.request_id``.

Shutdown (SIGINT/SIGTERM under ``serve``) drains first (:mod:`hf_openjev.serve.lifecycle`): new and kept-alive
requests get 503 while the requests in flight are answered, up to the drain timeout (then a JSON 503); then uvicorn
stops (its listening socket and idle kept-alive connections closed, without an answer) and the lifespan handler
lets the batcher answer every admitted request and stops its worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import functools
import hashlib
import logging
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from .. import contract
from ..errors import InferenceError, RequestError
from .batcher import (
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_WAIT_MS,
    Batcher,
    BatcherClosed,
    QueueFull,
    use_device,
)
from .bounded import ClientGone, DeadlinePassed, DrainExpired, run_bounded
from .edge import (
    MSG_BUSY,
    MSG_DEADLINE,
    MSG_INFERENCE,
    MSG_INTERNAL,
    MSG_SHUTTING_DOWN,
    HTTPError,
    answer_http_exception,
    answer_internal_error,
    error_body,
    id_headers,
    json_response,
    read_body_in_time,
    request_id_of,
)
from .keys import KeyChecker
from .lifecycle import begin_drain, finish_drain
from .limits import RequestLimits
from .middleware import ABANDONED, ACCESS_DETAIL, KEY_ID, OpsMiddleware, ServerOps
from .preparing import PreparePools, measure_tokenize_work
from .strict_json import MSG_INVALID_JSON, dumps, loads_strict

__all__ = ["POST_PATHS", "create_app", "decide"]

logger = logging.getLogger("hf_openjev.serve.server")  # one name for the server's log, whichever layer writes

POST_PATHS = ("/v1/systemone", "/v1/inference")


def _error_loc(message: str, obj) -> list:
    """Where a docs/contract.md §2 error points to, FastAPI style (``["body", field, ...]``)."""
    if message.startswith(MSG_INVALID_JSON) or message == contract.MSG_NOT_OBJECT:
        return ["body"]
    if message == contract.MSG_MODEL:
        return ["body", "model"]
    if message in (contract.MSG_STATE_MISSING, contract.MSG_STATE_TYPE):
        return ["body", "state"]
    questions = obj.get("questions") if isinstance(obj, dict) else None
    if not isinstance(questions, dict) or message in (contract.MSG_QUESTIONS_TYPE, contract.MSG_QUESTIONS_COUNT,
                                                      contract.MSG_CANDIDATES):
        return ["body", "questions"]
    for qid in questions:  # max_length: "question <id>: <n> tokens exceeds ..."
        if message.startswith(f"question {qid}: "):
            return ["body", "questions", qid]
    for qid, question in questions.items():  # the first question that fails on its own with this message
        try:
            contract.parse_request({"state": "", "questions": {qid: question}})
        except RequestError as exc:
            if exc.message == message:
                return ["body", "questions", qid]
    return ["body", "questions"]


def _release_date(model) -> str:
    """The export's date (its manifest's modification time), else today."""
    try:
        from ..checkpoint.manifest import MANIFEST_NAME

        root = Path(model.backbone.config._name_or_path)
        stamp = (root / MANIFEST_NAME).stat().st_mtime
        return _dt.datetime.fromtimestamp(stamp, _dt.timezone.utc).date().isoformat()
    except Exception:  # noqa: BLE001 - any stand-in model
        return _dt.datetime.now(_dt.timezone.utc).date().isoformat()


class _ServerState:
    def __init__(self, model, batcher: Batcher, *, prepare_workers: int, drain_timeout_s: float,
                 retry_after_s: int, release_date: str | None, limits: RequestLimits):
        self.model = model
        self.batcher = batcher
        # small and big work on separate pools (small requests never queue behind 4 MiB bodies); the tokenizer
        # is called from several threads at once: it releases the GIL, and a call changes no setting of it
        # one big worker: parsing JSON holds the GIL, so a second one would mostly take GIL time from small
        # requests (their forwards release and retake it at every op)
        self.executor = PreparePools(workers=prepare_workers, big_workers=1)
        self.drain_timeout_s = float(drain_timeout_s)
        self.retry_after_s = int(retry_after_s)
        self.draining = False
        self.ready = False  # the lifespan has started the batcher (GET /health: 200)
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.release_date = release_date or _release_date(model)
        self.started = time.time()
        self.preparing = 0  # requests being validated now: company the batcher may wait for
        self.path = "reference"  # the path the model was set up for (create_app)
        self.options = None  # the fast path's options (create_app; None: the model's own)
        self.limits = limits
        self.expired = False  # the drain time ran out: requests still held get 503 (lifecycle.finish_drain)
        self._expiry_waiters: set = set()

    def expiry(self) -> asyncio.Future:
        """A future of the running loop, resolved when the drain time runs out (at once if it has)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self.expired:
            future.set_result(None)
            return future
        self._expiry_waiters.add((loop, future))
        future.add_done_callback(lambda f: self._expiry_waiters.discard((loop, f)))
        return future

    def expire(self) -> None:
        """The drain time is up: every request still held stops and answers 503 (from any thread or loop)."""
        self.expired = True
        for loop, future in list(self._expiry_waiters):
            with contextlib.suppress(RuntimeError):  # that loop is closed
                loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))

    # -- CPU work, on the executor -------------------------------------------------------------------------
    def prepare(self, body: bytes):
        """Strict JSON, validation, tokenization (docs/contract.md §2 items 2..7)."""
        return self.tokenize(*self.parse(body))

    def parse(self, body: bytes):
        """Strict JSON and validation (docs/contract.md §2 items 2..6): ``(decoded body, ParsedRequest)``."""
        obj = None
        try:
            obj = loads_strict(body)
            return obj, contract.parse_request(obj, served_models=self.model.served_model_names)
        except Exception as exc:  # noqa: BLE001 - every failure is a 4xx (_validation_error)
            raise _validation_error(exc, obj) from None

    def parse_on_pool(self, body: bytes):
        """:meth:`parse` on a preparing pool's thread, then :meth:`tokenize` on the same thread when the pool that
        tokenization would pick is this one (no hop back to the event loop and out again):
        ``(decoded body, ParsedRequest, PreparedRequest or None)``; None: tokenize on the pool its size picks."""
        obj, parsed = self.parse(body)
        pools = self.executor
        work = measure_tokenize_work(parsed)
        if not pools.runs_inline(work) and pools.pick(work) is pools.pick(len(body)):
            return obj, parsed, self.tokenize(obj, parsed)
        return obj, parsed, None

    def tokenize(self, obj, parsed):
        """Tokenization and the ``max_length`` check (docs/contract.md §2 item 7): the PreparedRequest."""
        from ..scoring import tokenize_request

        try:
            return tokenize_request(self.model, parsed, max_total_tokens=self.limits.max_request_tokens,
                                    fast=self.path == "fast", options=self.options)  # the cap counts that path's work
        except Exception as exc:  # noqa: BLE001
            raise _validation_error(exc, obj) from None

    def finish(self, prepared, outcome, request_id: str) -> bytes:
        from ..scoring import build_answer

        try:
            response = build_answer(
                self.model, prepared, outcome.scores, seconds=outcome.seconds, prefix_cache=outcome.prefix_cache,
                method=outcome.method,
                extra_metadata={"request_id": request_id,
                                "batch": {"requests": outcome.batch_requests, "input_tokens": outcome.batch_tokens,
                                          "queue_seconds": outcome.queue_seconds}})
            return dumps(response)
        except Exception as exc:  # e.g. a non-finite score: an inference failure
            raise InferenceError(f"model inference failed: {exc}") from exc

    # -- bookkeeping ---------------------------------------------------------------------------------------
    def enter(self) -> None:
        self.active += 1
        self.idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.idle.set()


def _validation_error(exc: BaseException, obj) -> HTTPError:
    """The 4xx answer for a failure while preparing a request (``obj``: the decoded body, or None)."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, RequestError):
        kind = ("json_invalid" if exc.message.startswith(MSG_INVALID_JSON) else
                "request_too_large" if exc.status == 413 else "value_error")
        return HTTPError(exc.status, exc.message, type=kind, loc=_error_loc(exc.message, obj),
                         reason=getattr(exc, "detail", None))
    if isinstance(exc, RecursionError):
        return HTTPError(422, f"{MSG_INVALID_JSON}: nesting is too deep", type="json_invalid")
    logger.error("validating a request failed unexpectedly", exc_info=exc)  # never a 5xx for unforeseen input
    return HTTPError(422, f"request could not be validated: {type(exc).__name__}", type="value_error")


async def _prepare_off_loop(state: _ServerState, body: bytes):
    """Strict JSON and validation, then tokenization, each on the pool its size picks, or on the event loop when
    it is tiny (step 3, :class:`~hf_openjev.serve.preparing.PreparePools`: body bytes, then candidate characters);
    counted in ``state.preparing`` meanwhile, the company the batcher may wait for."""
    loop = asyncio.get_running_loop()
    pools = state.executor
    state.preparing += 1
    try:
        if pools.runs_inline(len(body)):
            obj, parsed = state.parse(body)
        else:
            obj, parsed, prepared = await loop.run_in_executor(pools.pick(len(body)), state.parse_on_pool, body)
            if prepared is not None:
                return prepared
        work = measure_tokenize_work(parsed)
        if pools.runs_inline(work):
            return state.tokenize(obj, parsed)
        return await loop.run_in_executor(pools.pick(work), state.tokenize, obj, parsed)
    finally:
        state.preparing -= 1


def _shutting_down(state: _ServerState) -> HTTPError:
    return HTTPError(503, MSG_SHUTTING_DOWN, type="service_unavailable", loc=[],
                     headers={"Retry-After": str(state.retry_after_s), "Connection": "close"})


def _client_key(request: Request):
    """Whose lane in the batcher's fair queue: the id of the key that authenticated the request (however the
    header was spelt); on a server without keys, the bearer token sent (its digest); else the connection."""
    scope = request.scope
    if scope.get(KEY_ID) is not None:
        return ("key", scope[KEY_ID])
    authorization = next((v for k, v in scope.get("headers") or [] if k.lower() == b"authorization"), None)
    token = KeyChecker.bearer_token(authorization)
    if token is not None:
        return ("token", hashlib.sha256(token).digest())
    client = scope.get("client")
    return ("connection", tuple(client) if client else None)


async def _submit(state: _ServerState, prepared, client=None):
    """Admission to the batcher and the wait for the request's scores (steps 4 and 5): 503 when the queue is full
    or when the batcher is closed."""
    busy = {"Retry-After": str(state.retry_after_s)}
    try:
        return await state.batcher.submit(prepared, client=client)
    except QueueFull:
        raise HTTPError(503, MSG_BUSY, type="server_busy", loc=[], headers=busy) from None
    except BatcherClosed:
        raise _shutting_down(state) from None


async def _answer(state: _ServerState, request: Request, body: bytes, request_id: str, box: dict,
                  arrived_draining: bool) -> tuple:
    """Prepare, score and build the answer of one read body: ``(payload bytes, outcome)``; the prepared request
    goes into ``box`` for the log. A valid request that arrived during the drain gets 503."""
    box["prepared"] = await _prepare_off_loop(state, body)
    if arrived_draining:
        raise _shutting_down(state)
    prepared = box["prepared"]
    outcome = await _submit(state, prepared, _client_key(request))
    if state.executor.answers_inline(prepared.parsed.candidate_count):
        return state.finish(prepared, outcome, request_id), outcome
    payload = await asyncio.get_running_loop().run_in_executor(state.executor, state.finish, prepared, outcome,
                                                               request_id)
    return payload, outcome


def _add_access_detail(request: Request, prepared, info: dict) -> None:
    """What the request's access line (:mod:`~hf_openjev.serve.middleware`, its only log line) says beyond the common
    fields: the request's shape once prepared, then ``info`` (its batch, or its error)."""
    detail = {}
    if prepared is not None:
        detail = {"questions": len(prepared.parsed.questions), "candidates": prepared.parsed.candidate_count,
                  "input_tokens": prepared.input_tokens}
    request.scope[ACCESS_DETAIL] = {**detail, **info}


class _Abandoned(Response):
    """No answer at all: the client has gone (logged as 499, never counted as an error of the client)."""

    def __init__(self):
        super().__init__(status_code=499)

    async def __call__(self, scope, receive, send) -> None:
        scope[ABANDONED] = True


async def decide(state: _ServerState, request: Request) -> Response:
    """``POST /v1/systemone`` and ``/v1/inference``: one decision request, through the steps of the module
    docstring, bounded by the request's deadline, its client's connection and the drain time
    (:mod:`hf_openjev.serve.bounded`); every failure becomes its error response, and the request's access line
    (:mod:`hf_openjev.serve.middleware`) gets its shape and its batch or error."""
    request_id = request_id_of(request)
    limits = state.limits
    deadline = None if limits.request_timeout_s is None else time.monotonic() + limits.request_timeout_s
    state.enter()
    info, box = {}, {"prepared": None}
    try:
        arrived_draining = state.draining  # validated still (bad input stays a 4xx), then 503 and closed
        body = await read_body_in_time(request, limits, state.expiry())
        payload, outcome = await run_bounded(_answer(state, request, body, request_id, box, arrived_draining),
                                             deadline=deadline,
                                             receive=request.receive, expired=state.expiry())
        info = {"batch": outcome.batch_requests, "queue_ms": round(outcome.queue_seconds * 1000, 1)}
        return json_response(payload, 200, id_headers(request_id))
    except HTTPError as exc:
        info = {"error": exc.message}
        return json_response(error_body(exc.message, type=exc.type, loc=exc.loc, reason=exc.reason), exc.status,
                              {**id_headers(request_id), **exc.headers})
    except InferenceError as exc:
        info = {"error": str(exc)}
        return json_response(error_body(MSG_INFERENCE, type="inference_error", loc=[]), 500,
                              id_headers(request_id))
    except (ClientDisconnect, ClientGone):
        info = {"error": "client disconnected"}
        return _Abandoned()
    except DeadlinePassed:
        info = {"error": MSG_DEADLINE}
        reason = f"no answer within {limits.request_timeout_s:g} s (--request-timeout)"
        return json_response(error_body(MSG_DEADLINE, type="timeout", loc=[], reason=reason), 504,
                              id_headers(request_id))
    except DrainExpired:
        info = {"error": f"{MSG_SHUTTING_DOWN} (drain timeout)"}
        error = _shutting_down(state)
        return json_response(error_body(error.message, type=error.type, loc=[]), 503,
                              {**id_headers(request_id), **error.headers})
    except Exception as exc:
        info = {"error": f"{type(exc).__name__}: {exc}"}
        logger.exception("request_id=%s failed", request_id)
        return json_response(error_body(MSG_INTERNAL, type="internal_error", loc=[]), 500,
                              id_headers(request_id))
    finally:
        state.leave()
        _add_access_detail(request, box["prepared"], info)


async def list_models(state: _ServerState, request: Request) -> Response:
    """``GET /v1/models``: the served names, OpenAI style (``data``) and as the TypeSafe SDK reads them
    (``models``)."""
    model = state.model
    names = list(dict.fromkeys(model.served_model_names))
    created = int(state.started)
    data = [{"id": name, "object": "model", "created": created, "owned_by": "open-jev", "root": model.model_id,
             **({"aliases": names[1:]} if i == 0 else {})}
            for i, name in enumerate(names)]
    described = [{"name": name, "release_date": state.release_date,
                  "description": (f"Open-Jev decision model {model.model_id}" if name == model.model_id else
                                  f"alias of {model.model_id}")}
                 for name in names]
    return json_response({"object": "list", "data": data, "models": described}, 200,
                          id_headers(request_id_of(request)))


async def report_health(state: _ServerState, request: Request) -> Response:
    """``GET /health``: readiness. 200 ``{"status": "ok", ...}`` once the lifespan has started (``"degraded"`` while
    a replica is hung, retired or failed a recent group: it still serves); 503 with ``"starting"`` before and
    ``"draining"`` during shutdown."""
    status = "draining" if state.draining else _serving_status(state.batcher) if state.ready else "starting"
    body = {"status": status, "ready": status in ("ok", "degraded"), "model": state.model.model_id,
            "active_requests": state.active, "batcher": state.batcher.stats(),
            "uptime_seconds": round(time.time() - state.started, 3)}
    return json_response(body, 200 if body["ready"] else 503, id_headers(request_id_of(request)))


def _serving_status(batcher) -> str:
    """``"ok"``, or ``"degraded"`` when a replica is not ok (hung, retired, a recent failed group)."""
    states = batcher.replica_states() if hasattr(batcher, "replica_states") else {}
    return "degraded" if any(count for name, count in states.items() if name != "ok") else "ok"


@contextlib.asynccontextmanager
async def run_lifespan(state: _ServerState, app):
    """Start the batcher's worker; at shutdown refuse new work, wait for the requests in flight (up to the drain
    timeout), let the batcher answer every admitted request and stop it."""
    batcher = state.batcher
    state.idle = asyncio.Event()  # bind to the serving loop
    if state.active == 0:
        state.idle.set()
    batcher.start()
    state.ready = True
    logger.info("serving %s (%s) on %s; max_queue=%d max_batch_tokens=%d max_wait_ms=%g", state.model.model_id,
                state.path, getattr(state.model, "device", "?"), batcher.max_queue, batcher.max_batch_tokens,
                batcher.max_wait_s * 1000.0)
    try:
        yield
    finally:
        begin_drain(app)  # once (a SIGTERM through build_server did it already)
        state.ready = False
        await finish_drain(app)
        stopped = await batcher.aclose(timeout=state.drain_timeout_s)
        if not stopped:
            logger.warning("the batcher worker did not stop within %.0f s", state.drain_timeout_s)
        state.executor.shutdown(wait=False)
        logger.info("shutdown complete")


def create_app(model, *, max_queue: int = DEFAULT_MAX_QUEUE, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
               max_wait_ms: float = DEFAULT_MAX_WAIT_MS, fast: bool | None = None, options=None,
               drain_timeout_s: float = 30.0, retry_after_s: int = 1, prepare_workers: int = 2, score_fn=None,
               release_date: str | None = None, api_keys=(), metrics_auth: bool = False,
               ops: ServerOps | None = None, replicas=None, limits: RequestLimits | None = None) -> Starlette:
    """The Starlette app serving ``model`` (a loaded :class:`~hf_openjev.model.JevModel`).

    ``max_queue``: requests waiting for the model before new ones get 503. ``max_batch_tokens``: unpadded input
    tokens per shared forward. ``max_wait_ms``: how long the oldest waiting request may wait for company.
    ``fast``: None = the fast path on CUDA, the reference path elsewhere; for the fast path the model is patched
    here (:func:`hf_openjev.scoring.prepare_path`) and every request is scored with ``options`` (a
    :class:`~hf_openjev.fast_options.FastPathOptions`; default: the defaults). ``score_fn``: replaces
    :func:`hf_openjev.scoring.score_prepared` (tests). The batcher's worker starts with the lifespan (or on the
    first request when the host runs no lifespan) and stops, after draining, at lifespan shutdown.

    ``api_keys``: keys for ``Authorization: Bearer`` (none: no key needed); ``metrics_auth``: ``/metrics`` needs
    one too. ``ops``: a :class:`~hf_openjev.serve.middleware.ServerOps` to share (``serve`` does, with its loader);
    default: a new one from ``api_keys`` and ``metrics_auth``, with its own metrics registry.

    ``replicas``: copies of ``model`` on other devices (``model`` among them, usually first), each set up like
    ``model`` and scoring groups on its own batcher worker (:mod:`hf_openjev.serve.batcher`); ``model`` answers the
    metadata and tokenizes. Default: ``[model]``.

    ``limits``: what one request may cost (:class:`~hf_openjev.serve.limits.RequestLimits`: body bytes, tokens of
    work, body and request timeouts, the batcher's slice and group deadline); default: the defaults.
    """
    from ..scoring import prepare_path, score_prepared

    ops = ops or ServerOps(api_keys=api_keys, metrics_auth=metrics_auth)
    with use_device(model):  # patching may launch kernels: on the model's own GPU
        path = prepare_path(model, fast, options)
    for replica in replicas or ():
        if replica is not model:
            with use_device(replica):
                prepare_path(replica, fast, options)
    score_fn = ops.time_scoring(score_fn or functools.partial(score_prepared, options=options))  # batch metrics
    limits = limits or RequestLimits()
    batcher = Batcher(model, max_queue=max_queue, max_batch_tokens=max_batch_tokens, max_wait_ms=max_wait_ms,
                      fast=fast, score_fn=score_fn, replicas=replicas, slice_tokens=limits.slice_tokens,
                      group_deadline_s=limits.group_deadline(len(replicas or [model])),
                      company_hint=lambda: state.preparing)  # ``state`` is bound below, before any request
    state = _ServerState(model, batcher, prepare_workers=prepare_workers, drain_timeout_s=drain_timeout_s,
                         retry_after_s=retry_after_s, release_date=release_date, limits=limits)
    state.path, state.options = path, options
    ops.watch_server(state)
    routes = [Route(route, functools.partial(decide, state), methods=["POST"]) for route in POST_PATHS]
    routes += [Route("/v1/models", functools.partial(list_models, state), methods=["GET"]),
               Route("/health", functools.partial(report_health, state), methods=["GET"])]
    app = Starlette(routes=routes, lifespan=functools.partial(run_lifespan, state),
                    exception_handlers={HTTPException: answer_http_exception, Exception: answer_internal_error},
                    middleware=[Middleware(OpsMiddleware, ops=ops)])
    app.state.jev = state
    app.state.ops = ops
    return app

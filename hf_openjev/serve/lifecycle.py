"""A server's life as a load balancer sees it: listening while the model loads, ready, draining.

:class:`LoadingApp` is the ASGI app ``hf-openjev serve`` runs: uvicorn listens at once, while ``build`` (load the
export, warm up, :func:`~hf_openjev.serve.app.create_app`) runs on a thread. Meanwhile ``GET /health`` answers
503 ``{"status": "loading"}`` (then ``"warming_up"``) and every other request 503 ``server is starting`` with
``Retry-After``; once the built app's lifespan has started, every request goes to it (its ``/health``: 200
``{"status": "ok"}``). If ``build`` fails, ``on_failure`` is called (``serve`` stops uvicorn) and
:attr:`LoadingApp.error` holds the exception, which ``serve`` raises once uvicorn has stopped.

:func:`build_server` makes the uvicorn server whose SIGINT/SIGTERM handler drains before uvicorn stops:

1. :func:`begin_drain` marks the app draining and logs how many requests it holds: from then on new decision
   requests, on new connections or kept-alive ones, get a JSON 503 ``server is shutting down`` with
   ``Retry-After`` and ``Connection: close``, and ``/health`` answers 503 ``{"status": "draining"}``; uvicorn
   still listens, so a client gets that answer rather than a refused or reset connection;
2. :func:`finish_drain` waits for the requests in flight, up to the app's drain timeout; past it, those still
   held are answered with the same JSON 503 (their work cancelled, nothing partial);
3. then, still listening, it waits for the connections to close, up to uvicorn's keep-alive timeout (5 s by
   default) and :data:`LINGER_MARGIN_S`: an idle kept-alive connection closes at that timeout as it would have
   without the signal, or its client's next request gets step 1's 503 with ``Connection: close``; with no
   connection open, this takes no time;
4. only then does uvicorn's own shutdown run: it closes the listening sockets (a new connection is refused) and
   any connection still open and idle, without an answer, finds nothing in progress, runs the lifespan shutdown
   (the batcher stops), and the process exits 0. A second signal cuts steps 2 and 3 short (and the process ends
   with the signal's status, as uvicorn's does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time

__all__ = ["LoadingApp", "begin_drain", "build_server", "finish_drain", "wait_for_connections_to_close"]

logger = logging.getLogger("hf_openjev.serve.server")

MSG_STARTING = "server is starting"


ANSWER_EXPIRED_S = 5.0  # past the drain timeout, how long the requests still held have to send their 503
LINGER_MARGIN_S = 0.5  # past uvicorn's keep-alive timeout, how long a drained server still waits for connections


def _state(app):
    return getattr(getattr(app, "state", None), "jev", None)


def begin_drain(app) -> bool:
    """Mark the app built by ``create_app`` draining (``app.state.jev``) and log the requests it holds; False
    when ``app`` is not one."""
    state = _state(app)
    if state is None:
        return False
    if not state.draining:
        state.draining = True
        logger.info("shutting down: draining %d in-flight requests", state.active)
    return True


async def finish_drain(app) -> None:
    """Wait for the app's requests in flight, up to its drain timeout; then have those still held answered with
    a JSON 503 (``state.expire()``) and give them :data:`ANSWER_EXPIRED_S` to send it."""
    state = _state(app)
    if state is None:
        return
    try:
        await asyncio.wait_for(state.idle.wait(), timeout=state.drain_timeout_s)
        return
    except asyncio.TimeoutError:
        logger.warning("drain timeout: %d requests still in flight get 503", state.active)
    state.expire()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(state.idle.wait(), timeout=ANSWER_EXPIRED_S)


class _LifespanDriver:
    """Runs an ASGI app's lifespan protocol from the outside (startup now, shutdown later)."""

    def __init__(self, app):
        self.app = app
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Future | None = None

    async def _expect(self, wanted: str) -> None:
        while True:
            getter = asyncio.ensure_future(self._outbox.get())
            await asyncio.wait({getter, self._task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                self._task.result()  # raises what ended the lifespan
                raise RuntimeError(f"the app's lifespan ended before {wanted}")
            message = getter.result()
            if message["type"] == f"{wanted}.complete":
                return
            if message["type"] == f"{wanted}.failed":
                raise RuntimeError(f"{wanted} failed: {message.get('message', '')}")

    async def start(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.ensure_future(self.app(scope, self._inbox.get, self._outbox.put))
        await self._inbox.put({"type": "lifespan.startup"})
        await self._expect("lifespan.startup")

    async def stop(self) -> None:
        await self._inbox.put({"type": "lifespan.shutdown"})
        await self._expect("lifespan.shutdown")
        await self._task


class LoadingApp:
    """503 while ``build(report_stage)`` builds the real app on a thread; then the real app. See the module doc."""

    def __init__(self, build, *, on_failure=None, retry_after_s: int = 5):
        self._build = build
        self._on_failure = on_failure
        self._retry_after_s = int(retry_after_s)
        self._task: asyncio.Future | None = None
        self._driver: _LifespanDriver | None = None
        self._started = time.time()
        self.stage = "loading"  # loading -> warming_up -> ready; failed; draining
        self.app = None  # the built app, once its lifespan has started
        self.error: BaseException | None = None

    def report_stage(self, stage: str) -> None:
        """``build`` says what it is doing (``"loading"``, ``"warming_up"``); shown by ``/health``."""
        if self.stage not in ("failed", "draining"):
            self.stage = stage

    def begin_drain(self) -> None:
        if self.app is None or not begin_drain(self.app):
            self.stage = "draining"

    async def finish_drain(self) -> None:
        """:func:`finish_drain` of the built app (nothing while loading)."""
        if self.app is not None:
            await finish_drain(self.app)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await self._run_lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._answer_unavailable(scope, send)
        else:  # a websocket: nothing here speaks it
            await send({"type": "websocket.close", "code": 1013})

    async def _answer_unavailable(self, scope, send) -> None:
        if scope["path"] == "/health":
            payload = {"status": self.stage, "ready": False, "uptime_seconds": round(time.time() - self._started, 3)}
        else:
            message = MSG_STARTING if self.stage != "draining" else "server is shutting down"
            payload = {"error": message, "detail": [{"msg": message, "type": "service_unavailable", "loc": []}]}
        body = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", str(self._retry_after_s).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _run_lifespan(self, receive, send) -> None:
        await receive()  # lifespan.startup
        self._task = asyncio.ensure_future(self._load())
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await self._stop()
        await send({"type": "lifespan.shutdown.complete"})

    def _build_on_thread(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(result, error) -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)

        def work() -> None:
            try:
                result, error = self._build(self.report_stage), None
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped meanwhile
                loop.call_soon_threadsafe(settle, result, error)

        # a daemon thread: a SIGTERM while loading must not wait for the load to finish
        threading.Thread(target=work, name="jev-load", daemon=True).start()
        return future

    async def _load(self) -> None:
        try:
            app = await self._build_on_thread()
            self._driver = _LifespanDriver(app)
            await self._driver.start()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # reported; serve raises it once uvicorn stopped
            self.error, self.stage = exc, "failed"
            expected = isinstance(exc, ValueError)  # CheckpointError, UsageError, ...: one line
            logger.error("loading the model failed: %s", exc, exc_info=not expected)
            if self._on_failure is not None:
                self._on_failure()
            return
        self.app = app
        if self.stage == "draining":  # SIGTERM came while the lifespan started
            begin_drain(app)
        else:
            self.stage = "ready"

    async def _stop(self) -> None:
        task = self._task
        if task is not None and not task.done():
            if self._driver is None:  # still loading: give up on it
                logger.warning("stopped while loading the model")
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._driver is not None and self.error is None:
            await self._driver.stop()


async def wait_for_connections_to_close(server_state, seconds: float) -> None:
    """Until uvicorn holds no connection, ``seconds`` at most: an idle kept-alive one closes at its keep-alive
    timeout, or answers its client's next request (the drain's 503 with ``Connection: close``) and closes."""
    deadline = time.monotonic() + seconds
    while server_state.connections and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def build_server(config, *, on_exit, drain=None):
    """A ``uvicorn.Server`` for ``config`` whose first SIGINT/SIGTERM calls ``on_exit()`` at once and whose
    shutdown first awaits ``drain()`` (when given) while the sockets still listen and the connections stay open,
    then, after a signal, :func:`wait_for_connections_to_close` for up to uvicorn's keep-alive timeout (plus
    :data:`LINGER_MARGIN_S`), so that a request on a kept-alive connection gets the drain's 503 (module doc).
    After a clean drain the signal is not raised again, so the process exits 0. A second signal cuts the drain and
    the wait short. The handler may be called from any thread (tests call it directly)."""
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        _jev_loop = None
        _jev_task = None
        _jev_signals = 0

        async def startup(self, sockets=None) -> None:
            self._jev_loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame) -> None:
            self._jev_signals += 1
            if self._jev_signals == 1:
                on_exit()
            elif self._jev_task is not None and self._jev_loop is not None:  # a second signal: stop draining
                with contextlib.suppress(RuntimeError):
                    self._jev_loop.call_soon_threadsafe(self._jev_task.cancel)
            super().handle_exit(sig, frame)

        async def _jev_drain(self) -> None:
            await drain()
            if self._jev_signals == 1:  # a signal, not a stop asked in-process: kept-alive clients get their 503
                await wait_for_connections_to_close(self.server_state,
                                                    self.config.timeout_keep_alive + LINGER_MARGIN_S)

        async def shutdown(self, sockets=None) -> None:
            if drain is not None and self._jev_signals <= 1:
                self._jev_task = asyncio.ensure_future(self._jev_drain())
                try:
                    await self._jev_task
                    self._captured_signals.clear()  # drained: exit 0 rather than dying by the signal
                except asyncio.CancelledError:
                    logger.warning("drain cut short by a second signal")
                except Exception:
                    logger.exception("draining failed")
            await super().shutdown(sockets=sockets)

    return _DrainingServer(config)

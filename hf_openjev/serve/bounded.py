"""A request's work, bounded: it stops when its client disconnects, when its deadline passes, or when the server's
drain time is up, whichever comes first.

:func:`run_bounded` runs the work (preparing, waiting for the batcher, building the answer) as a task beside
watchers. When one fires first, the work task is cancelled: a request still waiting in the batcher's queue leaves
it unscored (:meth:`~hf_openjev.serve.batcher.Batcher.submit`), a group already in flight finishes and this
request's answer is dropped. The caller learns why from the exception: :class:`ClientGone`,
:class:`DeadlinePassed` or :class:`DrainExpired`.

The disconnect watcher reads the ASGI ``receive`` channel, so it must start only after the body has been read
(the server reads it first); uvicorn then answers ``http.disconnect`` once the client closes its socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

__all__ = ["ClientGone", "DeadlinePassed", "DrainExpired", "run_bounded", "wait_disconnect"]


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


class DeadlinePassed(Exception):
    """The request's deadline (``--request-timeout``) passed first."""


class DrainExpired(Exception):
    """The server's drain time (``--drain-timeout``) ran out first."""


async def wait_disconnect(receive) -> None:
    """Return once ``receive`` (the body already consumed) says ``http.disconnect``."""
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


async def run_bounded(work, *, deadline: float | None, receive=None, expired: asyncio.Future | None = None):
    """``await work`` (a coroutine) unless the client leaves (``receive`` given), ``deadline`` (a
    ``time.monotonic()`` instant; None: none) passes or ``expired`` (a future of the running loop) resolves first;
    then the work is cancelled and :class:`ClientGone`, :class:`DeadlinePassed` or :class:`DrainExpired`
    raised."""
    task = asyncio.ensure_future(work)
    watchers = {}
    if receive is not None:
        watchers[asyncio.ensure_future(wait_disconnect(receive))] = ClientGone
    if expired is not None:
        watchers[expired] = DrainExpired
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        done, _ = await asyncio.wait({task, *watchers}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        for watcher in watchers:
            watcher.cancel()  # the expiry future too: it is this request's own
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    for watcher in done:  # a disconnect watcher that failed (receive raised) means the connection is gone too
        if watcher in watchers:
            raise watchers[watcher]()
    raise DeadlinePassed()

"""Cross-request batching: concurrent requests share forwards; one worker thread per model replica owns it.

The server validates and tokenizes each request first (:func:`hf_openjev.scoring.prepare_request`), then hands
the :class:`~hf_openjev.scoring.PreparedRequest` to :meth:`Batcher.submit`. One worker thread (torch is not
safe for concurrent forwards on one model) takes the waiting requests round-robin across clients
(:mod:`~hf_openjev.serve.batching_policy`: one client's backlog never holds another's request back), as many as fit a
token budget (``max_batch_tokens``, counted as unpadded input tokens; a request bigger than the budget runs alone),
waiting at most ``max_wait_ms`` after the oldest one arrived for company (and only while ``company_hint()`` says more
requests are on their way, when the server gives one: a lone request does not wait), scores the group with ONE call of
:func:`hf_openjev.scoring.score_prepared` and splits the scores back per request. Every candidate is an
independent sequence, so an answer does not depend on the requests it was batched with (beyond floating-point
rounding of differently shaped kernels).

Slices: a request whose work is over ``slice_tokens`` is cut into parts (:mod:`~hf_openjev.serve.slices`); a group
takes one part of each request it serves, and a request with parts left goes back first in its lane, behind the
lanes not just served: a small request waits behind about one slice of a heavy one (one group: its input tokens
within ``max_batch_tokens``), and a request whose client left or whose deadline passed stops at its next slice
(``stopped`` in :meth:`Batcher.stats`). Its answer is joined from its parts' scores once the last one is scored.

Replicas: with ``replicas=[model_0, model_1, ...]`` (one copy of the model per GPU: ``hf-openjev serve --devices``)
there is one worker thread per replica, each bound to its replica's CUDA device, all taking groups from the one
queue: a free replica takes the next group, so N replicas score N groups at once.

Failures: a group fails wherever it fails (the scorer raised, returned the wrong number of results or a
non-finite score, or missed its deadline, ``group_deadline_s``: the server derives it from its request timeout,
:meth:`~hf_openjev.serve.limits.RequestLimits.group_deadline`); it is retried once on another replica that still
serves, and otherwise every request of that group gets :class:`~hf_openjev.errors.InferenceError` (the server
answers 500 ``model inference failed``); nothing partial is returned. A replica is retired by a streak of failures
or by its failure rate (:mod:`hf_openjev.serve.replica_health`) while another replica still serves; the last one
never is. A group past its deadline is taken from its replica (which counts a failure), and the scores it may
still return are discarded. Admission is bounded: when ``max_queue`` requests are waiting, :meth:`submit` raises
:class:`QueueFull` at once (the server answers 503 with ``Retry-After``). After :meth:`close` it raises
:class:`BatcherClosed`; requests already admitted are still answered (drain) before the worker stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import InferenceError
from .batching_policy import FairQueue, GroupPolicy
from .replica_health import (
    DEFAULT_FAILURE_RATE,
    DEFAULT_FAILURE_WINDOW,
    HealthPolicy,
    ReplicaHealth,
    check_finite_scores,
)
from .slices import default_slice_tokens, fits_one_slice, join_scores, split_request

__all__ = ["BatchOutcome", "Batcher", "BatcherClosed", "QueueFull", "bind_device", "use_device"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_BATCH_TOKENS = 4096 * 4
DEFAULT_MAX_WAIT_MS = 5.0
DEFAULT_RETIRE_AFTER_FAILURES = 3
SPLIT_INLINE_TOKENS = 32768  # input tokens up to which a request is cut into slices on the event loop (~0.2 ms)
REFERENCE_BATCH = 32  # sequences per forward of the reference path (hf_openjev.reference.DEFAULT_BATCH_SIZE)


class QueueFull(RuntimeError):
    """The admission queue already holds ``max_queue`` requests."""


class BatcherClosed(RuntimeError):
    """The batcher no longer admits requests (the server is shutting down)."""


@dataclass
class BatchOutcome:
    """The scores of one request, split back from the forward it shared."""

    scores: list[list[float]]  # per question, per candidate
    seconds: float  # scoring time of the whole group
    prefix_cache: dict
    method: str  # "fast" or "reference"
    batch_requests: int  # requests in the group (this one included)
    batch_tokens: int  # unpadded input tokens of the group
    queue_seconds: float  # from submit to the start of the group's forward


@dataclass
class _Item:
    prepared: object
    tokens: int  # unpadded input tokens of its next part (the group budget counts them)
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    client: object = None  # whose lane (hf_openjev.serve.batching_policy): an API key or a connection
    enqueued: float = field(default_factory=time.monotonic)
    failed_on: set = field(default_factory=set)  # names of the replicas this request's group failed on
    parts: list = field(default_factory=list)  # its slices (hf_openjev.serve.slices): [prepared] when one
    scored: list = field(default_factory=list)  # the scores of the parts scored so far
    seconds: float = 0.0  # scoring time of the groups its parts ran in
    shared_tokens: int = 0
    started: float | None = None  # when its first part's group started
    cache: dict | None = None  # its first part's prefix_cache report

    @property
    def part(self):
        """The part its next group scores."""
        return self.parts[len(self.scored)]


@dataclass
class _Attempt:
    """One group on one replica; ``abandoned`` once its deadline passed (its late scores are discarded)."""

    items: list
    deadline: float | None
    abandoned: bool = False


def _input_tokens(prepared) -> int:
    """A request's (or a slice's) unpadded input tokens; 1 for a stand-in without any."""
    return int(getattr(prepared, "input_tokens", 1))


def _default_score_fn(model, prepared, *, fast):
    from ..scoring import score_prepared

    return score_prepared(model, prepared, fast=fast)


def bind_device(model) -> None:
    """Make ``model``'s CUDA device this thread's current device (streams, graph pools and captures of the fast
    path use the current device); nothing for a CPU model or a stand-in without ``device``."""
    device = getattr(model, "device", None)
    if getattr(device, "type", None) == "cuda" and getattr(device, "index", None) is not None:
        import torch

        torch.cuda.set_device(device)


@contextlib.contextmanager
def use_device(model):
    """Inside the block, ``model``'s CUDA device is the current one (restored after); a CPU model or a stand-in
    changes nothing. For setting a replica up from a thread bound to another GPU (Triton launches on the current
    device)."""
    device = getattr(model, "device", None)
    if getattr(device, "type", None) != "cuda" or getattr(device, "index", None) is None:
        yield
        return
    import torch

    with torch.cuda.device(device):
        yield


@dataclass
class _Replica:
    """One model copy and its worker's counters."""

    model: object
    name: str
    health: ReplicaHealth
    groups: int = 0
    requests: int = 0
    failures: int = 0
    current: _Attempt | None = None  # the group it scores now

    @property
    def failing(self) -> int:
        return self.health.failing

    @property
    def retired(self) -> bool:
        return self.health.retired

    def stats(self) -> dict:
        return {"name": self.name, "groups": self.groups, "requests": self.requests, "failures": self.failures,
                "retired": self.retired, "state": self.health.state, "recent_failures": self.health.recent_failures,
                "recent_groups": len(self.health.recent),
                "hung": self.current is not None and self.current.abandoned,  # still in a group past its deadline
                **({"retired_because": self.health.reason}
                                                             if self.retired else {})}


class Batcher:
    """Groups prepared requests under a token budget and a maximum wait; scores each group on a worker thread
    (one per replica).

    ``score_fn(model, [prepared, ...], fast=fast)`` must return an object with ``scores`` (per request),
    ``seconds``, ``prefix_cache`` (per request) and ``path`` (the path that ran, each outcome's ``method``), like
    :func:`hf_openjev.scoring.score_prepared` (the default: with the options the model was patched with; the server
    binds its own). ``replicas``: the models that score groups, each on its own worker thread (default
    ``[model]``); ``model`` is the one callers read metadata from. ``retire_after_failures``: failed groups in a
    row after which a replica stops taking groups while another one serves (None: never);
    ``retire_failure_rate``: the share of its last ``failure_window`` groups that retires it too (None: never).
    ``group_deadline_s``: seconds a replica may spend on one group before the group is taken from it (None: no
    deadline; the server derives it from its request timeout). ``retry_on_another``: a failed group is scored once
    more on another serving replica before its requests get the error. ``slice_tokens``: tokens of work per slice of
    a request (:mod:`~hf_openjev.serve.slices`; None: the default of the first replica's device kind).
    """

    def __init__(self, model, *, max_queue: int = DEFAULT_MAX_QUEUE, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
                 max_wait_ms: float = DEFAULT_MAX_WAIT_MS, fast: bool | None = None,
                 score_fn: Callable | None = None, company_hint: Callable[[], int] | None = None,
                 name: str = "jev-batcher", replicas: Sequence | None = None,
                 retire_after_failures: int | None = DEFAULT_RETIRE_AFTER_FAILURES,
                 retire_failure_rate: float | None = DEFAULT_FAILURE_RATE, failure_window: int = DEFAULT_FAILURE_WINDOW,
                 group_deadline_s: float | None = None, retry_on_another: bool = True,
                 slice_tokens: int | None = None):
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be at least 1")
        if max_wait_ms < 0:
            raise ValueError("max_wait_ms must be >= 0")
        if replicas is not None and len(replicas) == 0:
            raise ValueError("replicas must hold at least one model")
        if group_deadline_s is not None and not group_deadline_s > 0:
            raise ValueError("group_deadline_s must be > 0 (or None)")
        if slice_tokens is not None and (isinstance(slice_tokens, bool) or slice_tokens < 1):
            raise ValueError("slice_tokens must be at least 1 (or None: the device's default)")
        policy = HealthPolicy(retire_after_failures, retire_failure_rate, failure_window)
        self.model = model
        models = list(replicas) if replicas is not None else [model]
        self.replicas = [_Replica(m, f"{i}:{getattr(m, 'device', 'model')}", ReplicaHealth(policy))
                         for i, m in enumerate(models)]
        self.group_deadline_s = group_deadline_s
        device = getattr(models[0], "device", None)
        self.slice_tokens = int(slice_tokens) if slice_tokens is not None else default_slice_tokens(device)
        fast_path = bool(fast) if fast is not None else getattr(device, "type", None) == "cuda"
        # the reference path's parts start on its batch boundaries: a lone request's forwards are its unsliced ones
        self._slicing = {"shares_prefixes": fast_path, "align": 1 if fast_path else REFERENCE_BATCH}
        self.retry_on_another = bool(retry_on_another)
        self.max_queue = int(max_queue)
        self.fast = fast
        self.retire_after_failures = retire_after_failures
        self._score_fn = score_fn or _default_score_fn
        self._policy = GroupPolicy(max_batch_tokens, float(max_wait_ms) / 1000.0, company_hint)
        self._name = name
        self._queue = FairQueue()
        self.withdrawn = 0  # requests whose client left before a worker took them: never scored
        self.stopped = 0  # requests whose client left (or deadline passed) between slices: the rest never scored
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # the queue's: submitters and workers wait on it
        self._watch = threading.Condition(lock)  # the deadline watchdog's, on the same lock: a request arriving
        # wakes the workers only, a group starting (a new deadline) the watchdog only
        self._closed = False
        self._in_flight = 0  # requests taken by the workers and not yet resolved
        self._threads: list[threading.Thread] = []

    # -- state -----------------------------------------------------------------------------------------------
    @property
    def max_batch_tokens(self) -> int:
        """Unpadded input tokens per group (:class:`~hf_openjev.serve.batching_policy.GroupPolicy`)."""
        return self._policy.max_batch_tokens

    @property
    def max_wait_s(self) -> float:
        """Seconds the oldest waiting request may wait for company."""
        return self._policy.max_wait_s

    @property
    def waiting(self) -> int:
        """Requests admitted and not yet taken by a worker."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Requests the workers are scoring now."""
        return self._in_flight

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def groups(self) -> int:
        """Groups scored (all replicas)."""
        return sum(r.groups for r in self.replicas)

    @property
    def requests(self) -> int:
        """Requests answered with scores (all replicas)."""
        return sum(r.requests for r in self.replicas)

    @property
    def failures(self) -> int:
        """Groups whose scoring failed (all replicas)."""
        return sum(r.failures for r in self.replicas)

    @property
    def _thread(self) -> threading.Thread | None:
        """The first worker thread (None before :meth:`start`)."""
        return self._threads[0] if self._threads else None

    def replica_states(self) -> dict[str, int]:
        """How many replicas are ``ok``, ``degraded`` and ``retired``."""
        counts = {"ok": 0, "degraded": 0, "retired": 0}
        for replica in self.replicas:
            counts[replica.health.state] += 1
        return counts

    def stats(self) -> dict:
        return {"waiting": self.waiting, "in_flight": self.in_flight, "max_queue": self.max_queue,
                "max_batch_tokens": self.max_batch_tokens, "max_wait_ms": self.max_wait_s * 1000.0,
                "groups": self.groups, "requests": self.requests, "failures": self.failures,
                "withdrawn": self.withdrawn, "stopped": self.stopped, "slice_tokens": self.slice_tokens,
                "group_deadline_s": self.group_deadline_s, "replica_states": self.replica_states(),
                "replicas": [r.stats() for r in self.replicas]}

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._threads or self._closed:
                return
            for i, replica in enumerate(self.replicas):
                name = self._name if len(self.replicas) == 1 else f"{self._name}-{i}"
                thread = threading.Thread(target=self._run, args=(replica,), name=name, daemon=True)
                self._threads.append(thread)
                thread.start()
            if self.group_deadline_s is not None:
                watchdog = threading.Thread(target=self._watch_deadlines, name=f"{self._name}-deadline", daemon=True)
                watchdog.start()

    def close(self, *, timeout: float | None = None) -> bool:
        """Stop admitting; let the workers answer every admitted request; join them. True if they stopped in time."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._watch.notify_all()
            threads = list(self._threads)
        if not threads:
            self._fail_waiting(BatcherClosed("the server is shutting down"))
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    async def aclose(self, *, timeout: float | None = None) -> bool:
        return await asyncio.get_running_loop().run_in_executor(None, lambda: self.close(timeout=timeout))

    # -- admission -------------------------------------------------------------------------------------------
    async def submit(self, prepared, *, client=None) -> BatchOutcome:
        """Queue one prepared request in ``client``'s lane (:mod:`~hf_openjev.serve.batching_policy`) and wait for its
        scores.

        Raises :class:`QueueFull` or :class:`BatcherClosed` at once when it cannot be admitted, and
        :class:`~hf_openjev.errors.InferenceError` when the forward of its group failed. Cancelled (the client
        left, its deadline passed) while it waits, it leaves the queue and is never scored; once a worker took
        its group, that slice is scored and the rest of the request never is.
        """
        loop = asyncio.get_running_loop()
        if self._closed:
            raise BatcherClosed("the server is shutting down")
        parts, tokens = [prepared], _input_tokens(prepared)
        if hasattr(prepared, "tokens") and tokens > self.slice_tokens and not fits_one_slice(
                prepared.tokens, self.slice_tokens, shares_prefixes=self._slicing["shares_prefixes"]):
            def split():
                return split_request(prepared, self.slice_tokens, **self._slicing)[0]

            # O(tokens): on the event loop up to SPLIT_INLINE_TOKENS (cheaper than a trip to a thread and back)
            parts = split() if tokens <= SPLIT_INLINE_TOKENS else await loop.run_in_executor(None, split)
        item = _Item(prepared, _input_tokens(parts[0]), loop.create_future(), loop, client, parts=parts)
        with self._cond:
            if self._closed:
                raise BatcherClosed("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are waiting (max_queue={self.max_queue})")
            self._queue.append(item)
            self._cond.notify_all()
        self.start()
        try:
            return await item.future
        except asyncio.CancelledError:
            with self._cond:
                if self._queue.remove(item):
                    if item.scored:
                        self.stopped += 1
                    else:
                        self.withdrawn += 1
                    self._cond.notify_all()
            raise

    # -- workers ---------------------------------------------------------------------------------------------
    def _eligibility(self, replica: _Replica):
        """Which queued requests ``replica`` may take: not those whose group already failed on it while another
        replica still serves (a predicate for :meth:`FairQueue.plan`)."""
        others = any(self._serving(r) for r in self.replicas if r is not replica)
        return lambda item: not (others and replica.name in item.failed_on)

    @staticmethod
    def _serving(replica: _Replica) -> bool:
        """Whether ``replica`` takes groups: not retired, and not stuck in a group past its deadline."""
        return not replica.retired and not (replica.current is not None and replica.current.abandoned)

    def _take_group(self, replica: _Replica) -> _Attempt | None:
        """The next group for ``replica`` (under the lock, so two workers never take the same request), when the
        policy (:class:`~hf_openjev.serve.batching_policy.GroupPolicy`) says to take it; None once closed and
        drained, or once ``replica`` is retired."""
        with self._cond:
            while True:
                if replica.retired:
                    return None
                group, wait_s = self._policy.next_group(self._queue, self._eligibility(replica), closed=self._closed)
                if not group:  # another worker may have taken what this one waited on
                    if self._closed and not self._queue:
                        return None
                    self._cond.wait(0.5 if self._queue else None)
                    continue
                if wait_s <= 0:
                    break
                self._cond.wait(wait_s)
            self._queue.take(group)
            self._in_flight += len(group)
            deadline = None if self.group_deadline_s is None else time.monotonic() + self.group_deadline_s
            replica.current = _Attempt(group, deadline)
            self._watch.notify_all()  # the watchdog learns the new deadline
            return replica.current

    def _run(self, replica: _Replica) -> None:
        bind_device(replica.model)
        while True:
            attempt = self._take_group(replica)
            if attempt is None:
                return
            error = self._score_group(replica, attempt.items, attempt)
            with self._cond:
                if replica.current is attempt:
                    replica.current = None
                if attempt.abandoned:  # past its deadline: the watchdog has settled the group already
                    continue
                self._in_flight -= len(attempt.items)
                self._cond.notify_all()
            if error is not None:
                self._count_failure(replica, attempt.items, error)

    def _count_failure(self, replica: _Replica, group: list[_Item], error: BaseException, *,
                       hung: bool = False) -> None:
        """Record a failed group on ``replica``: retry it once on another serving replica, else answer its requests
        with ``error``; retire ``replica`` when its health says so, or when it is ``hung`` (past a deadline), while
        another replica serves (never the last one)."""
        with self._cond:
            replica.failures += 1
            replica.health.record(False)
            reason = (f"did not answer a group within {self.group_deadline_s:g} s" if hung else
                      replica.health.retire_reason())
            if reason and not replica.retired and any(self._serving(r) for r in self.replicas if r is not replica):
                replica.health.retired = True
                replica.health.reason = reason
                logger.error("replica %s %s: it takes no more requests; %d replica(s) still serve", replica.name,
                             reason, sum(not r.retired for r in self.replicas))
            others = [r for r in self.replicas if r is not replica and self._serving(r)]
            if not self.retry_on_another:
                others = []
            retry = [item for item in group if not item.failed_on and others and not item.future.cancelled()]
            for item in reversed(retry):
                item.failed_on.add(replica.name)
                self._queue.appendleft(item)  # a retried request goes first in its lane
            self._cond.notify_all()
        if retry:
            logger.warning("replica %s: retrying %d request(s) of the failed group on another replica", replica.name,
                           len(retry))
        for item in group:
            if item not in retry:
                self._resolve(item, error=error)

    def _watch_deadlines(self) -> None:
        """Take every group past its deadline from its replica (a failure there); run until the workers stop."""
        with self._cond:
            while any(t.is_alive() for t in self._threads):
                now = time.monotonic()
                late = [r for r in self.replicas if r.current is not None and r.current.deadline is not None
                        and r.current.deadline <= now and not r.current.abandoned]
                for replica in late:
                    attempt = replica.current
                    attempt.abandoned = True
                    self._in_flight -= len(attempt.items)
                    error = InferenceError(f"model inference failed: the replica did not answer within "
                                           f"{self.group_deadline_s:g} s")
                    logger.error("replica %s: a group of %d requests missed its %g s deadline", replica.name,
                                 len(attempt.items), self.group_deadline_s)
                    self._count_failure(replica, attempt.items, error, hung=True)  # the condition's lock is reentrant
                deadlines = [r.current.deadline for r in self.replicas
                             if r.current is not None and r.current.deadline is not None and not r.current.abandoned]
                self._watch.wait(min(1.0, max(0.01, min(deadlines) - time.monotonic())) if deadlines else 1.0)

    def _score_group(self, replica: _Replica, group: list[_Item], attempt: _Attempt | None = None):
        """Score ``group`` on ``replica`` and resolve its requests; the error when scoring failed (None: done)."""
        live = [item for item in group if not item.future.cancelled()]
        if not live:
            return None
        started = time.monotonic()
        try:
            result = self._score_fn(replica.model, [item.part for item in live], fast=self.fast)
            scores = list(result.scores)
            caches = list(result.prefix_cache) or [{"enabled": False, "mode": "none", "shared_tokens": 0}] * len(live)
            if len(scores) != len(live) or len(caches) != len(live):
                raise InferenceError(f"the scorer returned {len(scores)} results for {len(live)} requests")
            check_finite_scores(scores)
            path = result.path  # "fast" or "reference": what ran
        except Exception as exc:
            if self._settled_late(attempt):
                return None
            logger.error("replica %s: scoring a group of %d requests failed: %s", replica.name, len(live), exc,
                         exc_info=not isinstance(exc, (InferenceError, ValueError)))
            return exc if isinstance(exc, InferenceError) else InferenceError(f"model inference failed: {exc}")
        with self._cond:
            if self._settled_late(attempt):
                return None  # past its deadline: answered elsewhere (or with an error) already
            tokens = sum(_input_tokens(item.part) for item in live)
            finished = self._advance(live, scores, caches, float(result.seconds), started)
            replica.groups += 1
            replica.requests += len(finished)
            replica.health.record(True)
        for item in finished:
            self._finish(item, path, len(live), tokens)
        return None

    def _advance(self, live: list[_Item], scores: list, caches: list, seconds: float, started: float) -> list:
        """Record each request's scored part (under the lock); queue again, first in its lane, each request with parts
        left (its lane was just served: other lanes' requests go first), unless its client left or its deadline
        passed (then the rest is never scored); the requests whose last part this was."""
        finished = []
        for item, item_scores, cache in zip(live, scores, caches):
            item.scored.append(item_scores)
            item.seconds += seconds
            item.shared_tokens += int(cache.get("shared_tokens", 0) or 0)
            item.cache = item.cache or cache
            item.started = started if item.started is None else item.started
            if len(item.scored) == len(item.parts):
                finished.append(item)
            elif item.future.done():
                self.stopped += 1
            else:
                item.tokens = _input_tokens(item.part)
                self._queue.appendleft(item)
                self._cond.notify_all()
        return finished

    def _finish(self, item: _Item, path: str, batch_requests: int, batch_tokens: int) -> None:
        """Answer a request whose every part is scored: its parts' scores joined in its shape."""
        try:
            scores = item.scored[0] if len(item.parts) == 1 else join_scores(item.prepared, item.scored)
        except (ValueError, StopIteration) as exc:
            self._resolve(item, error=InferenceError(f"model inference failed: {exc}"))
            return
        cache = dict(item.cache, shared_tokens=item.shared_tokens) if "shared_tokens" in item.cache else item.cache
        self._resolve(item, outcome=BatchOutcome(scores=scores, seconds=item.seconds, prefix_cache=cache,
                                                 method=path, batch_requests=batch_requests,
                                                 batch_tokens=batch_tokens,
                                                 queue_seconds=max(0.0, item.started - item.enqueued)))
    def _settled_late(self, attempt: _Attempt | None) -> bool:
        """Whether the watchdog took ``attempt`` (past its deadline); else its deadline is disarmed."""
        if attempt is None:
            return False
        with self._cond:
            if attempt.abandoned:
                return True
            attempt.deadline = None
            return False

    @staticmethod
    def _resolve(item: _Item, *, outcome: BatchOutcome | None = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if item.future.done():  # cancelled: the client went away
                return
            if error is not None:
                item.future.set_exception(error)
            else:
                item.future.set_result(outcome)

        try:
            item.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the event loop is closed; nobody is waiting any more
            pass

    def _fail_waiting(self, error: BaseException) -> None:
        with self._cond:
            items = self._queue.clear()
        for item in items:
            self._resolve(item, error=error)

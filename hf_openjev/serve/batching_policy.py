"""The batcher's policy, in one place: whose requests a group takes (the fair queue) and when it is taken (the wait
for company). :class:`~hf_openjev.serve.batcher.Batcher` keeps the threads, the replicas and the deadlines, and asks
:class:`GroupPolicy` for each group under its lock.

Who: one FIFO lane per client, groups formed round-robin across the lanes (:class:`FairQueue`). A client (an API
key, else a connection: the server decides) that sends many heavy requests fills only its own lane. A group takes
the head of every lane in turn (round 0: each lane's oldest request, round 1: each lane's second, ...) while the
token budget lasts, and the lanes served move to the back, so the next group starts with a client that was not
served: a small request waits behind at most one group per other client, never behind another client's whole
backlog. Lanes are ordered by when they were last served (never first; a lane that emptied keeps its client's turn
for a while, so a client sending one request at a time gains nothing from it). Within a lane, requests keep their
arrival order.

When (:class:`GroupPolicy`): a group is taken at once when it fills the token budget (``max_batch_tokens``,
unpadded input tokens; its first request always, however big), when the batcher is closing, or when no company is
coming (``company_hint()``, when given, counts the requests on their way: a lone request does not wait); else it
waits for company at most ``max_wait_s`` after its oldest request arrived.

Not thread-safe by itself: the batcher calls it under its lock.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterator

__all__ = ["FairQueue", "GroupPolicy"]


class FairQueue:
    """Items with ``client`` (any hashable; None is a client too), ``tokens`` and ``enqueued`` attributes."""

    REMEMBERED = 4096  # clients whose last turn is kept after their lane emptied

    def __init__(self):
        self._lanes: dict[object, collections.deque] = {}
        self._turn: dict[object, tuple[int, int]] = {}  # client -> (group it was last served in, lane opened)
        self._past: collections.OrderedDict[object, int] = collections.OrderedDict()  # emptied lanes' last turns
        self._groups = 0
        self._opened = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def _ordered_lanes(self) -> list[collections.deque]:
        return [self._lanes[c] for c in sorted(self._lanes, key=self._turn.__getitem__)]

    def __iter__(self) -> Iterator:
        """The items in the order groups would take them (round-robin across lanes)."""
        lanes = self._ordered_lanes()
        for depth in itertools.count():
            found = False
            for lane in lanes:
                if depth < len(lane):
                    found = True
                    yield lane[depth]
            if not found:
                return

    def append(self, item) -> None:
        lane = self._lanes.get(item.client)
        if lane is None:
            lane = self._lanes[item.client] = collections.deque()
            self._opened += 1
            self._turn[item.client] = (self._past.pop(item.client, 0), self._opened)
        lane.append(item)
        self._size += 1

    def _close_lane(self, client) -> None:
        del self._lanes[client]
        self._past[client] = self._turn.pop(client)[0]
        while len(self._past) > self.REMEMBERED:
            self._past.popitem(last=False)

    def remove(self, item) -> bool:
        """Take ``item`` out (its client went away); False when it is no longer queued."""
        lane = self._lanes.get(item.client)
        if lane is None:
            return False
        try:
            lane.remove(item)
        except ValueError:
            return False
        self._size -= 1
        if not lane:
            self._close_lane(item.client)
        return True

    def oldest(self):
        """The item waiting longest (the head of some lane), or None."""
        return min((lane[0] for lane in self._lanes.values()), key=lambda item: item.enqueued, default=None)

    def appendleft(self, item) -> None:
        """Queue ``item`` first in its client's lane (a request whose group failed, to be retried)."""
        self.append(item)
        lane = self._lanes[item.client]
        lane.rotate(1)  # the item just appended becomes the lane's head

    def plan(self, max_tokens: int, eligible=None) -> tuple[list, bool]:
        """The next group, in round-robin order, under ``max_tokens`` (its first item always, however big), and
        whether the budget is exhausted; ``eligible(item)``: only such items (all when None)."""
        group, total = [], 0
        for item in self:
            if eligible is not None and not eligible(item):
                continue
            if group and total + item.tokens > max_tokens:
                return group, True
            group.append(item)
            total += item.tokens
            if total >= max_tokens:
                return group, True
        return group, False

    def take(self, group: list) -> None:
        """Remove ``group`` (a :meth:`plan`, not changed since); the lanes it served get this turn."""
        self._groups += 1
        for item in group:
            lane = self._lanes[item.client]
            if lane[0] is item:
                lane.popleft()
            else:  # an item plan(eligible=...) skipped stays ahead of it in its lane
                lane.remove(item)
            self._size -= 1
            self._turn[item.client] = (self._groups, self._turn[item.client][1])
            if not lane:
                self._close_lane(item.client)

    def clear(self) -> list:
        """Empty the queue; the items it held, lane by lane."""
        items = [item for lane in self._ordered_lanes() for item in lane]
        for client in list(self._lanes):
            self._close_lane(client)
        self._size = 0
        return items


class GroupPolicy:
    """When the next group is taken: ``max_batch_tokens`` per group, at most ``max_wait_s`` of waiting for company
    after its oldest request arrived, and only while ``company_hint()`` (None: always) says requests are coming."""

    def __init__(self, max_batch_tokens: int, max_wait_s: float, company_hint: Callable[[], int] | None = None):
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_wait_s = float(max_wait_s)
        self._company_hint = company_hint

    def company_coming(self) -> bool:
        """Whether waiting can pay off: without a hint, always; with one, only while requests are on their way (a
        hint that fails counts as yes)."""
        if self._company_hint is None:
            return True
        try:
            return self._company_hint() > 0
        except Exception:  # noqa: BLE001 - a broken hint costs at most max_wait_s, never the group
            return True

    def next_group(self, queue: FairQueue, eligible=None, *, closed: bool = False,
                   now: float | None = None) -> tuple[list, float]:
        """The group ``queue`` would give now (:meth:`FairQueue.plan` under the budget, ``eligible`` items only) and
        the seconds to wait for company before taking it (0: take it now; an empty group: nothing to take)."""
        group, full = queue.plan(self.max_batch_tokens, eligible)
        if not group or full or closed or not self.company_coming():
            return group, 0.0
        now = time.monotonic() if now is None else now
        return group, max(0.0, min(item.enqueued for item in group) + self.max_wait_s - now)

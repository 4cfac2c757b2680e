"""When a replica stops taking groups: the batcher's health policy, one :class:`ReplicaHealth` per replica.

A replica is retired (while another one still serves; the last one never is) when its last ``streak`` groups all
failed, or when at least ``rate`` of its last ``window`` groups failed (counted once ``window // 2`` groups are
known): a replica failing every other group fails fast, so it would otherwise draw more traffic than a healthy one.
A failure is any way a group can fail on it: the scorer raised, returned the wrong number of results or a
non-finite score, or missed the group's deadline. ``state`` is ``"ok"``, ``"degraded"`` (a failure among its last
``window`` groups) or ``"retired"``; ``/health`` and ``/metrics`` show it.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

__all__ = ["DEFAULT_FAILURE_RATE", "DEFAULT_FAILURE_WINDOW", "HealthPolicy", "ReplicaHealth", "check_finite_scores"]

DEFAULT_FAILURE_WINDOW = 10
DEFAULT_FAILURE_RATE = 0.3


@dataclass(frozen=True)
class HealthPolicy:
    """``streak``: failed groups in a row that retire a replica (None: no streak rule); ``rate`` over the last
    ``window`` groups (None: no rate rule)."""

    streak: int | None = 3
    rate: float | None = DEFAULT_FAILURE_RATE
    window: int = DEFAULT_FAILURE_WINDOW

    def __post_init__(self):
        if self.streak is not None and (isinstance(self.streak, bool) or self.streak < 1):
            raise ValueError("retire_after_failures must be at least 1 (or None)")
        if self.rate is not None and not 0.0 < self.rate <= 1.0:
            raise ValueError("retire_failure_rate must be in (0, 1] (or None)")
        if self.window < 2:
            raise ValueError("failure_window must be at least 2 groups")


@dataclass
class ReplicaHealth:
    """One replica's recent outcomes (True: the group succeeded) and whether it is retired."""

    policy: HealthPolicy
    failing: int = 0  # failed groups in a row
    retired: bool = False
    reason: str = ""
    recent: collections.deque = field(default_factory=collections.deque)

    def record(self, ok: bool) -> None:
        self.failing = 0 if ok else self.failing + 1
        self.recent.append(ok)
        while len(self.recent) > self.policy.window:
            self.recent.popleft()

    @property
    def recent_failures(self) -> int:
        return sum(not ok for ok in self.recent)

    def retire_reason(self) -> str:
        """Why this replica should stop taking groups ("" while it should not)."""
        p = self.policy
        if p.streak is not None and self.failing >= p.streak:
            return f"failed {self.failing} groups in a row"
        known = len(self.recent)
        if p.rate is not None and known >= max(2, p.window // 2) and self.recent_failures >= p.rate * known:
            return f"failed {self.recent_failures} of its last {known} groups"
        return ""

    @property
    def state(self) -> str:
        if self.retired:
            return "retired"
        return "degraded" if self.recent_failures else "ok"


def check_finite_scores(scores) -> None:
    """Raise ``ValueError`` when any score of ``scores`` (per request, per question, per candidate) is NaN or
    infinite."""
    for request in scores:
        for question in request:
            if not all(math.isfinite(float(s)) for s in question):
                raise ValueError("the model produced a non-finite score")

"""What one request may cost the server: body size, input tokens, and the time its body and its answer may take.

:class:`RequestLimits` holds ``hf-openjev serve``'s ``--max-body-bytes``, ``--max-request-tokens``,
``--body-timeout`` and ``--request-timeout``, checked when built (one-line ``UsageError`` naming the option),
so a bad value is refused before the port is bound or the model loaded. ``max_request_tokens`` counts a request's
work as the path that scores it computes it (:mod:`hf_openjev.work_tokens`: every sequence in full on the reference
path, each shared prefix once on the fast path); its default admits the contract's largest choice (255 options) at
1,024 tokens a sequence on either path. Since the batcher runs a request in bounded slices
(:mod:`hf_openjev.serve.slices`), the cap bounds the request's total work, not how long it holds others back. The header timeout lives with the
connection (:mod:`hf_openjev.serve.header_timeout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UsageError

__all__ = ["DEFAULT_BODY_TIMEOUT_S", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_REQUEST_TOKENS",
           "DEFAULT_REQUEST_TIMEOUT_S", "GROUP_DEADLINE_SHARE", "ONE_REPLICA_GRACE", "UNTIMED_GROUP_DEADLINE_S",
           "RequestLimits", "check_positive"]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # docs/contract.md §2: 413 above 4 MiB
DEFAULT_MAX_REQUEST_TOKENS = 262144  # the work of a request (limits.py docstring): 255 full sequences of 1024 tokens fit
DEFAULT_REQUEST_TIMEOUT_S = 60.0
DEFAULT_BODY_TIMEOUT_S = 30.0
GROUP_DEADLINE_SHARE = 0.25  # with replicas, the group deadline as a share of the request timeout: retried in time
UNTIMED_GROUP_DEADLINE_S = 300.0  # the group deadline when requests have no timeout
ONE_REPLICA_GRACE = (0.1, 1.0)  # one replica: its group deadline this share of the request timeout (at most this
# many seconds) past it, so that a hung group's requests get their own 504 first (the event loop may wake a
# millisecond late, and a short request's group starts well within one of its arrival)


def check_positive(value, option: str, *, integer: bool = False, allow_none: bool = False):
    """``value`` when it is a positive (finite) number (an int where ``integer``), else a one-line UsageError
    naming ``option``; None passes where ``allow_none``."""
    if value is None and allow_none:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value <= 0:
        what = "a positive integer" if integer else "a positive number"
        raise UsageError(f"{option} must be {what}, got {value!r}")
    return value


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits; a timeout of None means none. With them, how the batcher bounds one request's work:
    ``slice_tokens`` (``--slice-tokens``: tokens of work per slice, :mod:`hf_openjev.serve.slices`; None: the
    device kind's default) and ``group_deadline_s`` (``--group-deadline``: seconds a replica may spend on one group
    before the group is taken from it and retried on another; None: :meth:`group_deadline` derives it)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_request_tokens: int | None = DEFAULT_MAX_REQUEST_TOKENS
    request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S
    slice_tokens: int | None = None
    group_deadline_s: float | None = None

    def __post_init__(self):
        check_positive(self.max_body_bytes, "--max-body-bytes", integer=True)
        check_positive(self.max_request_tokens, "--max-request-tokens", integer=True, allow_none=True)
        check_positive(self.request_timeout_s, "--request-timeout", allow_none=True)
        check_positive(self.body_timeout_s, "--body-timeout", allow_none=True)
        check_positive(self.slice_tokens, "--slice-tokens", integer=True, allow_none=True)
        check_positive(self.group_deadline_s, "--group-deadline", allow_none=True)

    def group_deadline(self, replicas: int = 1) -> float:
        """``group_deadline_s`` when set; else, with several ``replicas``, ``GROUP_DEADLINE_SHARE`` of the request
        timeout, so that a hung replica's group is retried on a healthy one before its requests time out; with one,
        the request timeout itself and a grace (:data:`ONE_REPLICA_GRACE`; no replica could retry it: its requests
        get their 504, and the replica counts a failure). ``UNTIMED_GROUP_DEADLINE_S`` without a request
        timeout."""
        if self.group_deadline_s is not None:
            return float(self.group_deadline_s)
        if self.request_timeout_s is None:
            return UNTIMED_GROUP_DEADLINE_S
        timeout = float(self.request_timeout_s)
        if replicas > 1:
            return timeout * GROUP_DEADLINE_SHARE
        share, most = ONE_REPLICA_GRACE
        return timeout + min(most, share * timeout)

"""``hf-openjev serve``'s numeric and named options, checked before anything is bound or loaded.

The batcher and uvicorn check some of these themselves, but only once the model has loaded (minutes at 27B) and
the port is bound; :func:`check_serve_options` refuses them first, each with one line naming the option
(:class:`~hf_openjev.errors.UsageError`, exit 2 from the command line).
"""

from __future__ import annotations

import math

from ..errors import UsageError
from .limits import check_positive

__all__ = ["DTYPES", "LOG_LEVELS", "check_serve_options"]

DTYPES = ("auto", "bfloat16", "float16", "float32")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _check_choice(value, option: str, choices) -> None:
    if value not in choices:
        raise UsageError(f"{option} must be one of {', '.join(choices)}, got {value!r}")


def check_serve_options(*, host, port, dtype, max_queue, max_batch_tokens, max_wait_ms, drain_timeout_s,
                        log_level, limit_concurrency, header_timeout_s) -> None:
    """One-line :class:`UsageError` for the first bad option (the request limits check themselves:
    :class:`~hf_openjev.serve.limits.RequestLimits`)."""
    if not isinstance(host, str) or not host.strip():
        raise UsageError(f"--host must be an address such as 127.0.0.1 or 0.0.0.0, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {port!r}")
    _check_choice(dtype, "--dtype", DTYPES)
    _check_choice(log_level, "--log-level", LOG_LEVELS)
    check_positive(max_queue, "--max-queue", integer=True)
    check_positive(max_batch_tokens, "--max-batch-tokens", integer=True)
    if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, (int, float)) or not math.isfinite(max_wait_ms) \
            or max_wait_ms < 0:
        raise UsageError(f"--max-wait-ms must be a number >= 0, got {max_wait_ms!r}")
    check_positive(drain_timeout_s, "--drain-timeout")
    check_positive(limit_concurrency, "--limit-concurrency", integer=True, allow_none=True)
    check_positive(header_timeout_s, "--header-timeout")

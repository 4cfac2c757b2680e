"""``hf-openjev serve``: the command line over :func:`hf_openjev.serve.startup.serve`."""

from __future__ import annotations

from ..family import UNKNOWN_SHAPE_HELP
from ..fast_options import FAST_OPTIONS_HELP, fast_options_argument
from ..fp8.option import FP8_CHOICES, FP8_HELP
from .batcher import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_QUEUE, DEFAULT_MAX_WAIT_MS
from .connection_limit import DEFAULT_MAX_CONNECTIONS
from .header_timeout import DEFAULT_HEADER_TIMEOUT_S
from .limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_REQUEST_TOKENS,
    DEFAULT_REQUEST_TIMEOUT_S,
    GROUP_DEADLINE_SHARE,
)
from .slices import DEFAULT_SLICE_TOKENS
from .write_timeout import DEFAULT_WRITE_TIMEOUT_S


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="merged export directory (hf-openjev export)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    where.add_argument("--devices", metavar="LIST",
                       help="one replica of the model per device, e.g. cuda:0,cuda:1: one server, one queue, each "
                            "batch to whichever replica is free (cpu,cpu for tests)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="backbone dtype (default auto = bfloat16; the head is always float32)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help=f"requests waiting for the model before new ones get 503 (default {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                        help=f"input tokens per shared forward (default {DEFAULT_MAX_BATCH_TOKENS})")
    parser.add_argument("--max-wait-ms", type=float, default=DEFAULT_MAX_WAIT_MS,
                        help=f"longest wait for other requests to batch with (default {DEFAULT_MAX_WAIT_MS:g})")
    fast = parser.add_mutually_exclusive_group()
    fast.add_argument("--fast", dest="fast", action="store_true", default=None, help="force the fast path")
    fast.add_argument("--reference", dest="fast", action="store_false", help="force the reference path")
    parser.add_argument("--fast-options", type=fast_options_argument, default=None, metavar="JSON",
                        help=FAST_OPTIONS_HELP)
    parser.add_argument("--fp8", default="off", choices=FP8_CHOICES,
                        help=FP8_HELP + "; with --devices, every replica loads this way")
    parser.add_argument("--allow-unknown-shape", action="store_true", help=UNKNOWN_SHAPE_HELP)
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to wait for in-flight requests after SIGTERM; past it they get a JSON 503 "
                             "(default 30)")
    limits = parser.add_argument_group("what one request may cost")
    limits.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"largest request body, decoded too; 413 above (default {DEFAULT_MAX_BODY_BYTES})")
    limits.add_argument("--max-request-tokens", type=int, default=DEFAULT_MAX_REQUEST_TOKENS,
                        help="tokens of work per request, as the path that scores it computes them (every "
                             "candidate sequence in full on the reference path, shared prefixes once on the fast "
                             f"path); 413 above, tokenizing stops there (default {DEFAULT_MAX_REQUEST_TOKENS})")
    limits.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="seconds from a request's arrival to its answer; 504 past it, its queued work dropped "
                             f"(default {DEFAULT_REQUEST_TIMEOUT_S:g})")
    limits.add_argument("--slice-tokens", type=int, default=None,
                        help="tokens of work per slice of a request: other requests are scheduled between a heavy "
                             "request's slices, and a request that timed out or whose client left stops at its next "
                             "one; the time a slice takes depends on the device and the model (default: "
                             + ", ".join(f"{k} {v}" for k, v in DEFAULT_SLICE_TOKENS.items()) + ")")
    limits.add_argument("--group-deadline", type=float, default=None,
                        help="seconds a replica may spend on one group before the group is retried on another "
                             "replica and the replica counts as failed (default: with --devices, "
                             f"{GROUP_DEADLINE_SHARE:g} x --request-timeout; with one device, --request-timeout and a "
                             "tenth of it, at most 1 s)")
    limits.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        help=f"seconds to receive a request's body; 408 past it (default {DEFAULT_BODY_TIMEOUT_S:g})")
    limits.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                        help="seconds a connection may wait for a request's headers (new or kept alive) before "
                             f"it is closed (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    parser.add_argument("--limit-concurrency", type=int, default=None,
                        help="open connections/requests before uvicorn itself answers 503 (default: no limit)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--warm-up", metavar="SHAPES.json", default=None,
                        help="token-shape file (JevBench manifest format): capture the fast path's CUDA graphs for "
                             "these request shapes before serving (default: capture on first use)")
    parser.add_argument("--api-key-file", metavar="PATH", default=None,
                        help="require Authorization: Bearer <key> with one of the keys in PATH (one a line; blank "
                             "lines and # comments ignored); also read from $HF_OPENJEV_API_KEYS (comma-separated). "
                             "/health, /health/live (probes carry no key) and /metrics stay open")
    parser.add_argument("--metrics-auth", action="store_true",
                        help="/metrics needs a key too (default: open, like /health and /health/live)")
    connections = parser.add_argument_group("what connections may hold")
    connections.add_argument("--write-timeout", type=float, default=DEFAULT_WRITE_TIMEOUT_S,
                             help="seconds a connection may go without reading any of its answer before it is "
                                  f"closed and the unsent bytes dropped (default {DEFAULT_WRITE_TIMEOUT_S:g})")
    connections.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                             help="connections open at once; a request on one past it gets a JSON 503 and the "
                                  f"connection is closed (default {DEFAULT_MAX_CONNECTIONS})")


def run(args) -> int:
    import sys

    from ..errors import InputFileError, UsageError
    from .startup import serve

    try:
        return _serve(serve, args)
    except (UsageError, InputFileError) as exc:  # a CUDA device without CUDA, a port in use, a bad key file: exit 2
        print(f"hf-openjev serve: error: {exc}", file=sys.stderr)
        return 2


def _serve(serve, args) -> int:
    from .limits import RequestLimits

    limits = RequestLimits(max_body_bytes=args.max_body_bytes, max_request_tokens=args.max_request_tokens,
                           request_timeout_s=args.request_timeout, body_timeout_s=args.body_timeout,
                           slice_tokens=args.slice_tokens, group_deadline_s=args.group_deadline)
    return serve(args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
                 max_queue=args.max_queue, max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms,
                 fast=args.fast, drain_timeout_s=args.drain_timeout, log_level=args.log_level,
                 limit_concurrency=args.limit_concurrency, warm_up_shapes=args.warm_up,
                 api_key_file=args.api_key_file, metrics_auth=args.metrics_auth, devices=args.devices,
                 fp8=args.fp8, fast_options=args.fast_options, limits=limits, header_timeout_s=args.header_timeout,
                 allow_unknown_shape=args.allow_unknown_shape, write_timeout_s=args.write_timeout,
                 max_connections=args.max_connections)

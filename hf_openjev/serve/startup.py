"""``hf-openjev serve``'s process start-up: the checks before anything loads, loading, warm-up, uvicorn.

:func:`serve` checks every option, the export and the port first (one line from the command line, before minutes of
loading), starts uvicorn at once (``GET /health`` answers 503 while the model loads:
:mod:`hf_openjev.serve.lifecycle`), then loads the replicas, warms them up and builds the app
(:func:`hf_openjev.serve.app.create_app`) on a thread.
"""

from __future__ import annotations

import json
import logging

from .app import create_app
from .batcher import DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_QUEUE, DEFAULT_MAX_WAIT_MS
from .connection_limit import DEFAULT_MAX_CONNECTIONS
from .header_timeout import DEFAULT_HEADER_TIMEOUT_S
from .keys import read_api_keys
from .lifecycle import LoadingApp, build_server
from .limits import RequestLimits, check_positive
from .middleware import OpsMiddleware, ServerOps, configure_access_log
from .option_checks import check_serve_options
from .write_timeout import DEFAULT_WRITE_TIMEOUT_S

__all__ = ["check_port_free", "serve"]

logger = logging.getLogger("hf_openjev.serve.server")  # one name for the server's log, whichever layer writes


def _default_device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` the way uvicorn will (``SO_REUSEADDR``) and close it again; a :class:`UsageError` if that
    fails, so a busy port is reported before the model spends minutes loading."""
    import errno
    import socket

    from ..errors import UsageError

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {port!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is already in use (another server?); stop it or pass "
                             "--port N") from None
        if exc.errno == errno.EACCES:
            raise UsageError(f"no permission to listen on {host}:{port} (ports below 1024 need privileges); pass "
                             "--port N with N >= 1024") from None
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; check --host and --port") from None


def _warm_up(models, shapes, fast, options, report_stage) -> None:
    """Capture the fast path's graphs for ``shapes`` on every replica (nothing to capture on the reference path)."""
    from ..scoring import use_fast_path
    from .replicas import warm_up_replicas

    if not use_fast_path(models[0], fast):
        logger.warning("warm-up skipped: the reference path captures no graphs")
        return
    report_stage("warming_up")
    for replica, report in zip(models, warm_up_replicas(models, shapes, options)):
        logger.info("warm-up: %d requests in %.1f s (%d longer than max_length skipped) on %s; graphs: %s",
                    report["requests"], report["seconds"], report["skipped_too_long"], replica.device,
                    report["graphs"])


def _check_devices(device, devices):
    """``device`` checked (CUDA asked without CUDA: UsageError), or ``devices`` parsed (a list), not both."""
    from ..devices import check_device
    from ..errors import UsageError
    from .replicas import parse_devices

    check_device(device)
    if devices is None:
        return None
    if device is not None:
        raise UsageError("give --device or --devices, not both")
    return parse_devices(devices if isinstance(devices, str) else ",".join(map(str, devices)))


def _configure_logging(log_level: str) -> None:
    """The root logger (when nothing configured it), the package's level and the access log."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hf_openjev").setLevel(log_level.upper())
    configure_access_log()


def _log_start(model_dir, ops, fp8: str, options=None) -> None:
    """The start-up lines: what loads, the keys, FP8's warning, and ``options`` (the fast path's, None on the
    reference path) where they differ from the package's defaults: given, or the model's own."""
    logger.info("loading %s; GET /health answers 503 until the model is ready%s", model_dir,
                f"; {len(ops.keys)} API key(s) required" if ops.keys.enabled else "")
    if fp8 != "off":
        logger.warning("fp8 %s: FP8 projections on the fast path; faster and half the weights, but it does not pass "
                       "the fidelity gate against the fp32 oracle (recipes/RESULTS.md)", fp8)
    changed = {k: v for k, v in (options.to_dict(changed_only=True) if options else {}).items() if k != "fp8"}
    if changed:
        logger.info("fast-path options other than the package defaults (the model's own or given): %s",
                    json.dumps(changed, sort_keys=True))


def _uvicorn_config(app, *, host: str, port: int, log_level: str, drain_timeout_s: float,
                    limit_concurrency: int | None, header_timeout_s: float,
                    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                    http: str = "auto", loop: str = "auto"):
    """uvicorn's configuration for ``serve``: our access log instead of uvicorn's, the head's size cap, the header
    and write deadlines and the connection cap on its HTTP protocol, a graceful shutdown past the drain (which
    ``build_server`` runs before uvicorn stops). ``http`` (``"h11"``, ``"httptools"``) and ``loop`` (``"asyncio"``, ``"uvloop"``):
    uvicorn's names; ``"auto"``, what ``serve`` runs, is httptools and uvloop when installed (the package's
    dependencies), else h11 and asyncio."""
    import uvicorn

    from .connection_limit import with_connection_limit
    from .head_limit import MAX_HEAD_BYTES, with_head_limit
    from .header_timeout import pick_http_protocol, with_header_timeout
    from .write_timeout import with_write_timeout

    protocol = with_header_timeout(with_head_limit(pick_http_protocol(http)), header_timeout_s)
    protocol = with_connection_limit(with_write_timeout(protocol, write_timeout_s), max_connections)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", http=protocol, loop=loop,
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                          timeout_graceful_shutdown=max(1, int(drain_timeout_s)),
                          limit_concurrency=limit_concurrency, access_log=False)


def _app_builder(model_dir, *, device, devices, dtype, fp8, allow_unknown_shape, shapes, fast, options, app_options):
    """What the loading thread runs (:class:`~hf_openjev.serve.lifecycle.LoadingApp`) while uvicorn already answers
    ``/health`` with 503: load a replica per device, prove the tokenizer's shortcuts, warm up (``shapes``), build the
    app with ``app_options`` (:func:`~hf_openjev.serve.app.create_app`'s keywords) and freeze the start-up objects."""
    def build(report_stage):
        from ..scoring import prove_tokenizer_shortcuts
        from .cpu_threads import leave_a_core_for_the_server
        from .replicas import load_replicas
        from .startup_gc import freeze_startup_objects

        chosen = devices or [device or _default_device()]
        threads = leave_a_core_for_the_server(chosen)
        if threads is not None:
            logger.info("scoring on the CPU with %d torch thread(s): one core left to the server (OMP_NUM_THREADS "
                        "overrides)", threads)
        models = load_replicas(model_dir, chosen, dtype=dtype, fp8=fp8, allow_unknown_shape=allow_unknown_shape)
        model = models[0]
        prove_tokenizer_shortcuts(model)  # not on the first request: seconds with the real tokenizer
        if shapes is not None:
            _warm_up(models, shapes, fast, options, report_stage)
        app = create_app(model, fast=fast, options=options, replicas=models if len(models) > 1 else None,
                         **app_options)
        logger.info("%d startup objects frozen out of the garbage collector's full passes", freeze_startup_objects())
        return app

    return build


def serve(model_dir, *, host: str = "127.0.0.1", port: int = 8000, device=None, dtype="auto",
          max_queue: int = DEFAULT_MAX_QUEUE, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
          max_wait_ms: float = DEFAULT_MAX_WAIT_MS, fast: bool | None = None, drain_timeout_s: float = 30.0,
          log_level: str = "info", limit_concurrency: int | None = None, warm_up_shapes=None,
          api_key_file=None, metrics_auth: bool = False, devices=None, fp8: str = "off", fast_options=None,
          limits: RequestLimits | None = None, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
          allow_unknown_shape: bool = False, write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
          max_connections: int = DEFAULT_MAX_CONNECTIONS) -> int:
    """Load the export in ``model_dir`` and serve it with uvicorn until SIGINT/SIGTERM (graceful).

    uvicorn listens at once; ``GET /health`` answers 503 (``loading``, ``warming_up``) until the model is loaded,
    warmed up and the batcher started, then 200 (:mod:`hf_openjev.serve.lifecycle`). ``api_key_file`` (and
    ``$HF_OPENJEV_API_KEYS``): keys for ``Authorization: Bearer`` (:mod:`hf_openjev.serve.keys`), read before
    anything else; ``metrics_auth``: ``/metrics`` needs a key too.

    ``warm_up_shapes``: a token-shape file (:mod:`hf_openjev.serve.warmup`); before serving, one fast-path forward per
    shape captures the CUDA graphs the traffic's first requests would otherwise capture. Before the model loads,
    the export directory (:func:`~hf_openjev.checkpoint.manifest.check_export_dir`), the device and the port are
    checked: a published package, a CUDA device without CUDA or a busy port raises at once (one line from the CLI).

    ``devices`` (instead of ``device``): ``"cuda:0,cuda:1"`` or a list: one replica of the model per device
    (:mod:`hf_openjev.serve.replicas`), every device checked before anything loads; each replica is warmed up
    before the server takes traffic, and the batcher feeds groups to whichever replica is free.

    ``fp8`` (``"all"``, ``"no-gdn"``; default ``"off"``): the fast path's FP8 projections, opt-in; it selects the
    fast path and is refused with ``fast=False`` (:func:`~hf_openjev.fp8.option.select_fp8_path`), before anything
    else. Every replica is loaded with ``load_export(..., fp8=fp8)``: quantized on the CPU, then moved, so no device
    holds the bf16 weights. It does not pass the fidelity gate (:data:`~hf_openjev.fp8.option.FP8_HELP`).

    ``fast_options``: the fast path's options other than the model's defaults (a mapping of
    :class:`~hf_openjev.fast_options.FastPathOptions` names to values over its family member's defaults,
    :func:`~hf_openjev.fast_options.options_for`; FP8 is ``fp8``'s), for every request and the warm-up; they
    select the fast path (on the CPU too), are checked before anything else, and are refused with ``fast=False``
    (the reference path has none).

    ``limits``: what one request may cost (:class:`~hf_openjev.serve.limits.RequestLimits`); ``header_timeout_s``:
    :mod:`~hf_openjev.serve.header_timeout`; ``write_timeout_s``: :mod:`~hf_openjev.serve.write_timeout`;
    ``max_connections``: :mod:`~hf_openjev.serve.connection_limit`. Every option is checked first
    (:mod:`.option_checks`).
    ``allow_unknown_shape``: serve a shape that is no Open-Jev model's (:mod:`hf_openjev.family`)."""
    from ..checkpoint.manifest import check_export_dir
    from ..family import check_export_shape
    from ..fast_options import options_for, resolve_fast_options
    from ..fp8.option import select_fp8_path
    from .warmup import load_shapes

    check_serve_options(host=host, port=port, dtype=dtype, max_queue=max_queue, max_batch_tokens=max_batch_tokens,
                        max_wait_ms=max_wait_ms, drain_timeout_s=drain_timeout_s, log_level=log_level,
                        limit_concurrency=limit_concurrency, header_timeout_s=header_timeout_s)
    check_positive(write_timeout_s, "--write-timeout")
    check_positive(max_connections, "--max-connections", integer=True)
    limits = limits or RequestLimits()
    fast = select_fp8_path(fp8, fast, fp8_flag="--fp8", reference_flag="--reference")  # before anything else
    _, fast = resolve_fast_options(fast_options, fp8=fp8, fast=fast, reference_flag="--reference")  # checked first
    ops = ServerOps(api_keys=read_api_keys(api_key_file), metrics_auth=metrics_auth)  # bad keys: before loading
    shapes = load_shapes(warm_up_shapes) if warm_up_shapes is not None else None  # a bad file fails before loading
    check_export_dir(model_dir)  # a package dir, a CUDA device without CUDA, a busy port: before the model loads
    member = check_export_shape(model_dir, allow_unknown=allow_unknown_shape)
    options = options_for(member, fast_options, fp8=fp8)  # the options over the member's defaults
    devices = _check_devices(device, devices)
    check_port_free(host, port)
    _configure_logging(log_level)

    build = _app_builder(model_dir, device=device, devices=devices, dtype=dtype, fp8=fp8,
                         allow_unknown_shape=allow_unknown_shape, shapes=shapes, fast=fast, options=options,
                         app_options=dict(max_queue=max_queue, max_batch_tokens=max_batch_tokens,
                                          max_wait_ms=max_wait_ms, drain_timeout_s=drain_timeout_s, ops=ops,
                                          limits=limits))
    loading = LoadingApp(build, on_failure=lambda: setattr(server, "should_exit", True))
    config = _uvicorn_config(OpsMiddleware(loading, ops), host=host, port=port, log_level=log_level,
                             drain_timeout_s=drain_timeout_s, limit_concurrency=limit_concurrency,
                             header_timeout_s=header_timeout_s, write_timeout_s=write_timeout_s,
                             max_connections=max_connections)
    server = build_server(config, on_exit=loading.begin_drain, drain=loading.finish_drain)
    _log_start(model_dir, ops, fp8, options if fast is not False else None)
    server.run()
    if loading.error is not None:
        raise loading.error
    return 0

"""Per-request timing of the recipes: device syncs, passes over the workload, single-candidate calls, summaries."""

from __future__ import annotations

import statistics
import time

import torch

from benchlib.workload import single_candidate_request


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan")


def add_ms_to(times: dict[str, float], name: str, fn):
    """``fn`` wrapped so that each call adds its wall ms to ``times[name]`` (the recipes' phase timers)."""
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name] = times.get(name, 0.0) + (time.perf_counter() - start) * 1000
    return timed


def run_pass(model, work, *, fast: bool, batch_size: int = 32):
    """Time every request (sync at both ends); returns per-request (seconds, response). ``batch_size``: the
    reference path's right-padded batch (fast=False); the fast path runs with the options the model is patched
    with (``apply_patches``)."""
    from hf_openjev.scoring import build_answer, score_prepared

    out = []
    for _, prepared in work:
        sync()
        start = time.perf_counter()
        result = score_prepared(model, [prepared], fast=fast, batch_size=batch_size)
        response = build_answer(model, prepared, result.scores[0], seconds=result.seconds,
                                prefix_cache=result.prefix_cache[0], method=result.path)
        sync()
        out.append((time.perf_counter() - start, response))
    return out


def time_fast_calls(model, request, *, calls: int, options=None) -> list[float]:
    """ms of ``calls`` fast-path calls on ``request``, each timed like run_pass (a device sync at both ends), with
    ``options`` (a FastPathOptions; default: the ones the model is patched with)."""
    from hf_openjev.scoring import score_prepared

    times = []
    for _ in range(calls):
        sync()
        t = time.perf_counter()
        score_prepared(model, [request], fast=True, options=options)
        sync()
        times.append((time.perf_counter() - t) * 1000)
    return times


def time_single(model, tokens: int, *, repeats: int) -> dict:
    """One candidate of ``tokens`` tokens on the fast path: the first call (may autotune / capture) and the median
    of the next ``repeats``, peak memory."""
    reset_peak()
    times = time_fast_calls(model, single_candidate_request(tokens), calls=1 + repeats)
    out = {"tokens": tokens, "first_ms": times[0], "peak_memory_gb": peak_gb()}
    if repeats:
        out["median_ms"] = statistics.median(times[1:])
    return out


def median_and_p90(values_ms: list[float]) -> dict:
    """``{median_ms, p90_ms}`` of ``values_ms`` (p90: ``sorted[min(n - 1, int(0.9 n))]``), the server-time
    recipes' convention."""
    s = sorted(values_ms)
    return {"median_ms": statistics.median(s), "p90_ms": s[min(len(s) - 1, int(0.9 * len(s)))]}


def summarize(times_ms: list[float]) -> dict:
    s = sorted(times_ms)
    n = len(s)
    return {"n": n, "mean_ms": statistics.fmean(s), "p50_ms": s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2,
            "p95_ms": s[max(0, int(0.95 * n) - 1)], "max_ms": s[-1]}


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median device time of ``fn`` in ms (CUDA events around each of ``reps`` calls, after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def graph_of(fn, args: dict):
    """Capture fn(**args) (after a warm-up on a side stream); returns the graph (args are its static inputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(**args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(**args)
    return graph

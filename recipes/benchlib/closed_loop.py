"""Closed-loop clients through the server's batcher (arm C's concurrency levels, serve_replicas)."""

from __future__ import annotations

import time

from benchlib.timing import summarize


def closed_loop(model, work, in_flight: int, *, max_wait_ms: float = 2.0, replicas=None) -> dict:
    """``in_flight`` closed-loop clients over the workload through the server's batcher (fast path); ``replicas``:
    copies of ``model`` on other GPUs (each patched), the batcher's workers, as ``serve --devices`` runs them.

    Each client sends its next request as soon as its previous answer is back; the batcher groups whatever is
    waiting under its token budget into one forward. Decisions = answered questions. One unmeasured run over the
    workload first (groups of new shapes autotune / capture there), then the measured run.
    """
    import asyncio

    from hf_openjev.scoring import build_answer
    from hf_openjev.serve.batcher import Batcher

    async def run():
        batcher = Batcher(model, max_queue=4 * max(in_flight, 1), max_wait_ms=max_wait_ms, fast=True,
                          replicas=replicas)
        batcher.start()
        pending = iter(range(len(work)))
        latencies, decisions = [], 0

        async def client():
            nonlocal decisions
            for i in pending:
                prepared = work[i][1]
                start = time.perf_counter()
                outcome = await batcher.submit(prepared)
                build_answer(model, prepared, outcome.scores, seconds=outcome.seconds,
                             prefix_cache=outcome.prefix_cache, method=outcome.method)
                latencies.append((time.perf_counter() - start) * 1000)
                decisions += len(prepared.parsed.questions)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(in_flight)))
        total = time.perf_counter() - start
        await batcher.aclose()
        return {"in_flight": in_flight, "decisions_per_s": decisions / total, "groups": batcher.groups,
                "replica_groups": [r["groups"] for r in batcher.stats()["replicas"]], **summarize(latencies)}

    warm = asyncio.run(run())  # warm-up: batches of new shapes compile / capture here
    before = [graph_stats(m) for m in replicas or [model]]
    result = asyncio.run(run())
    result["warmup_groups"] = warm["groups"]
    after = [graph_stats(m) for m in replicas or [model]]
    if after[0]:
        result["captures_while_measured"] = sum(a["captures"] - b["captures"] for a, b in zip(after, before))
    return result


def graph_stats(model) -> dict | None:
    from hf_openjev.patches import read_graph_stats

    return read_graph_stats(model)

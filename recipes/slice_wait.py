"""How long a small request waits beside a heavy one, with the batcher's slices and without (issue 36 item 6).

    python recipes/slice_wait.py                       # tiny random checkpoint, CPU, the default slice
    python recipes/slice_wait.py --model /path/to/export --device cuda --slice-tokens 8192

A heavy request (the contract's largest choice, 255 options, over a long state) is submitted; once its scoring has
started, a small request of another client follows. Printed (JSON): the heavy request's seconds, the small one's
latency, and the number of groups, for ``--slice-tokens`` and for one unsliced run (a slice larger than the
request). The figures depend on the machine and the load on it; measured ones go to recipes/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path


def heavy_request(state_words: int) -> dict:
    options = {f"Queue {i:03d}": f"Tickets routed to queue {i}" for i in range(255)}
    return {"state": "The customer writes about a double charge. " * (state_words // 7 + 1),
            "questions": {"queue": {"type": "choice", "instructions": "Which queue?", "criteria": options}}}


SMALL = {"state": "I was charged twice.", "questions": {"refund": {"type": "noul", "instructions": "Refund?"}}}


async def measure(model, heavy, small, slice_tokens) -> dict:
    from hf_openjev.serve.batcher import Batcher

    batcher = Batcher(model, max_wait_ms=0, slice_tokens=slice_tokens)
    start = time.perf_counter()
    heavy_task = asyncio.ensure_future(batcher.submit(heavy, client="heavy"))
    while batcher.in_flight == 0:
        await asyncio.sleep(0.001)
    small_start = time.perf_counter()
    await batcher.submit(small, client="small")
    small_seconds = time.perf_counter() - small_start
    await heavy_task
    heavy_seconds = time.perf_counter() - start
    batcher.close(timeout=30)
    return {"slice_tokens": batcher.slice_tokens, "groups": batcher.groups, "heavy_seconds": round(heavy_seconds, 3),
            "small_latency_seconds": round(small_seconds, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="merged export directory (default: build the tiny random checkpoint)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--slice-tokens", type=int, default=None, help="default: the device kind's")
    parser.add_argument("--state-words", type=int, default=150)
    args = parser.parse_args(argv)

    import hf_openjev
    from hf_openjev.scoring import prepare_path, prepare_request

    model_dir = args.model
    if model_dir is None:
        from hf_openjev.export.tiny import build_tiny_checkpoint

        cache = Path(os.environ.get("HF_OPENJEV_CACHE") or tempfile.gettempdir()) / "hf_openjev-tiny-slice-wait"
        model_dir = build_tiny_checkpoint(cache).export
    model = hf_openjev.load_export(model_dir, dtype=args.dtype, device=args.device)
    prepare_path(model)
    heavy, small = prepare_request(model, heavy_request(args.state_words)), prepare_request(model, SMALL)
    runs = [asyncio.run(measure(model, heavy, small, args.slice_tokens)),
            asyncio.run(measure(model, heavy, small, 10 * heavy.input_tokens))]
    print(json.dumps({"device": args.device, "heavy_input_tokens": heavy.input_tokens, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a fast-path request's wall time goes besides its graph's kernels: the host's phases, timed inside the call.

    python recipes/host_overhead.py --shape 27b --tokens 107 --requests 0,72 --out results/host

Each request is scored with ``score_prepared`` as the benchmark times it (device sync at both ends), with CUDA
graphs on, after one call that captures. Timing wrappers around the fast path's own steps split each call:

- ``plan``: ``plan_with_options`` (the prefix tree and packs);
- ``context``: ``build_pack_context`` (host layout, then its tensors copied to the device one by one);
- ``launch``: ``PackGraphs.run`` until it returns (the inputs copied into the graph's tensors, the replay launched);
- ``graph (GPU)``: CUDA events around ``PackGraphs.run``: the copies and the replay on the device;
- ``rest``: the wall time left: the head, the scores to the host (waits for the GPU), the answers.

The GPU has nothing to do during ``plan`` and ``context``; ``wall - graph (GPU)`` is what the host adds to the
request. Writes ``host_overhead_<shape>.json`` and ``.md`` (medians of ``--repeats``). On a machine without CUDA it
times the same phases of the eager path (a smoke run: no graph, no events).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from benchlib.provenance import command_line, versions
from benchlib.random_model import add_model_arguments, prepare_recipe
from benchlib.timing import add_ms_to, sync
from benchlib.workload import add_manifest_argument
from profile_forward import requests_of

PHASES = ("plan", "context", "launch", "graph (GPU)", "rest", "wall")


@contextmanager
def timed_phases(times: dict[str, float], events: list):
    """Wrap the fast path's steps so that each call adds its host ms to ``times`` and its CUDA events to ``events``."""
    from hf_openjev import fast_path
    from hf_openjev.patches.cuda_graphs import PackGraphs

    originals = {"plan_with_options": fast_path.plan_with_options, "build_pack_context": fast_path.build_pack_context}
    run = PackGraphs.run
    launch = add_ms_to(times, "launch", run)

    def timed_run(self, ctx):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = launch(self, ctx)
        end.record()
        events.append((begin, end))
        return out

    fast_path.plan_with_options = add_ms_to(times, "plan", originals["plan_with_options"])
    fast_path.build_pack_context = add_ms_to(times, "context", originals["build_pack_context"])
    if torch.cuda.is_available():
        PackGraphs.run = timed_run
    try:
        yield
    finally:
        fast_path.plan_with_options = originals["plan_with_options"]
        fast_path.build_pack_context = originals["build_pack_context"]
        PackGraphs.run = run


def time_request(model, request, repeats: int) -> dict[str, float]:
    """Median ms of each phase over ``repeats`` calls, after one that may capture."""
    from hf_openjev.scoring import score_prepared

    score_prepared(model, [request], fast=True)
    samples = {name: [] for name in PHASES}
    for _ in range(repeats):
        times, events = {}, []
        with timed_phases(times, events):
            sync()
            start = time.perf_counter()
            score_prepared(model, [request], fast=True)
            sync()
            wall = (time.perf_counter() - start) * 1000
        gpu = sum(begin.elapsed_time(end) for begin, end in events)
        host = sum(times.get(name, 0.0) for name in ("plan", "context", "launch"))
        for name, value in {**times, "graph (GPU)": gpu, "rest": wall - host, "wall": wall}.items():
            samples[name].append(value)
    return {name: statistics.median(values) if values else 0.0 for name, values in samples.items()}


def write_markdown(result: dict, path: Path) -> None:
    lines = [f"# Host time of fast-path requests, {result['shape']} shape (medians of {result['repeats']})", "",
             f"Command: `{result['command']}`", "", "Versions: " + ", ".join(f"{k} {v}" for k, v in
                                                                         result["versions"].items()), "",
             "| request | " + " | ".join(f"{p} ms" for p in PHASES) + " | wall - graph (GPU) ms |",
             "|---|" + "---|" * (len(PHASES) + 1)]
    for label, phases in result["requests"].items():
        lines.append(f"| {label} | " + " | ".join(f"{phases[p]:.3f}" for p in PHASES)
                     + f" | {phases['wall'] - phases['graph (GPU)']:.3f} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, shape="27b")
    parser.add_argument("--tokens", default="107", help="single noul candidates of these lengths")
    parser.add_argument("--requests", default="0,72", help="JevBench workload requests, 0-based indices")
    add_manifest_argument(parser)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    targets = requests_of(parser, args)
    out, _, model = prepare_recipe(args)
    from hf_openjev.patches import apply_patches

    apply_patches(model)  # set up for the fast path: the default options (graphs on CUDA)
    result = {"command": command_line(), "versions": versions(), "shape": args.shape,
              "repeats": args.repeats, "requests": {}}
    for label, request in targets:
        result["requests"][label] = time_request(model, request, args.repeats)
        print(label, {k: round(v, 3) for k, v in result["requests"][label].items()}, flush=True)
        (out / f"host_overhead_{args.shape}.json").write_text(json.dumps(result, indent=1))
        write_markdown(result, out / f"host_overhead_{args.shape}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

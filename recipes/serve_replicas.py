"""Serving throughput on N GPUs against one: the 231-request JevBench workload through the server's batcher with the
replica on cuda:0 alone, then with N replicas (cuda:0..N-1, what ``hf-openjev serve --devices`` runs), at each
number of closed-loop clients in flight.

    python recipes/serve_replicas.py --shape 27b --replicas 2 --in-flight 16,32 --out results/serve_replicas

Every replica is the same seeded random model (bench_jevbench.build_model) patched for the fast path (default
FastPathOptions, CUDA graphs on); each measurement is bench_jevbench.closed_loop (one unmeasured pass over the
workload, where new shapes capture their graphs on every replica, then the measured pass). Not measured: HTTP,
JSON and tokenization (the workload comes tokenized), which the server does on its CPU threads for all replicas.
Writes ``<out>/serve_replicas_<shape>_r<N>.json``: decisions/s and latency per level for 1 and N replicas, the
speed-up, and each replica's share of the groups. Without CUDA the replicas run on the CPU (smoke runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from benchlib.closed_loop import closed_loop
from benchlib.provenance import command_line, versions
from benchlib.random_model import add_model_arguments, build_model
from benchlib.shapes import VOCAB
from benchlib.workload import add_manifest_argument, build_workload, check_manifest_argument, manifest_identity


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, shape="27b")
    add_manifest_argument(parser)
    parser.add_argument("--replicas", type=int, default=None, help="GPUs to use (default: every visible one, >= 2)")
    parser.add_argument("--in-flight", default="16,32", help="closed-loop clients, comma-separated")
    parser.add_argument("--max-wait-ms", type=float, default=2.0)
    parser.add_argument("--limit", type=int, default=None, help="first N requests only (smoke runs)")
    parser.add_argument("--max-length", type=int, default=None, help="skip requests longer than this")
    args = parser.parse_args(argv)
    check_manifest_argument(parser, args)
    if args.replicas is None:
        args.replicas = max(2, torch.cuda.device_count())
    if args.replicas < 2:
        parser.error("--replicas must be at least 2 (the one-replica run is always measured first)")
    if torch.cuda.is_available() and args.replicas > torch.cuda.device_count():
        parser.error(f"--replicas {args.replicas}: this machine has {torch.cuda.device_count()} GPU(s)")
    return args


def build_replicas(args) -> list:
    """The seeded random model once per device, each patched for the fast path."""
    from hf_openjev.patches import apply_patches
    from hf_openjev.serve.batcher import use_device

    devices = [f"cuda:{i}" for i in range(args.replicas)] if torch.cuda.is_available() else ["cpu"] * args.replicas
    models = []
    for device in devices:
        model = build_model(args.shape, seed=args.seed, device=device, dtype=getattr(torch, args.dtype))
        with use_device(model):  # as create_app does: patching may launch kernels on the current GPU
            apply_patches(model)  # the model's defaults
        models.append(model)
    return models


def main(argv=None) -> int:
    args = parse_arguments(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.in_flight.split(",") if x]
    start = time.perf_counter()
    models = build_replicas(args)
    work = build_workload(args.manifest, vocab=VOCAB, seed=args.seed, limit=args.limit, max_length=args.max_length)
    results = {"command": command_line(), "versions": versions(), "shape": args.shape,
               "dtype": args.dtype, **manifest_identity(args.manifest), "devices": [str(m.device) for m in models],
               "requests": len(work),
               "build_s": time.perf_counter() - start, "replicas": {}}
    for count in (1, args.replicas):
        runs = results["replicas"][str(count)] = {}
        for in_flight in levels:
            replicas = models[:count] if count > 1 else None
            runs[str(in_flight)] = closed_loop(models[0], work, in_flight, max_wait_ms=args.max_wait_ms,
                                               replicas=replicas)
            print(f"{count} replica(s), {in_flight} in flight: {runs[str(in_flight)]['decisions_per_s']:.1f} "
                  f"decisions/s, p50 {runs[str(in_flight)]['p50_ms']:.0f} ms", flush=True)
    one, many = results["replicas"]["1"], results["replicas"][str(args.replicas)]
    results["speedup"] = {level: many[level]["decisions_per_s"] / one[level]["decisions_per_s"] for level in one}
    print(f"speed-up of {args.replicas} replicas over 1: {results['speedup']}", flush=True)
    (out / f"serve_replicas_{args.shape}_r{args.replicas}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

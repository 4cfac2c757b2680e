"""Scale-out of ``hf-openjev eval``: the 231-request JevBench workload scored by evaluate's own sharded loop, one
random model per rank, on 1 or N processes (GPUs).

    python recipes/scaleout_eval.py --shape 27b --out results/scaleout                                 # 1 GPU
    python -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no recipes/scaleout_eval.py --shape 27b --out results/scaleout                # 2 GPUs

``hf-openjev eval`` needs an export directory (54 GB of 27B weights to write and read per rank); this measures
what sharding changes without it. Every rank builds the same seeded random model (bench_jevbench.build_model) on
``cuda:<local_rank>`` and the same workload (bench_jevbench.build_workload: the 231 requests' token shapes with
random ids), takes its shard with :func:`hf_openjev.eval.evaluate.select_shard` (token-balanced, as eval does) and
scores it with :func:`hf_openjev.eval.evaluate.score_shard` (eval's batch loop, ``--batch-size`` requests per
forward plan, records appended to ``w<N>/results.rank<k>.jsonl``). Not timed: model building, tokenization (the
workload comes tokenized) and ``--warmup`` passes over the rank's own shard (graph capture, autotuning). Timed:
from a barrier to a barrier, so the wall time is the slowest rank's; each rank's own time is reported too.

Writes ``<out>/scaleout_<shape>_w<N>.json`` (wall seconds, requests/s, per-rank requests, tokens and seconds) and
``<out>/w<N>/results.jsonl`` (the merged records). When ``scaleout_<shape>_w1.json`` is already in ``<out>``, a run
on N > 1 processes also reports its speed-up over it and the largest probability difference between the two runs'
records (bf16 batch shapes differ between shards: small, not zero).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from benchlib.provenance import versions
from benchlib.random_model import build_model
from benchlib.shapes import SHAPES, VOCAB
from benchlib.timing import sync
from benchlib.workload import (
    MANIFEST,
    add_manifest_argument,
    build_workload,
    check_manifest_argument,
    manifest_identity,
)

from hf_openjev.contract import KINDS


def workload_tasks(work, *, manifest: Path = MANIFEST) -> tuple[list, dict]:
    """(Tasks, (tier, id) -> (PreparedRequest, 0.0)) of bench_jevbench workload items, as eval's loop takes them:
    labels as the workload's parsed question has them (o0.., 0.., no/yes), expected the first label."""
    from hf_openjev.eval.tasks import Task

    tasks, prepared = [], {}
    for line, (item, request) in enumerate(work, start=1):
        kind = item["kind"]
        labels = list(KINDS[kind].decisions or request.parsed.questions[0].labels)
        task = Task(id=str(item.get("id", line)), tier="jevbench231", family=kind, kind=kind, group=None,
                    labels=labels, expected=labels[0], request={"questions": {"q": {"type": kind}}},
                    file=Path(manifest).name, line=line)
        tasks.append(task)
        prepared[task.key] = (request, 0.0)
    return tasks, prepared


def measure(model, tasks, prepared, processes, *, out_dir: Path, batch_size: int, fast: bool, warmup: int) -> dict:
    """This rank's shard, warm-up passes, then one timed pass between barriers; returns this rank's numbers."""
    from hf_openjev.eval.evaluate import score_shard, select_shard
    from hf_openjev.eval.sharding import rank_results_path
    from hf_openjev.work_tokens import task_cost

    path = "fast" if fast else "reference"
    say = print if processes.is_main else None
    mine = select_shard(tasks, prepared, processes, path=path, warn=say)
    own = rank_results_path(out_dir, processes.rank)
    scratch = out_dir / f"warmup.rank{processes.rank}.jsonl"
    for _ in range(warmup if mine else 0):
        score_shard(model, mine, prepared, out_path=scratch, batch_size=batch_size, fast=fast)
    scratch.unlink(missing_ok=True)
    sync()
    processes.wait()
    start = time.perf_counter()
    if mine:
        score_shard(model, mine, prepared, out_path=own, batch_size=batch_size, fast=fast,
                    progress=processes.is_main, desc=f"scaleout rank 0 of {processes.world}")
    sync()
    seconds = time.perf_counter() - start
    processes.wait()
    wall = time.perf_counter() - start
    return {"rank": processes.rank, "device": str(model.device), "requests": len(mine),
            "input_tokens": sum(prepared[t.key][0].input_tokens for t in mine),
            "cost_tokens": sum(task_cost(prepared[t.key][0], path) for t in mine), "seconds": seconds,
            "wall_seconds": wall}


def compare(out: Path, shape: str, result: dict) -> dict | None:
    """Speed-up over, and max |probability difference| against, the one-process run in ``out`` (if any)."""
    base_file = out / f"scaleout_{shape}_w1.json"
    if result["world"] == 1 or not base_file.is_file():
        return None
    base = json.loads(base_file.read_text())
    from hf_openjev.eval.evaluate import read_results

    ours = read_results(out / f"w{result['world']}" / "results.jsonl")
    theirs = read_results(out / "w1" / "results.jsonl")
    diffs = [abs(p - theirs[k]["probabilities"][label]) for k, r in ours.items() if k in theirs
             for label, p in r["probabilities"].items()]
    flips = sum(1 for k, r in ours.items() if k in theirs and r["prediction"] != theirs[k]["prediction"])
    return {"one_process_wall_s": base["wall_seconds"], "speedup": base["wall_seconds"] / result["wall_seconds"],
            "compared": sum(1 for k in ours if k in theirs), "max_abs_dp": max(diffs, default=None),
            "decision_flips": flips}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    add_manifest_argument(parser)
    parser.add_argument("--batch-size", type=int, default=16, help="requests per forward plan (eval's --batch-size)")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only (smoke runs)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed passes over the rank's shard first")
    parser.add_argument("--fast", action=argparse.BooleanOptionalAction, default=None,
                        help="fast path (default: on with CUDA, as eval)")
    args = parser.parse_args(argv)
    check_manifest_argument(parser, args)

    from hf_openjev.eval.evaluate import read_results
    from hf_openjev.eval.sharding import close_processes, current_processes, merge_results, rank_device

    processes = current_processes()
    device = rank_device(None, processes)
    fast = args.fast if args.fast is not None else torch.device(device).type == "cuda"
    out = Path(args.out)
    run_dir = out / f"w{processes.world}"
    if processes.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in run_dir.glob("results*.jsonl"):
            stale.unlink()
    processes.wait()
    model = build_model(args.shape, seed=args.seed, device=device, dtype=getattr(torch, args.dtype))
    tasks, prepared = workload_tasks(build_workload(args.manifest, vocab=VOCAB, seed=args.seed, limit=args.limit),
                                      manifest=args.manifest)
    mine = measure(model, tasks, prepared, processes, out_dir=run_dir, batch_size=args.batch_size, fast=fast,
                   warmup=args.warmup)
    (run_dir / f"timing.rank{processes.rank}.json").write_text(json.dumps(mine))
    processes.wait()
    close_processes(processes)  # no collective call after this one
    if not processes.is_main:
        return 0
    ranks = [json.loads((run_dir / f"timing.rank{k}.json").read_text()) for k in range(processes.world)]
    merge_results(run_dir, read_results, [t.key for t in tasks])
    result = {"shape": args.shape, "dtype": args.dtype, **manifest_identity(args.manifest),
              "world": processes.world, "fast": fast,
              "batch_size": args.batch_size, "requests": len(tasks), "wall_seconds": mine["wall_seconds"],
              "requests_per_s": len(tasks) / mine["wall_seconds"], "ranks": ranks,
              "scored": len(read_results(run_dir / "results.jsonl")),
              "versions": versions()}
    result["vs_one_process"] = compare(out, args.shape, result)
    (out / f"scaleout_{args.shape}_w{processes.world}.json").write_text(json.dumps(result, indent=1))
    print(f"{processes.world} process(es): {len(tasks)} requests in {result['wall_seconds']:.2f} s "
          f"({result['requests_per_s']:.2f} req/s); per rank: "
          + ", ".join(f"{r['requests']} req / {r['cost_tokens']} tok / {r['seconds']:.2f} s" for r in ranks))
    if result["vs_one_process"]:
        v = result["vs_one_process"]
        print(f"speed-up over 1 process: {v['speedup']:.2f}x; max |dp| vs 1 process {v['max_abs_dp']}, "
              f"{v['decision_flips']} decision flips")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark driver: the 231-request JevBench workload on a random Open-Jev model shape (docs/performance.md).

One process, one set of weights, three arms:

  A  stock Transformers, torch fallbacks (fla unbound), right-padded batches of up to 32 candidates
  B  stock Transformers with fla-core bound (what a user gets by installing it)
  C  hf_openjev's fast path (packed candidates + shared prefixes + final-row last layer); with --cuda-graphs
     its packs replay CUDA graphs
  E  (optional) the same fast path eager, beside graph-replayed C, to separate graph replay from the rest
  A1 (optional) arm A with one candidate per batch: the stock model against itself, a floor for parity
  B1 (optional) arm B with one candidate per batch: the reference path against itself (fla bound), the same
     floor for parity against B

The workload is ``--manifest`` (default ``data/bench/jevbench231-shapes.json``: the requests' exact token shapes
under the real Qwen3.5 tokenizer) filled with seeded random ids. With ``--oracle oracle_<shape>.json``
(recipes/oracle.py; or gzipped, ``.json.gz``, as committed in data/bench/) every arm and --sweep entry is also compared with the fp32 oracle and judged by the fidelity
gate against B by ``hf-openjev fidelity``'s own code (hf_openjev.fidelity_check.judge_against_oracle):
fidelity_<shape>.json/.md/.png beside the bench's files; the workload is then the oracle's
(``jevbench231-shapes-estimated.json``) and the run refuses to start when its bf16 weights' sha256 differs from
the oracle's, or when the oracle lacks one of its requests or holds it with other token ids.

Per arm: warm-up pass, then measured passes in request order; each request timed with a device synchronize at
both ends, from token ids in to the response dict out. Reports mean / p50 / p95 (sorted[int(0.95 N) - 1]), the
kind x longest-candidate bucket table (beside the native server's group means), peak memory, warm-up time,
parity of C against A, and the throughput with 1, 8 and 16 closed-loop clients in flight through the server's
batcher. The shared pieces are the ``benchlib`` package beside this script.

  python recipes/bench_jevbench.py --shape 27b --arms A,B,C --out results/
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from benchlib.bench_fidelity import add_fidelity, configuration_name, open_oracle, start_fidelity
from benchlib.bench_fp8 import add_fp8_arguments, check_fp8_arguments, quantize_for_fast_path
from benchlib.bench_report import bench_stem, write_markdown
from benchlib.closed_loop import closed_loop, graph_stats
from benchlib.fla_binding import bind_fla
from benchlib.groups import table
from benchlib.parity import parity
from benchlib.provenance import command_line, versions
from benchlib.random_model import add_model_arguments, build_model, default_device, weights_gb
from benchlib.shapes import SHAPES, VOCAB  # noqa: F401  (SHAPES: the --shape choices, for callers of this script)
from benchlib.timing import peak_gb, reset_peak, run_pass, summarize, time_single
from benchlib.warmth import covers_every_shape, warmth_note
from benchlib.workload import (
    ESTIMATED_MANIFEST,
    MANIFEST,
    add_manifest_argument,
    build_workload,
    check_manifest,
    manifest_identity,
)

SHAPES_FILE = ESTIMATED_MANIFEST  # the fp32 oracles' workload (tests rebuild an oracle's requests from it)
ARMS = ("A", "B", "C", "E", "A1", "B1")
PARITY_PAIRS = (("A", "B"), ("A", "C"), ("B", "C"), ("A", "E"), ("E", "C"), ("A", "A1"), ("B", "B1"))


@dataclass
class BenchRun:
    """What the command line asks for, checked: the namespace, the arms in run order, the parity-only ones, the
    sweep entries, --fast-options and --patch-options as given, and C's FastPathOptions."""

    args: argparse.Namespace
    arms: list[str]
    parity_only: set[str]
    sweep_entries: list[dict]
    fast_options: dict
    patch_options: dict
    c_options: object
    parser: argparse.ArgumentParser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, shape="27b")
    add_manifest_argument(parser, default=None)
    parser.add_argument("--arms", default="A,B,C")
    parser.add_argument("--passes", type=int, default=2, help="measured passes for C (A runs one)")
    parser.add_argument("--b-passes", type=int, default=2, help="measured passes for B")
    parser.add_argument("--b-warmup-requests", type=int, default=None, metavar="N",
                        help="B's warm-up pass on the first N requests only (default: all; B captures no graphs). "
                             "A warm-up that misses a shape of the timed pass labels B cold: no C/B ratio")
    parser.add_argument("--e2e", default="", metavar="ARMS",
                        help="after the in-process arms, the same model over HTTP (recipes/bench_e2e.py) for these "
                             "arms, e.g. C,B: the requests as text from data/jevbench, the real tokenizer")
    parser.add_argument("--e2e-warmup-requests", type=int, default=None, metavar="N",
                        help="the HTTP arm B's warm-up pass on the first N requests only (default: all; C always warms "
                             "up on every request: a text's packs may need graphs of their own)")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only (smoke runs)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="only requests whose longest candidate sequence has at most this many tokens")
    parser.add_argument("--long-candidate", type=int, default=16384, help="also run one candidate this long on C")
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--single", default="107,3400", help="also time one candidate of each length on C")
    parser.add_argument("--fast-options", default="{}", help="JSON of FastPathOptions (e.g. min_shared_tokens)")
    parser.add_argument("--patch-options", default="{}",
                        help='JSON of FastPathOptions for C and E too, reported apart, e.g. {"compile_elementwise": true}')
    parser.add_argument("--parity-only", default="",
                        help="arms run for parity alone: no warm-up pass, so their times include autotuning and "
                             "are reported as such, never as a measurement (e.g. B, whose speed is measured elsewhere)")
    parser.add_argument("--compile-threads", type=int, default=None, metavar="N",
                        help="C's warm-ups: first a compile-ahead pass (patches.run_warm_up), Triton's compiles N at "
                             "a time; 0: none; default: the package's (patches.record.COMPILE_THREADS)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="arm C replays CUDA graphs per shape bucket (the library's default on CUDA); "
                             "--no-cuda-graphs measures the eager fast path")
    parser.add_argument("--sweep", default="[]",
                        help='JSON list of score_fast option overrides, e.g. \'[{"min_shared_tokens": 256}, '
                             '{"share_tails": false}]\': after the arms, one warm-up and one measured pass of C per '
                             "entry, over --fast-options (the break-even measurements behind the planner defaults)")
    parser.add_argument("--oracle", default=None,
                        help="an oracle_<shape>.json or .json.gz (recipes/oracle.py): compare every arm and sweep entry with it "
                             "and judge the fidelity gate against B; refused unless the weights are the oracle's")
    add_fp8_arguments(parser)
    return parser


def parse_arguments(argv) -> BenchRun:
    """The command line as a :class:`BenchRun`, everything checked before any work (a bad value: the parser's usage
    error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    parity_only = {a.strip() for a in args.parity_only.split(",") if a.strip()}
    if not set(arms) <= set(ARMS):
        parser.error(f"--arms {args.arms!r}: choose among A, B, C, E, A1, B1")
    if not parity_only <= set(arms) or "C" in parity_only:
        parser.error(f"--parity-only {args.parity_only!r}: name arms of --arms other than C (C is what is measured)")
    if "E" in arms and not args.cuda_graphs:
        parser.error("arm E (fast path, eager) is only meaningful beside graph-replayed C (drop --no-cuda-graphs)")
    if args.compile_threads is not None and args.compile_threads < 0:
        parser.error(f"--compile-threads {args.compile_threads}: give 0 (none) or more")
    try:
        sweep_entries = json.loads(args.sweep)
        base_fast_options = json.loads(args.fast_options)
        patch_options = json.loads(args.patch_options)
    except json.JSONDecodeError as error:
        parser.error(f"--sweep / --fast-options / --patch-options must be JSON: {error}")
    if not (isinstance(sweep_entries, list) and all(isinstance(e, dict) for e in sweep_entries)):
        parser.error(f"--sweep {args.sweep!r}: give a JSON list of objects, e.g. '[{{\"min_shared_tokens\": 256}}]'")
    from hf_openjev.family import member_sized
    from hf_openjev.fast_options import FastPathOptions, options_for

    try:  # C's options, checked (unknown names, bad values) before any work; --cuda-graphs decides cuda_graphs;
        # both over the shape's own defaults (a family member's, hf_openjev.fast_options.options_for)
        base = options_for(member_sized(args.shape), patch_options)
        c_options = FastPathOptions.from_mapping(base_fast_options, base=base)
        c_options = c_options.replace(cuda_graphs=args.cuda_graphs)
        for overrides in sweep_entries:
            c_options.replace(**overrides)
    except ValueError as error:
        parser.error(f"--patch-options / --fast-options / --sweep: {error}")
    arms, c_options = check_fp8_arguments(parser, args, arms, c_options, sweep_entries)
    e2e = [a.strip() for a in args.e2e.split(",") if a.strip()]
    if not set(e2e) <= {"B", "C"} or (e2e and args.fp8):
        parser.error(f"--e2e {args.e2e!r}: name B and/or C (and no --fp8)")
    args.e2e = e2e
    return BenchRun(args, arms, parity_only, sweep_entries, base_fast_options, patch_options, c_options, parser)


def run_sweep(model, work, sweep_entries, c_options, base_fast_options, *, args, arms, results: dict,
              responses: dict, fidelity, save) -> None:
    """--sweep: one warm-up and one measured pass of C per entry (its options over C's), compared with the
    reference arms and the oracle; then C's options again."""
    from hf_openjev.patches import apply_patches, run_warm_up

    quantize_for_fast_path(model, args, results)
    sweep = results["sweep"] = {}
    for overrides in sweep_entries:
        apply_patches(model, c_options.replace(**overrides))  # the entry's options, for its passes and singles
        label = json.dumps(overrides, sort_keys=True)
        # warm: new shapes autotune and capture here
        run_warm_up(model, lambda stage: run_pass(model, work, fast=True), compile_threads=args.compile_threads)
        measured = run_pass(model, work, fast=True)
        times = [t * 1000 for t, _ in measured]
        sweep[label] = {**summarize(times), "table": table(work, times), "fast_options": {**base_fast_options, **overrides}}
        if fidelity:
            add_fidelity(fidelity, configuration_name(label, args), [r for _, r in measured])
        for ref in ("A", "B"):  # the entry's answers against the reference arms this run has
            if ref in responses:
                sweep[label][f"parity_vs_{ref}"] = parity(responses[ref], [r for _, r in measured])
        if "C" in arms and args.single:  # the singles again on the entry's options, on the same machine
            sweep[label]["single_candidate"] = {n: time_single(model, int(n), repeats=5)
                                                for n in args.single.split(",") if n}
        save()  # after every entry, so a run cut short keeps the entries it finished
        print(f"sweep {label}: mean {sweep[label]['mean_ms']:.1f} ms"
              + "".join(f", parity vs {ref} {sweep[label][f'parity_vs_{ref}']}" for ref in ("A", "B")
                        if f"parity_vs_{ref}" in sweep[label]), flush=True)
    apply_patches(model, c_options)  # back to the options C ran with


def run_arm(run: BenchRun, arm: str, model, work, *, results: dict, responses: dict, fidelity) -> None:
    """One arm: its patches (C, E) or fla binding (A, B), warm-up unless parity-only, its measured passes, its
    entry in ``results["arms"]``, the graphs' counters (C) and the singles (C, right after its passes)."""
    from hf_openjev.patches import apply_patches, run_warm_up

    args = run.args
    fast = arm in ("C", "E")
    if fast:
        quantize_for_fast_path(model, args, results)  # --fp8: once, after the reference arms (bf16)
        record = apply_patches(model, run.c_options.replace(cuda_graphs=args.cuda_graphs and arm == "C"))
        results.setdefault("effective_patch_options", {})[arm] = record.options.to_dict()  # defaults included
    bind_fla(arm in ("B", "B1"))
    reset_peak()
    start = time.perf_counter()
    batch_size = 1 if arm in ("A1", "B1") else 32
    timed = arm not in run.parity_only
    limit = args.b_warmup_requests if arm == "B" else None
    ahead = None
    if arm not in ("A", "A1", "B1") and timed:  # warm-up: autotuning, compilation (C: graph capture)
        if fast:  # inside patches.warming_up: captures, no answering replays; with --compile-threads a pass before
            ahead = run_warm_up(model, lambda stage: run_pass(model, work[:limit], fast=True),
                                compile_threads=args.compile_threads)
        else:
            run_pass(model, work[:limit], fast=False)
    warmup_s = time.perf_counter() - start
    # B is cold when its warm-up missed a shape its timed pass runs (fla tunes its kernels there): no ratio from it
    cold = arm == "B" and timed and not covers_every_shape([item for item, _ in work[:limit]], [i for i, _ in work])
    before = graph_stats(model) if arm == "C" else None
    passes = [run_pass(model, work, fast=fast, batch_size=batch_size)
              for _ in range({"A": 1, "A1": 1, "B": args.b_passes, "B1": 1, "E": 1}.get(arm, args.passes))]
    times = [t * 1000 for p in passes for t, _ in p]
    per_request = [statistics.fmean(p[i][0] * 1000 for p in passes) for i in range(len(work))]
    responses[arm] = [r for _, r in passes[-1]]
    if fidelity:
        add_fidelity(fidelity, configuration_name(arm, args), responses[arm])
    results["arms"][arm] = {**summarize(times), "warmup_s": warmup_s, "passes": len(passes),
                            "peak_memory_gb": peak_gb(), "table": table(work, per_request),
                            "per_request_ms": per_request, "parity_only": not timed, "cold": cold,
                            "warmup_requests": len(work[:limit]) if timed and arm not in ("A", "A1", "B1") else 0}
    if ahead is not None and ahead["compile_ahead"] is not None:  # --compile-threads: its pass's share of warmup_s
        results["arms"][arm]["compile_ahead"] = ahead["compile_ahead"]
    label = warmth_note(cold, len(work[:limit]), len(work)) if timed else " (parity only, times include autotuning)"
    print(f"arm {arm}{label}: "
          + ", ".join(f"{k}={v:.1f}" for k, v in results["arms"][arm].items() if isinstance(v, float)), flush=True)
    if before is not None:
        stats = graph_stats(model)
        stats["captures_while_measured"] = stats["captures"] - before["captures"]
        results["arms"][arm]["graphs"] = stats
        print(f"graphs: {stats}", flush=True)
    if arm == "C" and args.single:  # right after C's passes, on C's patches, before any other arm runs
        results["single_candidate"] = {}
        for n in [int(x) for x in args.single.split(",") if x]:
            results["single_candidate"][str(n)] = time_single(model, n, repeats=5)
            print(f"single {n}-token candidate: {results['single_candidate'][str(n)]}", flush=True)
    for ref, other in PARITY_PAIRS:  # parity as soon as both sides exist, so a cut-short run keeps it
        key = f"parity_{other}_vs_{ref}"
        if ref in responses and other in responses and key not in results:
            results[key] = parity(responses[ref], responses[other])
            print(f"parity {other} vs {ref}: {results[key]}", flush=True)


def run_after_arms(run: BenchRun, model, work, *, results: dict, responses: dict, fidelity, save) -> None:
    """C's speedups, then on C's options: the sweep, the closed-loop levels and the long candidate."""
    from hf_openjev.patches import apply_patches

    args = run.args
    bind_fla(True)
    for arm in ("A", "B"):
        reference = results["arms"].get(arm)
        if "C" in results["arms"] and reference and not reference["parity_only"] and not reference.get("cold"):
            results[f"speedup_C_over_{arm}"] = results["arms"][arm]["mean_ms"] / results["arms"]["C"]["mean_ms"]
    if "C" in run.arms:  # the sweep and the closed loop run arm C as measured (graphs on with --cuda-graphs)
        apply_patches(model, run.c_options)
    if run.sweep_entries:
        run_sweep(model, work, run.sweep_entries, run.c_options, run.fast_options, args=args, arms=run.arms,
                  results=results, responses=responses, fidelity=fidelity, save=save)
    if "C" not in run.arms:
        return
    concurrency = results["closed_loop"] = {}
    for c in [int(x) for x in args.concurrency.split(",") if x]:
        concurrency[str(c)] = closed_loop(model, work, c)
        save()  # after every level, so a run cut short keeps the levels it finished
        print(f"closed loop, {c} in flight: {concurrency[str(c)]['decisions_per_s']:.1f} decisions/s, "
              f"p50 {concurrency[str(c)]['p50_ms']:.1f} ms, p95 {concurrency[str(c)]['p95_ms']:.1f} ms", flush=True)
    save()
    if args.long_candidate:
        results["long_candidate"] = time_single(model, args.long_candidate, repeats=1)
        print(f"long candidate: {results['long_candidate']}", flush=True)


def main(argv=None) -> int:
    run = parse_arguments(argv)
    args = run.args
    problem = check_manifest(args.manifest) if args.manifest is not None else None
    if problem:
        run.parser.error(f"--manifest: {problem}")
    oracle = open_oracle(args, run.parser)  # without --manifest: the oracle's workload
    args.manifest = args.manifest or MANIFEST
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"command": command_line(), "versions": versions(), "shape": args.shape,
               "arms": {}, "seed": args.seed, **manifest_identity(args.manifest)}

    def save():
        (out / f"{bench_stem(args)}.json").write_text(json.dumps(results, indent=1))

    e2e = None
    if args.e2e:  # the requests as text and the tokenizer first: a missing one fails before the model is built
        import bench_e2e

        e2e = bench_e2e.prepare_e2e(bench_e2e.DATA, args.manifest, limit=args.limit)
    t0 = time.perf_counter()
    model = build_model(args.shape, seed=args.seed, device=default_device(), dtype=getattr(torch, args.dtype))
    results["dtype"] = args.dtype
    results["model_build_s"] = time.perf_counter() - t0
    results["weights_gb"] = weights_gb(model)
    work = build_workload(args.manifest, vocab=VOCAB, seed=args.seed, limit=args.limit, max_length=args.max_length)
    results["request_ids"] = [item["id"] for item, _ in work]  # per_request_ms's order (bench_e2e matches by id)
    print(f"model {args.shape} built in {results['model_build_s']:.1f}s, {results['weights_gb']:.1f} GB; "
          f"{len(work)} requests of {args.manifest.name}", flush=True)
    fidelity = start_fidelity(oracle, model, work, args=args, out=out, results=results) if oracle else None
    if oracle and fidelity is None:
        return 2
    results["cuda_graphs"] = args.cuda_graphs
    results["patch_options"] = run.patch_options
    results["fast_options"] = run.fast_options
    responses = {}
    for arm in run.arms:
        run_arm(run, arm, model, work, results=results, responses=responses, fidelity=fidelity)
        save()
    run_after_arms(run, model, work, results=results, responses=responses, fidelity=fidelity, save=save)
    save()
    write_markdown(results, out / f"{bench_stem(args)}.md")
    if e2e is not None:
        seen = [item for item, _ in work] if "B" in results["arms"] else []  # B ran every shape of work here
        bench_e2e.measure_after_bench(model, args.e2e, e2e, bench=results, out=out,
                                      warmup_requests=args.e2e_warmup_requests, stem=bench_stem(args),
                                      seen_items=seen)
    return 0


if __name__ == "__main__":
    sys.exit(main())

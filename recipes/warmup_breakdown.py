"""Where C's warm-up goes (issue 39): the bench's warm-up pass, split into autotuning, Triton compiles and graph
captures.

    python recipes/warmup_breakdown.py --shape 27b --out results/warmup [--requests 231] [--profile]

Runs what ``bench_jevbench.py`` runs as C's warm-up (one pass of the fast path with CUDA graphs over the exact
workload's requests, in order) on the seeded random model, with timing hooks:

- ``autotune``: Triton's autotuner benchmarking configurations for a key it has not seen (fla's kernels); counted per
  kernel; it includes the compiles of the configurations it tries;
- ``compile``: every Triton compile or on-disk cache load (``JITFunction._do_compile``), autotuning's included;
- ``load``: each compiled kernel's first launch (``CompiledKernel._init_handles``: its launcher built, its binary
  loaded onto the device), which no compile hook sees; with ``compile``, also per kernel;
- ``capture`` (``PackGraphs``' own counters, host time): launching the eager forward on the side stream that answers
  each new bucket (where the autotuning, the compiles and cuDNN's plans of a new shape happen), then recording and
  instantiating its graph (until s22 also a first replay, synchronized: runs before then report three phases);
- ``other``: the rest of the pass (plans, layouts, the head, answers; the eager levels that take no graph).

Run it twice in a row on one machine (each a fresh process, the same ``TRITON_CACHE_DIR``): the first run is the
empty kernel cache, the second the warm one. ``--profile`` adds cProfile's top functions by own time (on the GPU
machine, torch 2.11, it put 10.9 s of an 18.8 s pass on the custom ops' ``backend_impl`` line itself, none on the
functions it calls: not a split to act on); ``--op-profile`` adds torch.profiler's host time per op instead (CPU
activity only: aten ops, the ``hf_openjev::`` custom ops, SDPA, each with its own and its children's time), over
the whole pass, the GPU's waits included. ``--record-ops`` times the recordings alone, where nothing waits for the
GPU: each op called at the top level of a recorded forward (a custom op with all it launches, or an aten op), per
graph, and the rest (the modules' Python between ops). Writes ``warmup_<shape>.json`` and ``.md``.

``--compile-threads N`` runs the pass once first inside :func:`hf_openjev.patches.compiling_ahead` (its Triton
kernels compiled N at a time and loaded, not launched; each new bucket's probe run there), timed apart
(its report and ``seconds`` in ``compile_ahead``); the hooked pass after it then records each bucket without a
probe. ``bash recipes/gpu_campaign.sh compile-ab [SHAPE]`` compares it with the plain warm-up on emptied and on warm
kernel caches.

The pass runs inside :func:`hf_openjev.patches.warming_up`, as the bench's C warm-up and the server's do since s26
(captures without answering replays); ``--answered`` runs it answering, as before. ``--measured-pass`` adds one
measured pass after it (answering; the bench's C pass): its mean / p50 / p95 ms and the captures it made (none is
the point of a warm-up).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from benchlib.provenance import command_line, package_relative, versions
from benchlib.random_model import add_model_arguments, prepare_recipe
from benchlib.shapes import VOCAB
from benchlib.timing import run_pass, summarize
from benchlib.workload import add_manifest_argument, build_workload, check_manifest_argument


@contextmanager
def triton_hooks(totals: dict, tuned: Counter):
    """Time Triton's autotuning (per new key), compiles and kernel loads while the block runs, also per kernel
    (``totals["by_kernel"]``); no-op without Triton."""
    try:
        from triton.runtime import autotuner, jit
    except ImportError:
        yield
        return
    saved = []

    def wrap(owner, name, on_call, when=None):
        original = getattr(owner, name, None)
        if original is None:
            totals.setdefault("missing_hooks", []).append(f"{owner.__name__}.{name}")
            return

        def timed(self, *args, **kwargs):
            if when is not None and not when(self):
                return original(self, *args, **kwargs)
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                on_call(self, time.perf_counter() - start)

        saved.append((owner, name, original))
        setattr(owner, name, timed)

    def on_bench(self, seconds):
        totals["autotune_s"] += seconds

    def on_prune(self, seconds):  # called once per key the autotuner has not seen
        tuned[getattr(getattr(self, "fn", None), "__name__", "?")] += 1

    def per_kernel(name: str) -> dict:
        return totals.setdefault("by_kernel", {}).setdefault(
            name, {"compiles": 0, "compile_s": 0.0, "loads": 0, "load_s": 0.0})

    def on_compile(self, seconds):
        totals["compile_s"] += seconds
        totals["compiles"] += 1
        kernel = per_kernel(getattr(getattr(self, "fn", None), "__name__", "?"))
        kernel["compiles"] += 1
        kernel["compile_s"] += seconds

    def on_load(self, seconds):  # a compiled kernel's first launch: its launcher built, its binary loaded
        totals["load_s"] = totals.get("load_s", 0.0) + seconds
        totals["loads"] = totals.get("loads", 0) + 1
        kernel = per_kernel(getattr(self, "name", "?"))
        kernel["loads"] += 1
        kernel["load_s"] += seconds

    wrap(autotuner.Autotuner, "_bench", on_bench)
    wrap(autotuner.Autotuner, "prune_configs", on_prune)
    wrap(jit.JITFunction, "_do_compile", on_compile)
    try:
        from triton.compiler.compiler import CompiledKernel
    except ImportError:
        totals.setdefault("missing_hooks", []).append("CompiledKernel._init_handles")
    else:  # counted only where it does work (Triton returns at once for a kernel already loaded)
        wrap(CompiledKernel, "_init_handles", on_load, when=lambda kernel: getattr(kernel, "module", None) is None)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def kernel_table(by_kernel: dict) -> dict:
    """``by_kernel`` (kernel name: compiles, compile s, loads, load s) rounded, the costliest kernel first."""
    rows = sorted(by_kernel.items(), key=lambda item: -(item[1]["compile_s"] + item[1]["load_s"]))
    return {name: {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()} for name, row in rows}


def find_autotuners(kind: type, prefix: str = "fla.") -> list:
    """Every ``kind`` (an autotuner class) that a module under ``prefix`` holds, also inside the wrappers that
    decorate it (``@triton.heuristics`` over ``@autotune``: each wrapper keeps the next one in ``.fn``), once each."""
    found: dict[int, object] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for value in list(vars(module).values()):
            found.update((id(layer), layer) for layer in wrapper_layers(value) if isinstance(layer, kind))
    return list(found.values())


def wrapper_layers(value, depth: int = 8):
    """``value`` and what it wraps, outermost first: Triton's and fla's kernel decorators (autotuners, heuristics) each
    keep the next layer in ``.fn``; a few layers deep at most."""
    for _ in range(depth):
        if value is None:
            return
        yield value
        value = getattr(value, "fn", None)


class OpTimer:
    """A dispatch mode that sums the host time of each op called at the top level while it is active (ops an op calls
    run below the mode: a custom op's time includes all it does). ``totals``: op name -> [calls, seconds]."""

    def __init__(self):
        self.totals: dict[str, list] = {}

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        totals = self.totals

        class Timing(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                start = time.perf_counter()
                result = func(*args, **(kwargs or {}))
                entry = totals.setdefault(str(func.overloadpacket), [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - start
                return result

        return Timing()


@contextmanager
def timing_recordings(timer: OpTimer, seconds: list):
    """While the block runs, every PackGraphs recording runs under ``timer``'s mode; ``seconds`` gets each
    recording's host time (the mode's own cost included)."""
    from hf_openjev.patches import cuda_graphs

    original = cuda_graphs.recording

    @contextmanager
    def timed(*args, **kwargs):
        with original(*args, **kwargs):
            start = time.perf_counter()
            try:
                with timer.mode():
                    yield
            finally:
                seconds.append(time.perf_counter() - start)

    cuda_graphs.recording = timed
    try:
        yield
    finally:
        cuda_graphs.recording = original


def record_ops_table(timer: OpTimer, seconds: list, top: int = 30) -> tuple[dict, list[str]]:
    """The recordings' host time per op (per graph) and the rest: a JSON-able dict and markdown lines."""
    graphs = max(len(seconds), 1)
    total = sum(seconds)
    ops = sorted(timer.totals.items(), key=lambda item: -item[1][1])
    in_ops = sum(t for _, t in timer.totals.values())
    data = {"graphs": len(seconds), "record_s": round(total, 3), "in_ops_s": round(in_ops, 3),
            "ops": {name: {"calls": calls, "s": round(t, 4)} for name, (calls, t) in ops}}
    lines = ["", f"Recording's host time, {len(seconds)} graphs, {1000 * total / graphs:.1f} ms a graph (under the "
             "timing mode): per op at the top level of the forward", "",
             "| op | calls a graph | ms a graph | us a call |", "|---|---|---|---|"]
    lines += [f"| {name} | {calls / graphs:.0f} | {1000 * t / graphs:.2f} | {1e6 * t / max(calls, 1):.0f} |"
              for name, (calls, t) in ops[:top]]
    lines += [f"| (other ops) | {sum(c for _, (c, _) in ops[top:]) / graphs:.0f} | "
              f"{1000 * sum(t for _, (_, t) in ops[top:]) / graphs:.2f} | |",
              f"| **between ops** (module code) | | {1000 * (total - in_ops) / graphs:.2f} | |"]
    return data, lines


def op_profile():
    """torch.profiler over the host alone (no CUDA activity: the device's kernels are the profiles' business, not
    the warm-up's), ops only: its ``key_averages()`` gives each op's own and total host time."""
    import torch

    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def tuned_fla_configs() -> dict[str, dict]:
    """fla's tuned configurations in this process, in fla's config-file format (``fla.ops.utils.cache``,
    ``FLA_CONFIG_DIR``/<kernel>.json): per kernel of fla's own autotuner (``CachedAutotuner``), every key it tuned and
    the configuration it chose. Kernels under Triton's plain autotuner are left out (fla does not read files for
    them)."""
    import triton
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner

    files: dict[str, dict] = {}
    for tuner in find_autotuners(CachedAutotuner):
        if tuner.cache:
            entries = files.setdefault(tuner.kernel_name, {"kernel_name": tuner.kernel_name,
                                                           "triton_version": triton.__version__,
                                                           "autotune_entries": {}})["autotune_entries"]
            for key, config in tuner.cache.items():
                entries[AutotuneKey.key_hash(key)] = {"autotune_key": AutotuneKey.normalize_autotune_key(key), "config": {
                    "kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
                    "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}}
    return files


def write_fla_configs(folder: Path, files: dict[str, dict]) -> dict[str, int]:
    """Each kernel's file under ``folder`` (created), its entries merged into the file already there (other shapes'
    keys kept, this run's replacing the same keys): runs of several shapes fill one folder. Returns the entries per
    kernel file."""
    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for kernel, data in files.items():
        path = folder / f"{kernel}.json"
        if path.is_file():
            old = json.loads(path.read_text())
            data = {**data, "autotune_entries": {**old.get("autotune_entries", {}), **data["autotune_entries"]}}
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        counts[kernel] = len(data["autotune_entries"])
    return counts


def measured_pass(model, work, graphs) -> dict:
    """One answered pass of the fast path after the warm-up: its times and the captures it made."""
    def captures() -> int:
        return graphs.captures if graphs is not None else 0

    before = captures()
    summary = summarize([t * 1000 for t, _ in run_pass(model, work, fast=True)])
    return {"mean_ms": summary["mean_ms"], "p50_ms": summary["p50_ms"], "p95_ms": summary["p95_ms"],
            "captures": captures() - before}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, shape="27b")
    add_manifest_argument(parser)
    parser.add_argument("--requests", type=int, default=None, help="the first N requests (default: all)")
    parser.add_argument("--profile", action="store_true", help="cProfile the pass: top functions by own time")
    parser.add_argument("--op-profile", action="store_true",
                        help="torch.profiler (CPU activity) over the pass: the host's time per op, top 40 by own time")
    parser.add_argument("--record-ops", action="store_true",
                        help="time each op at the top level of the recordings (host; nothing waits for the GPU there)")
    parser.add_argument("--answered", action="store_true",
                        help="answer the warm-up's packs (replays included), as the warm-up pass did before s26")
    parser.add_argument("--measured-pass", action="store_true",
                        help="then one measured pass (answered): its mean / p50 / p95 ms and the captures it made")
    parser.add_argument("--fast-options", default="{}", help="JSON of FastPathOptions over the shape's defaults")
    parser.add_argument("--capture", choices=("eager", "probe"), default="probe",
                        help="probe (the default, as apply_patches makes it): a capture's first-use run takes only "
                             "patches.cuda_graphs.first_use_layers, and a replay answers the pack; eager: the "
                             "whole forward runs eagerly and answers it (the capture before s25)")
    parser.add_argument("--dump-fla-configs", type=Path, default=None, metavar="DIR",
                        help="after the pass, merge fla's tuned configurations into DIR/<GPU>/<kernel>.json (CUDA; "
                             "DIR ops/fla_configs: the package's carried ones)")
    parser.add_argument("--compile-threads", type=int, default=None, metavar="N",
                        help="first a compile-ahead pass (patches.compiling_ahead): Triton's compiles N at a time, "
                             "timed apart; 0: none; default: the package's (patches.record.COMPILE_THREADS)")
    args = parser.parse_args(argv)
    check_manifest_argument(parser, args)
    if args.compile_threads is not None and args.compile_threads < 0:
        parser.error("--compile-threads: give 0 (none) or more")
    from hf_openjev.family import member_sized
    from hf_openjev.fast_options import options_for
    from hf_openjev.patches import apply_patches, compiling_ahead, patch_record, warming_up

    try:  # over the shape's own defaults
        options = options_for(member_sized(args.shape), json.loads(args.fast_options))
    except ValueError as error:
        parser.error(f"--fast-options: {error}")
    start = time.perf_counter()
    out, device, model = prepare_recipe(args)
    build_s = time.perf_counter() - start
    work = build_workload(args.manifest, vocab=VOCAB, seed=args.seed)[: args.requests]
    apply_patches(model, options)
    graphs = patch_record(model).graphs
    if args.capture == "eager" and graphs is not None:
        graphs.probe_layers = None
    totals = {"autotune_s": 0.0, "compile_s": 0.0, "compiles": 0}
    tuned: Counter = Counter()
    profiler = cProfile.Profile() if args.profile else None
    op_profiler = op_profile() if args.op_profile else contextlib.nullcontext()
    timer, record_seconds = OpTimer(), []
    recordings = timing_recordings(timer, record_seconds) if args.record_ops else contextlib.nullcontext()
    from hf_openjev.patches.record import check_compile_threads

    args.compile_threads = check_compile_threads(args.compile_threads)  # None: the package's default
    ahead = None
    if args.compile_threads:  # before the hooks: the hooked pass's compiles, loads and probes are what it left
        start = time.perf_counter()
        with compiling_ahead(model, args.compile_threads) as report:
            run_pass(model, work, fast=True)
        ahead = {**report, "seconds": round(time.perf_counter() - start, 2)}
    with triton_hooks(totals, tuned), op_profiler as ops, recordings:
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        with contextlib.nullcontext() if args.answered else warming_up(model):
            times = run_pass(model, work, fast=True)
        if profiler:
            profiler.disable()
        warmup_s = time.perf_counter() - start
    stats = graphs.stats() if graphs is not None else {}
    measured = measured_pass(model, work, graphs) if args.measured_pass else None
    requests_s = sum(t for t, _ in times)
    result = {"command": command_line(), "versions": versions(), "shape": args.shape, "device": device,
              "capture": args.capture, "answered": args.answered,
              "triton_cache_dir": bool(os.environ.get("TRITON_CACHE_DIR")), "requests": len(work),
              "build_s": round(build_s, 1), "warmup_s": round(warmup_s, 2), "requests_s": round(requests_s, 2),
              "graphs": stats, "autotune_s": round(totals["autotune_s"], 2),
              "compile_s": round(totals["compile_s"], 2), "compiles": totals["compiles"],
              "load_s": round(totals.get("load_s", 0.0), 2), "loads": totals.get("loads", 0),
              "by_kernel": kernel_table(totals.get("by_kernel", {})),
              "autotuned_keys": dict(tuned.most_common()), "missing_hooks": totals.get("missing_hooks", [])}
    phases = stats.get("capture_phases_s", {})
    result["other_s"] = round(warmup_s - stats.get("capture_s", 0.0), 2)
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        # package-relative file names: no machine's paths in a committed file
        result["profile_top"] = [package_relative(line) for line in text.getvalue().splitlines()[:60]]
    if measured is not None:
        result["measured_pass"] = measured
    if ahead is not None:
        result["compile_ahead"] = ahead
    record_lines = []
    if args.record_ops:
        result["record_ops"], record_lines = record_ops_table(timer, record_seconds)
    if ops is not None:
        table = ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
        result["op_profile_top"] = table.splitlines()
    if args.dump_fla_configs is not None and device == "cuda":
        from fla.ops.utils.cache import get_gpu_info

        folder = args.dump_fla_configs / get_gpu_info()  # e.g. ops/fla_configs/NVIDIA_H200
        result["fla_configs"] = write_fla_configs(folder, tuned_fla_configs())
    (out / f"warmup_{args.shape}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# C's warm-up at {args.shape}: {len(work)} requests", "", f"`{result['command']}`", "",
             "| part | s |", "|---|---|", f"| whole pass | {warmup_s:.1f} |",
             f"| captures ({stats.get('captures', 0)} graphs) | {stats.get('capture_s', 0.0):.1f} |"]
    lines += [f"| - capture: {name} | {seconds:.1f} |" for name, seconds in phases.items()]
    lines += [f"| other (no capture) | {result['other_s']:.1f} |",
              f"| autotuning ({sum(tuned.values())} keys; inside the above) | {totals['autotune_s']:.1f} |",
              f"| Triton compiles / cache loads ({totals['compiles']}; inside the above) | {totals['compile_s']:.1f} |",
              f"| kernel loads: first launches ({result['loads']}; inside the above) | {result['load_s']:.1f} |",
              "", "Autotuned keys per kernel: " + ", ".join(f"{k} {v}" for k, v in tuned.most_common())]
    if result["by_kernel"]:
        lines += ["", "| kernel | compiles | compile s | loads | load s |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {k['compiles']} | {k['compile_s']:.2f} | {k['loads']} | {k['load_s']:.2f} |"
                  for name, k in result["by_kernel"].items()]
    if ahead is not None:
        lines += ["", f"Compile-ahead pass before it: {ahead['seconds']:.1f} s, {ahead['compiles']} compiles "
                      f"({ahead['threads']} threads; the end waited {ahead['compile_wait_s']:.1f} s for them), "
                      f"{ahead['loads']} kernels loaded in {ahead['load_s']:.1f} s, {ahead['untuned']} left untuned, "
                      f"{stats.get('probes_ahead', 0)} probes run ahead, {len(ahead['failures'])} failed",
                  *[f"- {failure}" for failure in ahead["failures"][:10]]]
    if measured is not None:
        lines += ["", f"Measured pass after it (answered): mean {measured['mean_ms']:.1f} / p50 "
                      f"{measured['p50_ms']:.1f} / p95 {measured['p95_ms']:.1f} ms, "
                      f"{measured['captures']} captures during it"]
    lines += record_lines
    (out / f"warmup_{args.shape}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    if profiler:
        print("\n".join(result["profile_top"]))
    if ops is not None:
        print("\n".join(result["op_profile_top"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one fast-path request's time goes: GPU kernels by category, against the wall time with graphs on.

    python recipes/profile_forward.py --shape 27b --tokens 107,3400 --out results/profile
    python recipes/profile_forward.py --shape 27b --tokens "" --requests 0,150 \\
        --fast-options '{}' '{"share_tails": true}' --out results/profile

For each single-candidate request of ``--tokens`` tokens (a noul question, random ids), and each JevBench request
of ``--requests`` (0-based indices into the workload, with the benchmark's token ids), under every pair of
``--patch-options`` and ``--fast-options`` (both FastPathOptions, merged; every request is scored with them):
  1. wall time with CUDA graphs (median of 5 after a capture), as the benchmark times it;
  2. one eager run under ``torch.profiler``: every GPU kernel's duration, summed per kernel and per category
     (GEMM, Gated DeltaNet / conv (fla), attention (flash, cuDNN), elementwise / reductions, copies / indexing, other).
  3. on CUDA, the same profile of a graph-replayed run: the kernels of the padded pack as the graph runs them
     (CUPTI reports kernels a graph launches), so "wall - kernel sum in the graph" is what the host and idle gaps
     add per request, and "kernel sum in the graph - eager kernel sum" what the bucket padding and the GPU's clocks
     under back-to-back load cost; per category too (GEMMs slower in the graph over ~the same tokens: clocks).
     Every kernel of that graph is listed with its launch count: each small one costs its launch gap as well.
``--patch-options`` takes one or more JSON option sets (e.g. '{}' '{"compile_elementwise": true}'), each profiled in
turn on the same model. Writes ``profile_<shape>.json`` and ``.md``. On a machine without CUDA it profiles CPU ops (a smoke run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
from pathlib import Path

import torch
from benchlib.provenance import command_line, versions
from benchlib.random_model import add_model_arguments, prepare_recipe
from benchlib.shapes import VOCAB
from benchlib.timing import sync, time_fast_calls
from benchlib.workload import (
    MANIFEST,
    add_manifest_argument,
    build_workload,
    check_manifest_argument,
    single_candidate_request,
)

SHAPES_FILE = MANIFEST  # the default workload of --requests (--manifest)

CATEGORIES = [  # first match wins; kernel names as CUPTI reports them (FA2's name mentions cutlass: attention first;
    # s5-s8 profiles before this order counted FA2 under gemm)
    ("attention (flash, cuDNN)", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|addmm|linear|aten::b?mm$", re.I)),
    ("gdn / conv (fla)", re.compile(r"chunk|delta|wy|solve_tril|conv1d|l2norm|cumsum|fwd_h|fwd_o|kkt", re.I)),
    ("copies / indexing", re.compile(r"copy|memcpy|memset|cat|index|gather|scatter|fill|arange|select", re.I)),
    ("elementwise / reductions", re.compile(r"elementwise|vectorized|reduce|triton_|pointwise|unrolled|norm|silu|"
                                            r"sigmoid|softplus|exp|mul|add|pow|rsqrt|mean|gates", re.I)),
]


def category(name: str) -> str:
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")


def sum_by_category(kernels: dict[str, float]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for name, ms in kernels.items():
        totals[category(name)] = totals.get(category(name), 0.0) + ms
    return totals


def wall_ms(model, request, options, repeats: int = 5) -> float:
    """Median of ``repeats`` timed calls (with FastPathOptions ``options``) after one that may autotune or
    capture."""
    return statistics.median(time_fast_calls(model, request, calls=1 + repeats, options=options)[1:])


def kernel_times(model, request, options) -> tuple[dict[str, float], dict[str, int], int]:
    """(kernel (CUDA) or op (CPU, self time) -> total ms over one request, -> launches, number of kernels / ops
    run)."""
    from torch.profiler import ProfilerActivity, profile

    from hf_openjev.scoring import score_prepared

    cuda = torch.cuda.is_available()
    score_prepared(model, [request], fast=True, options=options)  # warm: autotuning stays out of the profile
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        score_prepared(model, [request], fast=True, options=options)
        sync()
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    if cuda:
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.name] = totals.get(event.name, 0.0) + event.time_range.elapsed_us() / 1000
                counts[event.name] = counts.get(event.name, 0) + 1
    else:
        for avg in prof.key_averages():
            if avg.self_cpu_time_total > 0 and avg.key.startswith("aten::"):
                totals[avg.key] = avg.self_cpu_time_total / 1000
                counts[avg.key] = avg.count
    return totals, counts, sum(counts.values())


def profile_request(model, label: str, request, options) -> dict:
    """One request with FastPathOptions ``options`` (the model patched with graphs on): graphs, then eagerly."""
    graphed, eager = options.replace(cuda_graphs=True), options.replace(cuda_graphs=False)
    wall = wall_ms(model, request, graphed)
    # the replayed graph's kernels (padded to the shape bucket), as CUPTI reports kernels launched by a graph
    graph_kernels, graph_counts, graph_launches = kernel_times(model, request, graphed) \
        if torch.cuda.is_available() else ({}, {}, 0)
    wall_eager = wall_ms(model, request, eager)
    kernels, counts, launches = kernel_times(model, request, eager)
    by_category = sum_by_category(kernels)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"label": label, "tokens": sum(len(seq) for seq in request.sequences), "wall_graphs_ms": wall,
            "wall_eager_ms": wall_eager, "kernel_sum_ms": sum(kernels.values()), "kernels": launches,
            "graph_kernel_sum_ms": sum(graph_kernels.values()), "graph_kernels": graph_launches,
            "by_category_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
            # the same categories in the replayed graph: GEMMs slower there with the same token count point at
            # clocks under back-to-back load, more elementwise/GDN time at the padded bucket's tokens
            "graph_by_category_ms": sum_by_category(graph_kernels),
            "top_kernels_ms": [{"name": n[:160], "category": category(n), "ms": ms, "launches": counts[n]}
                               for n, ms in top],
            # every kernel of the replayed graph, most launched first: the small ones cost their launch gap too
            "graph_kernel_launches": [{"name": n[:160], "category": category(n), "launches": graph_counts[n],
                                       "ms": graph_kernels[n]}
                                      for n in sorted(graph_counts, key=lambda n: (-graph_counts[n], n))]}


def write_markdown(result: dict, path: Path) -> None:
    unit = "GPU kernels" if result["cuda"] else "CPU ops (smoke run, no CUDA)"
    lines = [f"# Fast-path profile, {result['shape']} shape, {unit}", "", f"Command: `{result['command']}`", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), ""]
    summary = ["| patch options | score_fast options | request | input tokens | wall, graphs (ms) | wall, eager (ms) "
               "| kernel sum (ms) | kernels | kernel sum in the graph (ms) | kernels in the graph |",
               "|---|---|---|---|---|---|---|---|---|---|"]
    details = []
    for variant in result["variants"]:
        options = json.dumps(variant["patch_options"])
        fast = json.dumps(variant["fast_options"])
        for r in variant["requests"]:
            summary.append(f"| `{options}` | `{fast}` | {r['label']} | {r['tokens']} | {r['wall_graphs_ms']:.2f} | "
                           f"{r['wall_eager_ms']:.2f} | {r['kernel_sum_ms']:.2f} | {r.get('kernels', '')} | "
                           f"{r.get('graph_kernel_sum_ms', 0):.2f} | {r.get('graph_kernels', '')} |")
            details += [f"## {r['label']}, patch options `{options}`, score_fast options `{fast}`", "",
                        f"wall with graphs {r['wall_graphs_ms']:.2f} ms; eager {r['wall_eager_ms']:.2f} ms; "
                        f"sum of {unit} (eager run) {r['kernel_sum_ms']:.2f} ms over {r.get('kernels')} launches", "",
                        "| category | ms | share | ms in the graph |",
                        "|---|---|---|---|"]
            in_graph = r.get("graph_by_category_ms", {})
            for c, ms in r["by_category_ms"].items():
                graph_ms = f"{in_graph[c]:.3f}" if c in in_graph else ""
                details.append(f"| {c} | {ms:.3f} | {ms / max(r['kernel_sum_ms'], 1e-9):.0%} | {graph_ms} |")
            details += ["", "| kernel | category | ms | launches |", "|---|---|---|---|"]
            details += [f"| `{k['name']}` | {k['category']} | {k['ms']:.3f} | {k.get('launches', '')} |"
                        for k in r["top_kernels_ms"]]
            if r.get("graph_kernel_launches"):
                details += ["", "Kernels of the replayed graph, most launched first:", "",
                            "| kernel | category | launches | ms |", "|---|---|---|---|"]
                details += [f"| `{k['name']}` | {k['category']} | {k['launches']} | {k['ms']:.3f} |"
                            for k in r["graph_kernel_launches"]]
            details.append("")
    path.write_text("\n".join(lines + summary + [""] + details) + "\n")


def requests_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, object]]:
    """(label, PreparedRequest) for ``--tokens`` (single noul candidates) and ``--requests`` (JevBench workload
    indices of ``--manifest``, the benchmark's token ids); a parser error when there are none, an index is out of
    range or the manifest is unreadable."""
    check_manifest_argument(parser, args)
    targets = [(f"one {n}-token candidate", single_candidate_request(n)) for n in (int(x) for x in args.tokens.split(",") if x)]
    if args.requests:
        work = build_workload(args.manifest, vocab=VOCAB, seed=args.seed)
        for i in (int(x) for x in args.requests.split(",") if x):
            if not 0 <= i < len(work):
                parser.error(f"--requests: {i} is not an index of the {len(work)} JevBench requests")
            item, request = work[i]
            targets.append((f"JevBench request {i} ({item['id']}, {item['kind']}: prefix {item['prefix_tokens']}, "
                            f"suffixes {item['suffix_tokens']})", request))
    if not targets:
        parser.error("nothing to profile: give --tokens and/or --requests")
    return targets


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, shape="27b")
    parser.add_argument("--tokens", default="107,3400", help="single noul candidates of these lengths")
    parser.add_argument("--requests", default="", help="JevBench workload requests, 0-based indices (e.g. 0,150)")
    add_manifest_argument(parser)
    parser.add_argument("--fast-options", nargs="+", default=["{}"],
                        help="JSON of FastPathOptions, e.g. '{\"share_tails\": true}'; several: each is profiled "
                             "in turn with every patch option set")
    parser.add_argument("--patch-options", nargs="+", default=["{}"],
                        help="JSON of FastPathOptions (reported apart); several: each is profiled in turn")
    args = parser.parse_args(argv)
    targets = requests_of(parser, args)
    from hf_openjev.family import member_sized
    from hf_openjev.fast_options import FastPathOptions, options_for
    from hf_openjev.patches import apply_patches

    fast_option_sets = [json.loads(text) for text in args.fast_options]
    variants = []  # (patch options, fast options, the FastPathOptions of both), checked before any work
    for options_json, fast_options in itertools.product(args.patch_options, fast_option_sets):
        patch_options = json.loads(options_json)
        try:
            options = FastPathOptions.from_mapping(fast_options,
                                                   base=options_for(member_sized(args.shape), patch_options))
        except ValueError as error:
            parser.error(f"--patch-options / --fast-options: {error}")
        variants.append((patch_options, fast_options, options))

    out, device, model = prepare_recipe(args)
    cuda = device == "cuda"
    result = {"command": command_line(), "versions": versions(), "shape": args.shape,
              "cuda": cuda, "fast_options": fast_option_sets, "variants": []}
    for patch_options, fast_options, options in variants:
        apply_patches(model, options.replace(cuda_graphs=True))  # on CUDA, the graph cache profile_request replays
        variant = {"patch_options": patch_options, "fast_options": fast_options, "requests": []}
        result["variants"].append(variant)
        for label, request in targets:
            variant["requests"].append(profile_request(model, label, request, options))
            r = variant["requests"][-1]
            print(f"{patch_options} {fast_options} {label}: graphs {r['wall_graphs_ms']:.1f} ms, eager {r['wall_eager_ms']:.1f} "
                  f"ms, kernels {r['kernel_sum_ms']:.1f} ms ({r['kernels']}; in the graph {r['graph_kernel_sum_ms']:.1f} ms, "
                  f"{r['graph_kernels']}): "
                  + ", ".join(f"{c} {ms:.1f}" for c, ms in r["by_category_ms"].items()), flush=True)
            (out / f"profile_{args.shape}.json").write_text(json.dumps(result, indent=1))
            write_markdown(result, out / f"profile_{args.shape}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

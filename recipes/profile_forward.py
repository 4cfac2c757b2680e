"""Where one fast-path request's time goes: GPU kernels by category, against the wall time with graphs on.

    python recipes/profile_forward.py --shape 27b --tokens 107,3400 --out results/profile

For each single-candidate request of ``--tokens`` tokens (a noul question, random ids):
  1. wall time with CUDA graphs (median of 5 after a capture), as the benchmark times it;
  2. one eager run under ``torch.profiler``: every GPU kernel's duration, summed per kernel and per category
     (GEMM, Gated DeltaNet / conv (fla), attention (flash), elementwise / reductions, copies / indexing, other).
The eager kernels are the ones a graph replays, so "wall - GPU sum" estimates what the host adds per request.
``--patch-options`` takes one or more JSON option sets (e.g. '{}' '{"compile_elementwise": true}'), each profiled in
turn on the same model. Writes ``profile_<shape>.json`` and ``.md``. On a machine without CUDA it profiles CPU ops (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_jevbench import add_model_arguments, prepare_recipe, sync, versions  # noqa: E402

CATEGORIES = [  # first match wins; kernel names as CUPTI reports them
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|addmm|linear|aten::b?mm$", re.I)),
    ("attention (flash)", re.compile(r"flash|fmha|attention", re.I)),
    ("gdn / conv (fla)", re.compile(r"chunk|delta|wy|solve_tril|conv1d|l2norm|cumsum|fwd_h|fwd_o|kkt", re.I)),
    ("copies / indexing", re.compile(r"copy|memcpy|memset|cat|index|gather|scatter|fill|arange|select", re.I)),
    ("elementwise / reductions", re.compile(r"elementwise|vectorized|reduce|triton_|pointwise|unrolled|norm|silu|"
                                            r"sigmoid|softplus|exp|mul|add|pow|rsqrt|mean", re.I)),
]


def category(name: str) -> str:
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")


def request_of(tokens: int):
    import random

    from hf_openjev.contract import parse_request
    from hf_openjev.scoring import PreparedRequest

    parsed = parse_request({"state": "x", "questions": {"q": {"type": "noul", "instructions": "x"}}})
    rng = random.Random(tokens)
    return PreparedRequest(parsed, [[[rng.randrange(1000, 248320) for _ in range(tokens)]]])


def wall_ms(model, request, repeats: int = 5) -> float:
    from hf_openjev.scoring import score_prepared

    times = []
    for _ in range(1 + repeats):
        sync()
        start = time.perf_counter()
        score_prepared(model, [request], fast=True)
        sync()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[1:])


def kernel_times(model, request) -> dict[str, float]:
    """Kernel (CUDA) or op (CPU, self time) -> total ms over one eager request."""
    from torch.profiler import ProfilerActivity, profile

    from hf_openjev.scoring import score_prepared

    cuda = torch.cuda.is_available()
    score_prepared(model, [request], fast=True)  # warm: autotuning stays out of the profile
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        score_prepared(model, [request], fast=True)
        sync()
    totals: dict[str, float] = {}
    if cuda:
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.name] = totals.get(event.name, 0.0) + event.time_range.elapsed_us() / 1000
    else:
        for avg in prof.key_averages():
            if avg.self_cpu_time_total > 0 and avg.key.startswith("aten::"):
                totals[avg.key] = avg.self_cpu_time_total / 1000
    return totals


def profile_request(model, tokens: int) -> dict:
    from hf_openjev.patches import apply_patches, patch_record

    options = patch_record(model).options
    request = request_of(tokens)
    apply_patches(model, **{**vars(options), "cuda_graphs": True})
    wall = wall_ms(model, request)
    apply_patches(model, **{**vars(options), "cuda_graphs": False})
    wall_eager = wall_ms(model, request)
    kernels = kernel_times(model, request)
    apply_patches(model, **vars(options))
    by_category: dict[str, float] = {}
    for name, ms in kernels.items():
        by_category[category(name)] = by_category.get(category(name), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"tokens": tokens, "wall_graphs_ms": wall, "wall_eager_ms": wall_eager, "kernel_sum_ms": sum(kernels.values()),
            "by_category_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": [{"name": n[:160], "category": category(n), "ms": ms} for n, ms in top]}


def write_markdown(result: dict, path: Path) -> None:
    unit = "GPU kernels" if result["cuda"] else "CPU ops (smoke run, no CUDA)"
    lines = [f"# Fast-path profile, {result['shape']} shape, {unit}", "", f"Command: `{result['command']}`", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), ""]
    summary = ["| patch options | tokens | wall, graphs (ms) | wall, eager (ms) | kernel sum (ms) |", "|---|---|---|---|---|"]
    details = []
    for variant in result["variants"]:
        options = json.dumps(variant["patch_options"])
        for r in variant["requests"]:
            summary.append(f"| `{options}` | {r['tokens']} | {r['wall_graphs_ms']:.2f} | {r['wall_eager_ms']:.2f} | "
                           f"{r['kernel_sum_ms']:.2f} |")
            details += [f"## one {r['tokens']}-token candidate, patch options `{options}`", "",
                        f"wall with graphs {r['wall_graphs_ms']:.2f} ms; eager {r['wall_eager_ms']:.2f} ms; "
                        f"sum of {unit} (eager run) {r['kernel_sum_ms']:.2f} ms", "", "| category | ms | share |",
                        "|---|---|---|"]
            details += [f"| {c} | {ms:.3f} | {ms / max(r['kernel_sum_ms'], 1e-9):.0%} |"
                        for c, ms in r["by_category_ms"].items()]
            details += ["", "| kernel | category | ms |", "|---|---|---|"]
            details += [f"| `{k['name']}` | {k['category']} | {k['ms']:.3f} |" for k in r["top_kernels_ms"]]
            details.append("")
    path.write_text("\n".join(lines + summary + [""] + details) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, shape="27b")
    parser.add_argument("--tokens", default="107,3400")
    parser.add_argument("--patch-options", nargs="+", default=["{}"],
                        help="JSON of apply_patches options; several: each is profiled in turn")
    args = parser.parse_args(argv)
    from hf_openjev.patches import apply_patches

    out, device, model = prepare_recipe(args)
    cuda = device == "cuda"
    result = {"command": " ".join([sys.executable, *sys.argv]), "versions": versions(), "shape": args.shape,
              "cuda": cuda, "variants": []}
    for options_json in args.patch_options:
        patch_options = json.loads(options_json)
        apply_patches(model, **patch_options)
        variant = {"patch_options": patch_options, "requests": []}
        result["variants"].append(variant)
        for tokens in [int(x) for x in args.tokens.split(",") if x]:
            variant["requests"].append(profile_request(model, tokens))
            r = variant["requests"][-1]
            print(f"{patch_options} {tokens} tokens: graphs {r['wall_graphs_ms']:.1f} ms, eager {r['wall_eager_ms']:.1f} "
                  f"ms, kernels {r['kernel_sum_ms']:.1f} ms: "
                  + ", ".join(f"{c} {ms:.1f}" for c, ms in r["by_category_ms"].items()), flush=True)
            (out / f"profile_{args.shape}.json").write_text(json.dumps(result, indent=1))
            write_markdown(result, out / f"profile_{args.shape}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

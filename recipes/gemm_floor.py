"""The GEMM-only time floor of the 231-request JevBench workload under a plan (no GPU needed).

    python recipes/gemm_floor.py                      # the three sharing policies side by side
    python recipes/gemm_floor.py --out results/floor  # also writes gemm_floor.json and .md
    python recipes/gemm_floor.py --shape 9b --out results/floor  # gemm_floor_9b.json: the 27B's floor scaled
    python recipes/gemm_floor.py --curve gemm_sweep.json  # gemm_sweep.py's JSON (s7's: recipes/RESULTS.md)

Each request of the benchmark's workload (``--manifest``, the same token ids) is planned as the fast path plans it (``plan_requests``, the request alone); each pack costs what
docs/performance.md measured for cuBLAS bf16 GEMMs at the 27B shape, graph-replayed with stacked projections:
``max(13.3 ms, tokens * 293 / 4096 ms)`` (13.3 ms at 107 tokens is weight streaming; 293 ms at 4,096 tokens is
~680 TFLOP/s). Real tokens only: no graph-bucket padding, no other kernel. The sum over a request's packs is its
floor; mean, p50 and p95 (``sorted[int(0.95 N) - 1]``) are over the 231 requests, as the benchmark reports them.

``--curve`` costs each pack with a measured curve instead (``recipes/gemm_sweep.py``'s JSON: one forward's GEMMs
at every 32-row count, graph-replayed): the pack's tokens rounded up to the next measured row count, as the graph
buckets round them (past the curve's end, linear in tokens from its last point).

The last column bounds throughput under any batching across requests: requests share no tokens, so a server
computes at least the plan's tokens per pass over the workload, at no less than the compute-bound GEMM time per
token; decisions (answered questions) per second cannot exceed ``questions / (tokens * 293 / 4096 ms)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchlib.shapes import SHAPES, VOCAB, gemm_weight_count
from benchlib.workload import add_manifest_argument, build_workload, check_manifest_argument

from hf_openjev.packing.planner import plan_requests

STREAMING_MS = 13.3  # one forward's weight streaming (docs/performance.md, 107 tokens)
MS_PER_TOKEN = 293 / 4096  # compute-bound GEMM time per token (docs/performance.md, 4,096 tokens)
POLICIES = {  # name -> plan_requests options
    "no sharing": dict(shared_prefix=False),
    "shared at multiples of 64": dict(share_tails=False, min_shared_tokens=64),
    "exact sharing (share_tails, threshold 32)": dict(share_tails=True, min_shared_tokens=32),
}


def pack_floor_ms(tokens: int, scale: float = 1.0) -> float:
    """One pack's GEMM floor at the 27B shape; ``scale``: another shape's GEMM weights over the 27B's (both terms
    are proportional to the weights a forward streams and multiplies)."""
    return scale * max(STREAMING_MS, tokens * MS_PER_TOKEN)


def shape_scale(shape: str) -> float:
    """``shape``'s projection-GEMM weights over the 27B's (``benchlib.shapes.gemm_weight_count``)."""
    return gemm_weight_count(shape) / gemm_weight_count("27b")


def load_curve(path) -> dict[int, float]:
    """Row count -> ms of one forward's GEMMs, from ``gemm_sweep.py``'s JSON (its first BLAS library)."""
    data = json.loads(Path(path).read_text())
    first = next(iter(data["libraries"].values()))
    return {int(rows): ms for rows, ms in first["ms"].items()}


def curve_pack_ms(curve: dict[int, float], tokens: int) -> float:
    """A pack's GEMM time on a measured curve: the smallest measured row count >= tokens (linear past the end)."""
    rows = sorted(curve)
    at_least = [r for r in rows if r >= tokens]
    return curve[at_least[0]] if at_least else curve[rows[-1]] * tokens / rows[-1]


def workload_floor(requests, pack_ms=pack_floor_ms, *, ms_per_token: float = MS_PER_TOKEN,
                   **plan_options) -> dict:
    """``requests``: token ids ``[q][c]`` per request (the benchmark's workload: ``build_workload(...)[i][1].tokens``)."""
    floors, tokens = [], []
    questions = sum(len(tokens_of_request) for tokens_of_request in requests)
    for tokens_of_request in requests:
        plan = plan_requests([tokens_of_request], **plan_options)
        sizes = [pack.tokens(plan) for pack in plan.packs]
        floors.append(sum(pack_ms(t) for t in sizes))
        tokens.append(sum(sizes))
    ordered = sorted(floors)
    return {"n": len(floors), "mean_ms": statistics.fmean(floors), "p50_ms": statistics.median(floors),
            "p95_ms": ordered[int(0.95 * len(ordered)) - 1], "computed_tokens": sum(tokens),
            "max_decisions_per_s": questions / (sum(tokens) * ms_per_token / 1000)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for gemm_floor.json and gemm_floor.md")
    parser.add_argument("--curve", default=None, help="gemm_sweep.py's JSON: cost packs on that measured curve")
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES),
                        help="without --curve, another shape's floor is the 27B's scaled by its GEMM weights "
                             "(an estimate, not a measurement: measure its curve with gemm_sweep.py --shape)")
    add_manifest_argument(parser)
    args = parser.parse_args(argv)
    check_manifest_argument(parser, args)
    scale = shape_scale(args.shape)
    pack_ms = (lambda tokens: pack_floor_ms(tokens, scale)) if args.shape != "27b" else pack_floor_ms
    cost = f"max({STREAMING_MS} ms, tokens x 293/4096 ms) (docs/performance.md's measured cuBLAS curve)"
    if args.shape != "27b":
        cost += f" x {scale:.4f}, the {args.shape} shape's GEMM weights over the 27B's (an estimate)"
    if args.curve:
        curve = load_curve(args.curve)
        pack_ms, cost = (lambda tokens: curve_pack_ms(curve, tokens)), f"the measured curve of `{args.curve}`"
    requests = [request.tokens for _, request in build_workload(args.manifest, vocab=VOCAB, seed=0)]
    policies = {**POLICIES, "exact sharing (share_tails, threshold 16)": dict(share_tails=True, min_shared_tokens=16)}
    results = {name: workload_floor(requests, pack_ms, ms_per_token=MS_PER_TOKEN * scale, **options)
               for name, options in policies.items()}
    lines = ["| plan | computed tokens | mean ms | p50 ms | p95 ms | max decisions/s, any batching |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {r['computed_tokens']} | {r['mean_ms']:.1f} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | "
              f"{r['max_decisions_per_s']:.1f} |" for name, r in results.items()]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = "gemm_floor" if args.shape == "27b" else f"gemm_floor_{args.shape}"
        title_shape = "" if args.shape == "27b" else f", {args.shape} shape"
        (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
        (out / f"{stem}.md").write_text(
            f"# GEMM-only floor of the JevBench workload by sharing policy{title_shape}\n\n"
            f"Command: `python recipes/gemm_floor.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
            f"Pack cost: {cost}.\n\n"
            + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A forward's GEMM time at every graph-bucket row count: where a bigger bucket is faster than a smaller one.

    python recipes/gemm_sweep.py --out results/gemm_sweep              # CUDA: 32..4096 rows, step 32
    python recipes/gemm_sweep.py --max-rows 256 --out /tmp/sweep       # a shorter sweep
    python recipes/gemm_sweep.py --shape 9b --out results/gemm_sweep   # gemm_sweep_9b.json: the 9B's GEMMs

For each row count M, one CUDA graph holds the bf16 GEMMs of one packed forward at ``--shape`` (27B: 48 Gated
DeltaNet layers (in_proj qkv|z|b|a, out_proj), 16 attention layers (q|k|v, o_proj), 64 MLPs (gate|up, down)) as
the fast path runs them (stacked projections, ``F.linear`` on ``[out, in]`` weights). Two copies of each weight
alternate so that no layer reads a weight the L2 cache still holds. The graph is replayed 1 + ``--repeats`` times;
the fastest timed replay is the figure (a graph's kernels run back to back, as in the fast path's replays).

``--blas cublas,cublaslt`` repeats the sweep with ``torch.backends.cuda.preferred_blas_library`` switched
(coarser rows for the second library: ``--lt-step``). The report lists, per M, the time, TFLOP/s and weight
bytes per second, and the *inversions*: M where some larger bucket within ``--window`` rows is faster by more
than ``--margin`` (a bucket table could then round such packs up). CPU: ``--smoke`` runs a tiny shape eagerly.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from benchlib.provenance import command_line, versions
from benchlib.shapes import SHAPES, gemm_shapes, layer_kinds
from benchlib.tables import save_table

# kind -> (name, out_features, in_features), stacked as the fast path stacks them; the MLP runs in every layer
SHAPES_27B = gemm_shapes("27b")  # any shape of benchlib.shapes: gemm_shapes(name), layer_kinds(name)
SHAPES_SMOKE = {"gdn": [("in", 96, 64), ("out", 64, 48)], "attn": [("qkv", 80, 64), ("o", 64, 32)],
                "mlp": [("up", 256, 64), ("down", 64, 128)]}
LAYERS_27B = layer_kinds("27b")  # 64 layers, every 4th full attention (docs/checkpoints.md)
LAYERS_SMOKE = ["gdn", "gdn", "gdn", "attn"]


def forward_gemms(shapes, layers, weights, inputs) -> None:
    """One forward's GEMMs in layer order; ``weights[name]`` alternates between its two copies layer by layer."""
    for index, kind in enumerate(layers):
        for name, _, k in shapes[kind] + shapes["mlp"]:
            F.linear(inputs[k], weights[name][index % 2])  # [rows, k] @ [n, k]^T


def time_rows(shapes, layers, weights, rows: int, *, device, repeats: int) -> float:
    """Milliseconds of one forward's GEMMs at ``rows`` rows (the fastest of ``repeats`` timed runs)."""
    gen = torch.Generator(device=device).manual_seed(rows)
    widths = {k for group in shapes.values() for _, _, k in group}
    inputs = {k: torch.randn(rows, k, device=device, dtype=torch.bfloat16, generator=gen) for k in widths}
    if device.type != "cuda":
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            forward_gemms(shapes, layers, weights, inputs)
            best = min(best, (time.perf_counter() - start) * 1000)
        return best
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward_gemms(shapes, layers, weights, inputs)  # cuBLAS workspaces and heuristics outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward_gemms(shapes, layers, weights, inputs)
    graph.replay()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def find_inversions(times: dict[int, float], *, window: int, margin: float) -> list[dict]:
    """Row counts M where a larger row count M' <= M + window is faster by more than ``margin`` (fraction)."""
    rows = sorted(times)
    found = []
    for m in rows:
        later = [r for r in rows if m < r <= m + window]
        if not later:
            continue
        best = min(later, key=lambda r: times[r])
        if times[best] < times[m] * (1 - margin):
            found.append({"rows": m, "ms": round(times[m], 3), "faster_rows": best, "faster_ms": round(times[best], 3),
                          "saving": round(1 - times[best] / times[m], 4)})
    return found


def flops_and_bytes(shapes, layers) -> tuple[float, float]:
    """(FLOP per row, weight bytes) of one forward's GEMMs."""
    weights = sum(n * k for kind in layers for _, n, k in shapes[kind] + shapes["mlp"])
    return 2.0 * weights, 2.0 * weights  # bf16: 2 FLOP per weight per row, 2 bytes per weight


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rows", type=int, default=4096)
    parser.add_argument("--step", type=int, default=32)
    parser.add_argument("--lt-step", type=int, default=64, help="row step of the second BLAS library's sweep")
    parser.add_argument("--blas", default="cublas", help="comma-separated: cublas, cublaslt")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--window", type=int, default=128, help="rows ahead an inversion may look")
    parser.add_argument("--margin", type=float, default=0.02)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new row count after this many seconds (what was timed is still written)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU runs)")
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES),
                        help="the model shape whose GEMMs are timed (other than 27b: gemm_sweep_<shape>.json/.md)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("no CUDA device: run with --smoke for a CPU check of this recipe")
    shapes, layers = (SHAPES_SMOKE, LAYERS_SMOKE) if args.smoke else (gemm_shapes(args.shape), layer_kinds(args.shape))
    stem = "gemm_sweep" if args.shape == "27b" else f"gemm_sweep_{args.shape}"
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {name: [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
                      for _ in range(2)] for group in shapes.values() for name, n, k in group}
    flop_per_row, weight_bytes = flops_and_bytes(shapes, layers)
    result = {"command": command_line(), "versions": versions(), "shape": args.shape,
              "shapes": shapes,
              "flop_per_row": flop_per_row, "weight_bytes": weight_bytes, "libraries": {}}
    libraries = [b.strip() for b in args.blas.split(",") if b.strip()]
    begun = time.perf_counter()
    for index, library in enumerate(libraries):
        if device.type == "cuda":
            torch.backends.cuda.preferred_blas_library(library)
        step = args.step if index == 0 else args.lt_step
        times = {}
        started = time.perf_counter()
        for rows in range(step, args.max_rows + 1, step):
            if args.budget_s is not None and time.perf_counter() - begun > args.budget_s:
                break
            times[rows] = time_rows(shapes, layers, weights, rows, device=device, repeats=args.repeats)
        print(f"{library}: {len(times)} row counts in {time.perf_counter() - started:.1f} s", flush=True)
        result["libraries"][library] = {"ms": times, "inversions": find_inversions(times, window=args.window,
                                                                                   margin=args.margin),
                                        "cut_by_budget": bool(times) and max(times) < args.max_rows // step * step}
    if device.type == "cuda":
        torch.backends.cuda.preferred_blas_library("cublas")
    first = result["libraries"][libraries[0]]["ms"]
    rows_out = []
    for rows, ms in first.items():
        cells = [rows, f"{ms:.3f}", f"{flop_per_row * rows / ms / 1e9:.0f}", f"{weight_bytes / ms / 1e9:.2f}"]
        for library in libraries[1:]:
            other = result["libraries"][library]["ms"].get(rows)
            cells.append("" if other is None else f"{other:.3f}")
        rows_out.append(cells)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    columns = ["rows", f"{libraries[0]} ms", "TFLOP/s", "weight TB/s"] + [f"{lib} ms" for lib in libraries[1:]]
    title = f"One forward's GEMMs by row count ({args.shape.upper()} shape, graph-replayed)"
    text = save_table(out, stem, result, title,
                      columns, rows_out)
    inversions = ["", "## Inversions (a larger bucket within the window is faster)", ""]
    for library in libraries:
        found = result["libraries"][library]["inversions"]
        inversions.append(f"- {library}: {len(found)}" + "".join(
            f"\n  - {x['rows']} rows {x['ms']} ms -> {x['faster_rows']} rows {x['faster_ms']} ms "
            f"(-{100 * x['saving']:.1f}%)" for x in found))
    (out / f"{stem}.md").write_text(text + "\n".join(inversions) + "\n")
    print("\n".join(inversions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The skinny GEMM op (``hf_openjev::skinny_linear``) against cuBLAS: one forward's GEMMs and each GEMM shape.

    python3 recipes/skinny_gemm_check.py --out "$OUT/skinny"                   # CUDA: 27B, M = 16..256 step 16
    python3 recipes/skinny_gemm_check.py --shape 9b --out "$OUT/skinny"        # the 9B's GEMMs
    python3 recipes/skinny_gemm_check.py --configs bn64-bk128-s1-w4-p4,bn128-bk64-s2-w8-p3 --out "$OUT/skinny"
    python3 recipes/skinny_gemm_check.py --smoke --out /tmp/skinny             # CPU: tiny shapes, the op's CPU path
    TRITON_INTERPRET=1 python3 recipes/skinny_gemm_check.py --interpret --out /tmp/skinny  # CPU: the Triton kernel
    python3 recipes/skinny_gemm_check.py --compile-only --out /tmp/skinny     # CPU: builds for sm_90a, no GPU

CUDA, for each row count M of ``--rows`` (16..256 step 16):

- *forward*: one CUDA graph holds the bf16 GEMMs of one packed forward at ``--shape`` (27B: 48 Gated DeltaNet
  layers' in_proj and out_proj, 16 attention layers' q|k|v and o_proj, 64 MLPs' gate|up and down, as
  ``recipes/gemm_sweep.py`` builds them), once with ``F.linear`` (cuBLAS) and once with the op; two copies of each
  weight alternate layer by layer so that no layer reads a weight the L2 cache still holds; the figure is the
  median of ``--reps`` replays (after one untimed);
- *per shape*: each distinct (N, K), a graph of ``CALLS`` GEMMs alternating the two copies, cuBLAS and the op
  (and each ``--configs`` configuration, at ``--config-rows``, when its error is within one bf16 unit): median
  replay / CALLS;
- *error*: each shape's output against ``skinny_linear_reference`` (fp32 products and sums, rounded once), as
  max |y - ref| / max |ref|, for the op and for cuBLAS; ``--tol`` (one bf16 unit) bounds the op's.

With ``--configs`` the report ends with the fastest configuration per (M bucket, N, K) where it beats the table's
choice by more than 2%: lines to paste into ``skinny_gemm_configs.OVERRIDES``.

CPU: ``--smoke`` runs tiny shapes through the op's CPU path (the reference) and times them eagerly (a check of
this script, not a measurement); ``--interpret`` runs the Triton kernel under Triton's interpreter (a venv with
triton; never CI's) on small shapes, M in 1, 7, 16, 33, 107, 200, the table's configuration and split-K 1, 2, 4, against the reference. The
interpreter rounds fp32 to bf16 by truncation (measured: every output equals the truncated fp32 sum), so there the
bound is one unit, not half. ``--compile-only`` builds the kernel for Hopper (sm_90a) without a GPU, through
Triton's NVIDIA backend and its bundled ptxas, for the table's configuration of every GEMM shape at every M bucket
(and each ``--configs``): shared memory, registers, stack (spills), wgmma or not, cp.async pipelining or not
(``skinny_gemm_builds.json``/``.md``; exits 1 when a build fails).

Writes ``skinny_gemm[_<shape>].json`` and ``.md`` under --out; exits 1 when an error check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

CALLS = 8  # GEMMs in one per-shape graph
SMOKE_SHAPES = {"gdn": [("in", 96, 64), ("out", 64, 48)], "attn": [("qkv", 80, 64), ("o", 64, 32)],
                "mlp": [("up", 256, 64), ("down", 64, 128)]}
SMOKE_LAYERS = ["gdn", "gdn", "gdn", "attn"]
INTERPRET_ROWS = (1, 7, 16, 33, 107, 200)
INTERPRET_SHAPES = ((96, 64), (320, 512), (144, 256))  # (N, K)
BF16_UNIT = 2.0**-7  # one bf16 unit at the largest |y|, relative


def parse_rows(text: str) -> list[int]:
    """``16:256:16`` (start:stop:step, stop included) or ``1,16,107`` -> row counts."""
    if ":" in text:
        start, stop, step = (int(v) for v in text.split(":"))
        return list(range(start, stop + 1, step))
    return [int(v) for v in text.split(",") if v]


def distinct_shapes(shapes: dict) -> list[tuple[int, int]]:
    """The distinct (N, K) of a model's GEMMs, largest first."""
    found = {(n, k) for group in shapes.values() for _, n, k in group}
    return sorted(found, key=lambda s: (-s[0] * s[1], -s[0]))


def forward_gemms(linear, shapes, layers, weights, inputs) -> None:
    """One forward's GEMMs in layer order with ``linear(x, w)``; ``weights[(n, k)]`` alternates its two copies."""
    for index, kind in enumerate(layers):
        for _, n, k in shapes[kind] + shapes["mlp"]:
            linear(inputs[k], weights[(n, k)][index % 2])


def median_ms(run, device: torch.device, reps: int) -> float:
    """Median milliseconds of ``run()``: on CUDA replays of a graph of it (captured after a warm-up on a side
    stream, one untimed replay), on the CPU eager calls."""
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # builds, cuBLAS workspaces and heuristics outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref| in fp32 (inf when y holds a NaN or inf)."""
    if not torch.isfinite(y).all():
        return float("inf")
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def shape_row(m: int, n: int, k: int, weights, inputs, device, reps: int, configs: list) -> dict:
    """One (M, N, K): the op's and cuBLAS's error against the reference, and their per-GEMM times (and each
    configuration's, ``configs``: SkinnyConfig list, on CUDA)."""
    from hf_openjev.ops.skinny_gemm_configs import choose_config
    from hf_openjev.ops.skinny_linear import skinny_linear_reference

    op = torch.ops.hf_openjev.skinny_linear
    x, pair = inputs[k][:m], weights[(n, k)]
    ref = skinny_linear_reference(x, pair[0])
    row = dict(rows=m, n=n, k=k, config=choose_config(m, n, k).name, op_rel=relative_error(op(x, pair[0]), ref),
               cublas_rel=relative_error(F.linear(x, pair[0]), ref))

    def calls(linear):
        return lambda: [linear(x, pair[i % 2]) for i in range(CALLS)]

    row["cublas_us"] = 1000 * median_ms(calls(F.linear), device, reps) / CALLS
    row["op_us"] = 1000 * median_ms(calls(op), device, reps) / CALLS
    if configs:
        from hf_openjev.ops.skinny_gemm_triton import skinny_gemm

        row["configs_us"] = {}
        for config in configs:
            try:
                rel = relative_error(skinny_gemm(x, pair[0], config), ref)
            except ValueError as error:  # a configuration this shape cannot take (K split, shared memory)
                row["configs_us"][config.name] = str(error)
                continue
            if rel > BF16_UNIT:  # never suggested: the time of a wrong result is no figure
                row["configs_us"][config.name] = f"wrong: max err / max ref {rel:.2e}"
                continue
            row["configs_us"][config.name] = 1000 * median_ms(
                calls(lambda a, b, c=config: skinny_gemm(a, b, c)), device, reps) / CALLS
    return row


def best_overrides(per_shape: list[dict], margin: float = 0.02) -> list[str]:
    """``OVERRIDES`` lines: per (M bucket, N, K), the fastest timed configuration where it beats the op's own
    (the table's) time by more than ``margin``; the first row count of a bucket speaks for it."""
    from hf_openjev.ops.skinny_gemm_configs import block_m_for

    lines, seen = [], set()
    for row in per_shape:
        timed = {name: us for name, us in row.get("configs_us", {}).items() if isinstance(us, float)}
        key = (block_m_for(row["rows"]), row["n"], row["k"])
        if not timed or key in seen:
            continue
        seen.add(key)
        name, us = min(timed.items(), key=lambda item: item[1])
        if us < row["op_us"] * (1 - margin):
            lines.append(f"    {key}: parse_config(\"{name}\"),  # {us:.1f} us vs {row['op_us']:.1f} "
                         f"({row['config']}), cuBLAS {row['cublas_us']:.1f}")
    return lines


def markdown(result: dict) -> str:
    """The report: the forward table, the per-shape table, the error verdict, the suggested overrides."""
    lines = [f"# Skinny GEMM op against cuBLAS ({result['shape']}, {result['device']})", "",
             f"Command: `{result['command']}`", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), "",
             f"Weights of one forward's GEMMs: {result['weight_bytes'] / 1e9:.2f} GB", ""]
    if result["forward"]:
        lines += ["## One forward's GEMMs (graph-replayed, median)", "",
                  "| rows | cuBLAS ms | op ms | op / cuBLAS | cuBLAS TB/s | op TB/s |", "|---|---|---|---|---|---|"]
        for row in result["forward"]:
            lines.append(f"| {row['rows']} | {row['cublas_ms']:.3f} | {row['op_ms']:.3f} | "
                         f"{row['op_ms'] / row['cublas_ms']:.3f} | {result['weight_bytes'] / row['cublas_ms'] / 1e9:.2f}"
                         f" | {result['weight_bytes'] / row['op_ms'] / 1e9:.2f} |")
        lines.append("")
    names = sorted({name for row in result["per_shape"] for name in row.get("configs_us", {})})
    lines += ["## Per GEMM (us a call) and error against the fp32 reference (max |err| / max |ref|)", "",
              "| rows | N | K | config | cuBLAS us | op us | op err | cuBLAS err |" + "".join(f" {n} |" for n in names),
              "|" + "---|" * (8 + len(names))]
    for row in result["per_shape"]:
        cells = [row["rows"], row["n"], row["k"], row["config"], f"{row['cublas_us']:.1f}", f"{row['op_us']:.1f}",
                 f"{row['op_rel']:.2e}", f"{row['cublas_rel']:.2e}"]
        timed = row.get("configs_us", {})
        cells += [f"{timed[n]:.1f}" if isinstance(timed.get(n), float) else timed[n].partition(":")[0]
                  if str(timed.get(n)).startswith("wrong") else "refused" if n in timed else "" for n in names]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", f"Errors: {'all within' if result['ok'] else 'SOME OVER'} the bound {result['tol']:.2e}"]
    if result.get("overrides"):
        lines += ["", "## Faster configurations (for skinny_gemm_configs.OVERRIDES)", "", "```",
                  *result["overrides"], "```"]
    return "\n".join(lines) + "\n"


def run_interpret(out: Path) -> int:
    """The Triton kernel under the interpreter (CPU), small shapes, bf16 and fp16: the table's configuration and
    block_n 32, block_k 32 with split-K 1, 2 and 4."""
    from hf_openjev.ops.skinny_gemm_configs import SkinnyConfig, choose_config
    from hf_openjev.ops.skinny_gemm_triton import skinny_gemm
    from hf_openjev.ops.skinny_linear import skinny_linear_reference

    rows, ok = [], True
    for dtype in (torch.bfloat16, torch.float16):
        for n, k in INTERPRET_SHAPES:
            for m in INTERPRET_ROWS:
                gen = torch.Generator().manual_seed(m * n + k)
                x = torch.randn(m, k, generator=gen).to(dtype)
                w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
                ref = skinny_linear_reference(x, w)
                for config in [choose_config(m, n, k)] + [SkinnyConfig(32, 32, s, 4, 2) for s in (1, 2, 4)]:
                    if k % (config.split_k * config.block_k):
                        continue
                    rel = relative_error(skinny_gemm(x, w, config), ref)
                    good = rel <= (BF16_UNIT if dtype == torch.bfloat16 else 2.0**-10)
                    ok &= good
                    rows.append(dict(dtype=str(dtype).removeprefix("torch."), rows=m, n=n, k=k, config=config.name,
                                     rel=rel, ok=good))
    out.mkdir(parents=True, exist_ok=True)
    from benchlib.provenance import command_line, versions
    from benchlib.tables import save_table

    result = dict(command=command_line(), versions=versions(), interpret=rows, ok=ok)
    save_table(out, "skinny_gemm_interpret", result, "Skinny GEMM under Triton's interpreter (CPU) against the "
               "reference", ["dtype", "rows", "N", "K", "config", "max err / max ref", "ok"],
               [[r["dtype"], r["rows"], r["n"], r["k"], r["config"], f"{r['rel']:.2e}", r["ok"]] for r in rows])
    print(f"{len(rows)} interpreter checks, worst {max(r['rel'] for r in rows):.2e}, ok={ok}")
    return 0 if ok else 1


def compile_for_hopper(config, block_m: int, k: int) -> dict:
    """Build the kernel for sm_90a on this machine (no GPU): the launch's signature with the divisibility-by-16
    the JIT would see (pointers, N, the row strides), bf16 in, y bf16 (fp32 partial sums with split-K)."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_openjev.ops.skinny_gemm_triton import _skinny_gemm_kernel

    signature = {"X": "*bf16", "W": "*bf16", "Y": "*fp32" if config.split_k > 1 else "*bf16", "M": "i32", "N": "i32",
                 "stride_xm": "i32", "stride_wn": "i32", "K_SPLIT": "constexpr", "BLOCK_M": "constexpr",
                 "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "UPCAST": "constexpr"}
    constants = dict(K_SPLIT=k // config.split_k, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                     UPCAST=False)
    source = ASTSource(fn=_skinny_gemm_kernel, signature=signature, constexprs=constants,
                       attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 4, 5, 6)})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    ptx = kernel.asm["ptx"]
    row = dict(smem=kernel.metadata.shared, wgmma="wgmma" in ptx, pipelined="cp.async" in ptx, regs=None, stack=None)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True).stdout
    for key, name in (("regs", "REG"), ("stack", "STACK")):
        found = [int(line.split(f"{name}:")[1].split()[0]) for line in usage.split() if line.startswith(f"{name}:")]
        row[key] = found[0] if found else None
    return row


def run_compile_only(args, shapes, out: Path) -> int:
    """Every GEMM shape at every M bucket: the table's configuration (and each --configs one) built for sm_90a."""
    from benchlib.provenance import command_line, versions
    from benchlib.tables import save_table

    from hf_openjev.ops.skinny_gemm_configs import BUCKETS, check_config, choose_config, parse_config

    extra = [parse_config(c) for c in args.configs.split(",") if c]
    rows, ok = [], True
    for block_m in sorted(BUCKETS):
        for n, k in distinct_shapes(shapes):
            for config in [choose_config(block_m, n, k)] + extra:
                row = dict(block_m=block_m, n=n, k=k, config=config.name)
                try:
                    check_config(config, block_m, k)
                    row.update(compile_for_hopper(config, block_m, k))
                except Exception as error:  # noqa: BLE001  (a failed build is a row, the next one goes on)
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                    ok &= not config == choose_config(block_m, n, k)  # only the table's own must build
                rows.append(row)
                print(row, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(command=command_line(), versions=versions(), shape=args.shape, builds=rows, ok=ok)
    save_table(out, "skinny_gemm_builds", result, f"Skinny GEMM builds for sm_90a ({args.shape}, no GPU)",
               ["BLOCK_M", "N", "K", "config", "smem", "regs", "stack", "wgmma", "pipelined", "error"],
               [[r["block_m"], r["n"], r["k"], r["config"], r.get("smem"), r.get("regs"), r.get("stack"),
                 r.get("wgmma"), r.get("pipelined"), r.get("error", "")] for r in rows])
    return 0 if ok else 1


def build_weights(shapes, device, seed: int = 0) -> dict:
    """(N, K) -> two bf16 copies of a [N, K] weight (scaled like a trained layer's)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return {(n, k): [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(2)]
            for n, k in distinct_shapes(shapes)}


def measure(args, shapes, layers, device) -> dict:
    """The forward and per-shape rows of every row count (see the module's docstring)."""
    from hf_openjev.ops.skinny_gemm_configs import parse_config

    weights = build_weights(shapes, device)
    gen = torch.Generator(device=device).manual_seed(1)
    top = max(args.rows)
    inputs = {k: torch.randn(top, k, device=device, dtype=torch.bfloat16, generator=gen) for _, k in weights}
    configs = [parse_config(c) for c in args.configs.split(",") if c]
    forward, per_shape = [], []
    for m in args.rows:
        rows_in = {k: v[:m] for k, v in inputs.items()}
        cublas = median_ms(lambda: forward_gemms(F.linear, shapes, layers, weights, rows_in), device, args.reps)
        op = median_ms(lambda: forward_gemms(torch.ops.hf_openjev.skinny_linear, shapes, layers, weights, rows_in),
                       device, args.reps)
        forward.append(dict(rows=m, cublas_ms=cublas, op_ms=op))
        timed = configs if device.type == "cuda" and m in args.config_rows else []
        for n, k in weights:
            per_shape.append(shape_row(m, n, k, weights, inputs, device, args.reps, timed))
        print(f"M={m}: forward cuBLAS {cublas:.3f} ms, op {op:.3f} ms", flush=True)
    return dict(forward=forward, per_shape=per_shape)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="27b", help="a shape of recipes/benchlib/shapes.py (27b, 9b, 2b, ...)")
    parser.add_argument("--rows", type=parse_rows, default=None, help="16:256:16 (default) or a list: 16,107")
    parser.add_argument("--reps", type=int, default=20, help="timed replays (median)")
    parser.add_argument("--configs", default="", help="comma-separated configurations to time per shape, "
                        "bn<block_n>-bk<block_k>-s<split_k>-w<warps>-p<stages>")
    parser.add_argument("--config-rows", type=parse_rows, default=parse_rows("16,64,128,256"),
                        help="row counts at which --configs are timed")
    parser.add_argument("--tol", type=float, default=BF16_UNIT, help="bound of the op's max err / max |ref|")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes through the op's CPU path")
    parser.add_argument("--interpret", action="store_true", help="the Triton kernel under the interpreter (CPU)")
    parser.add_argument("--compile-only", action="store_true", help="build for sm_90a on this machine (no GPU)")
    parser.add_argument("--out", required=True)
    return parser, parser.parse_args(argv)


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    out = Path(args.out)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        return run_interpret(out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not (args.smoke or args.compile_only):
        parser.error("no CUDA device: run with --smoke (the op's CPU path) or --interpret (the Triton kernel)")
    from benchlib.provenance import command_line, versions
    from benchlib.shapes import gemm_shapes, layer_kinds

    import hf_openjev.ops  # noqa: F401  (registers the op)

    if args.compile_only:
        return run_compile_only(args, SMOKE_SHAPES if args.smoke else gemm_shapes(args.shape), out)

    shapes, layers = (SMOKE_SHAPES, SMOKE_LAYERS) if args.smoke else (gemm_shapes(args.shape), layer_kinds(args.shape))
    args.rows = args.rows or (parse_rows("16:64:16") if args.smoke else parse_rows("16:256:16"))
    weight_bytes = 2.0 * sum(n * k for kind in layers for _, n, k in shapes[kind] + shapes["mlp"])
    result = dict(command=command_line(), versions=versions(), shape="smoke" if args.smoke else args.shape,
                  device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", tol=args.tol,
                  weight_bytes=weight_bytes, **measure(args, shapes, layers, device))
    result["ok"] = all(row["op_rel"] <= args.tol for row in result["per_shape"])
    result["overrides"] = best_overrides(result["per_shape"])
    out.mkdir(parents=True, exist_ok=True)
    stem = "skinny_gemm" if result["shape"] == "27b" else f"skinny_gemm_{result['shape']}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / f"{stem}.md").write_text(text)
    print(text[text.index("## "):])
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

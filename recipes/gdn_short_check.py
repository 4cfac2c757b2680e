"""Check (and, on a GPU, time) the short-sequence GDN kernels against the fp32 reference and fla's chunks.

    python3 recipes/gdn_short_check.py --out "$OUT/gdn"                       # CUDA: accuracy + graph-replayed timing
    TRITON_INTERPRET=1 python3 recipes/gdn_short_check.py --out /tmp/gdn      # CPU: Triton's interpreter, small shapes

CUDA (torch + triton + fla-core 0.6): every variant (``--variants``: ``wy-bv<block_v>-w<num_warps>-p<prep_warps>-
s<num_stages>-<precision>`` for the two-launch kernels of ``gdn_wy_triton.py``, ``bv<block_v>-c<chunk>-w<num_warps>-<precision>``
for the one-launch v1 of ``gdn_short_triton.py``) and the op ``hf_openjev::gdn_prefill_short`` (its defaults) against ``gdn_prefill_reference`` (fp32, on the host)
and the chunked ``hf_openjev::gdn_prefill`` (fla) at the 27B GDN shape (16 key heads, 48 value heads, dims 128),
bf16 and fp32, lengths 1, 2, 63, 64, 65, 107, 200 packed, initial state on and None; then each captured in a CUDA
graph (the chunked op with its precomputed chunk offsets), its replay checked against eager and timed (median of
CUDA-event replays) at 1 x 107, 5 x 40, 6 x 60, 16 x 64, 1 x 256, 5 x 100, 1 x 512 (``--batches``).

CPU (no CUDA; ``TRITON_INTERPRET=1`` is set here before triton loads): the same accuracy check at Hk=2, Hv=6,
Dk=Dv=32 on CPU tensors; slow, so run it with ``nice`` in a separate venv holding torch, triton and numpy. The
interpreter computes bf16 ``tl.dot`` wrongly, so there the Gram matrices of bf16 inputs are upcast (the kernels'
``native_gram`` off); the GPU runs them natively.

Both devices also check the two-launch prep's blocked 64 x 64 solve (``invert_unit_lower``) against
``torch.linalg.solve_triangular`` on systems built like the kernel's (beta k k^T decay, k L2-normalised).

On CUDA every part (the solve check, the op, each variant) runs in a process of its own (this script with
``--part``, its files under --out/parts/<name>), so a variant that faults the device (an illegal memory access
poisons the CUDA context for the rest of the process) or fails to build is recorded as a failed row with its
error, and the next part goes on; ``--part-timeout`` bounds each.

Writes ``gdn_short.json`` and ``gdn_short.md`` under --out (after each part); exits 1 when an accuracy, solve
or replay check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from gpu_ops_check import graph_of, median_ms

from hf_openjev.ops._checks import capture_replay, gdn_inputs, max_errors, to_device
from hf_openjev.ops.gdn_prefill import gdn_prefill_reference
from hf_openjev.ops.gdn_short_limits import check_short_shapes
from hf_openjev.ops.varlen import prepare_varlen_metadata

OPS = torch.ops.hf_openjev
SHAPES = {"gpu": (16, 48, 128, 128), "interpret": (2, 6, 32, 32)}
ODD = [1, 2, 63, 64, 65, 107, 200]
INTERPRET_CASES = [[1, 2, 63], [64, 65], [107], [200], [5, 0, 40]]  # the interpreter is slow: one case at a time
BATCHES = "1x107,5x40,6x60,16x64,1x256,5x100,1x512"
# the op itself runs wy-bv32-w8-p8-s1-tf32x3 (gdn_prefill_short's defaults); three more keep one call short (each
# variant compiles in a process of its own); s3 builds exceed the H200's shared memory
VARIANTS = "wy-bv32-w8-p8-s1-ieee,wy-bv32-w8-p8-s1-bf16x3,bv32-c16-w4-tf32"
INTERPRET_VARIANTS = "wy-bv16-w4-p4-s1-ieee,bv16-c16-w4-ieee"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # max |err| / max |ref| against the fp32 reference
NAMES = ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state")
NAN = float("nan")


def parse_variant(name: str) -> dict:
    """``bv32-c16-w4-ieee`` -> dict(block_v=32, chunk=16, num_warps=4, precision="ieee") (one launch, v1);
    ``wy-bv32-w4-p8-s1-tf32x3`` -> dict(design="wy", block_v=32, chunk=64, num_warps=4, prep_warps=8,
    num_stages=1, precision="tf32x3") (two launches)."""
    if name.startswith("wy-"):
        parts = name.split("-")
        if len(parts) != 6 or [p[:1] for p in parts[1:5]] != ["b", "w", "p", "s"] or not parts[1].startswith("bv"):
            raise ValueError(f"variant {name!r}: write it as wy-bv<block_v>-w<num_warps>-p<prep_warps>-s<num_stages>-"
                             "<precision>")
        return dict(design="wy", block_v=int(parts[1][2:]), chunk=64, num_warps=int(parts[2][1:]),
                    prep_warps=int(parts[3][1:]), num_stages=int(parts[4][1:]), precision=parts[5])
    bv, c, w, precision = name.split("-")
    if not (bv.startswith("bv") and c.startswith("c") and w.startswith("w")):
        raise ValueError(f"variant {name!r}: write it as bv<block_v>-c<chunk>-w<num_warps>-<precision>")
    return dict(block_v=int(bv[2:]), chunk=int(c[1:]), num_warps=int(w[1:]), precision=precision)


def kernel_of(variant: str | None):
    """A callable with the op's keyword arguments: the op itself (None) or ``gdn_short_forward`` with a variant."""
    if variant is None:
        return OPS.gdn_prefill_short
    options = parse_variant(variant)
    if options.pop("design", None) == "wy":
        from hf_openjev.ops.gdn_wy_triton import gdn_wy_forward as forward

        del options["chunk"]
    else:
        from hf_openjev.ops.gdn_short_triton import gdn_short_forward as forward

    def run(**args):
        return forward(*(args[n] for n in NAMES), args.get("output_final_state", True), **options)

    return run


def accuracy_rows(variants: list[str | None], device: str, dtypes) -> list[dict]:
    shape = SHAPES["gpu" if device == "cuda" else "interpret"]
    cases = [ODD] if device == "cuda" else INTERPRET_CASES
    rows = []
    for lengths in cases:
        for dtype in dtypes:
            for state in (False, True):
                args = gdn_inputs(lengths, *shape, dtype=dtype, state=state, seed=len(lengths))
                o_ref, s_ref = gdn_prefill_reference(**args)
                chunked = OPS.gdn_prefill(**to_device(args, device)) if device == "cuda" else None
                kernel_args = {**to_device(args, device), **({} if state else {"initial_state": None})}
                for variant in variants:
                    row = dict(kernel=variant or "op", lengths=lengths, dtype=str(dtype).split(".")[-1], state=state)
                    row.update(check_variant(variant, kernel_args, (o_ref, s_ref), chunked, TOL[dtype]))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def check_variant(variant: str | None, kernel_args: dict, reference, chunked, tol: float) -> dict:
    """One run of a kernel against the reference (and the chunked op's results): errors, ok, seconds; a kernel
    that fails to build or run gives ok False and its error, and the other variants still run."""
    started = time.perf_counter()
    try:
        out = kernel_of(variant)(**kernel_args)
    except Exception as exc:  # noqa: BLE001 (a variant that does not compile must not end the GPU call)
        return dict(o_abs=NAN, o_rel=NAN, s_abs=NAN, s_rel=NAN, ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
    (o_abs, o_rel), (s_abs, s_rel) = max_errors(out[0], reference[0]), max_errors(out[1], reference[1])
    finite = bool(out[0].float().isfinite().all() and out[1].isfinite().all())
    row = dict(o_abs=o_abs, o_rel=o_rel, s_abs=s_abs, s_rel=s_rel, ok=finite and max(o_rel, s_rel) < tol,
               seconds=time.perf_counter() - started)
    if chunked is not None:
        row["vs_chunked_o_rel"] = max_errors(out[0], chunked[0])[1]
        row["vs_chunked_s_rel"] = max_errors(out[1], chunked[1])[1]
    return row


def solve_system(case: str, dk: int, seed: int) -> torch.Tensor:
    """A strictly lower [64, 64] system as the prep kernel builds it: beta_i (k_i . k_j) exp(gc_i - gc_j) with k
    L2-normalised; "random": the recipe's inputs; "close": near-parallel keys, beta 1, no decay (entries near 1)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(64, dk, generator=gen)
    beta, g = torch.sigmoid(torch.randn(64, generator=gen)), -torch.nn.functional.softplus(torch.randn(64, generator=gen))
    if case == "close":
        k, beta, g = k[:1] + 0.3 * k, torch.ones(64), torch.zeros(64)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    gc = g.cumsum(0)
    return (beta[:, None] * (k @ k.T) * (gc[:, None] - gc[None, :]).exp()).tril(-1)


def solve_rows(device: str) -> list[dict]:
    """The prep kernel's blocked solve (``invert_unit_lower``) against ``torch.linalg.solve_triangular`` (fp64)."""
    from hf_openjev.ops.gdn_wy_triton import invert_unit_lower

    rows = []
    for case in ("random", "close"):
        for seed in range(3):
            a = solve_system(case, 32, seed)
            ref = torch.linalg.solve_triangular(torch.eye(64, dtype=torch.float64) + a.double(),
                                                torch.eye(64, dtype=torch.float64), upper=False, unitriangular=True)
            for precision in ("ieee", "tf32x3") if device == "cuda" else ("ieee",):
                inverse = invert_unit_lower(a.to(device), precision).cpu().double()
                rel = float((inverse - ref).abs().max() / ref.abs().max())
                rows.append(dict(case=case, seed=seed, precision=precision, rel=rel, ok=rel < 1e-4))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def batch_args(n: int, length: int, seed: int) -> dict:
    args = to_device(gdn_inputs([length] * n, *SHAPES["gpu"], dtype=torch.bfloat16, state=True, seed=seed), "cuda")
    meta = prepare_varlen_metadata([length * i for i in range(n + 1)], device="cuda")
    return {**args, "chunk_offsets": meta.chunk_offsets}


def timing_rows(variants: list[str | None], batches: list[tuple[int, int]], reps: int,
                with_chunked: bool = True) -> list[dict]:
    """Per batch: the chunked op (``with_chunked``) and each variant captured in a CUDA graph and timed (median
    replay); for the kernels also a capture with other data copied in, whose replay must equal eager bit for
    bit."""
    rows = []
    for n, length in batches:
        args, other = batch_args(n, length, seed=1), batch_args(n, length, seed=2)
        row = dict(batch=f"{n}x{length}", sequences=n, length=length)
        chunked = [("chunked", OPS.gdn_prefill)] if with_chunked else []
        for name, fn in [*chunked, *((v or "op", kernel_of(v)) for v in variants)]:
            keep = (lambda a: a) if name == "chunked" else (lambda a: {k: v for k, v in a.items() if k != "chunk_offsets"})
            graph = graph_of(fn, keep(args))
            row[f"{name}_us"] = 1000 * median_ms(graph.replay, reps)
            del graph
            if name != "chunked":
                replayed, eager = capture_replay(fn, keep(args), keep(other))
                row[f"{name}_replay_ok"] = max_errors(replayed, eager)[0] == 0.0
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def markdown(result: dict) -> str:
    lines = [f"# gdn_prefill_short check ({result['device']})", "", f"versions: {result['versions']}", "",
             "## Accuracy (max |err| / max |ref| vs the fp32 reference; vs the chunked op where run)", "",
             "| kernel | lengths | dtype | state | o rel | state rel | vs chunked o | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in result["accuracy"]:
        lines.append(f"| {r['kernel']} | {r['lengths']} | {r['dtype']} | {r['state']} | {r['o_rel']:.2e} | "
                     f"{r['s_rel']:.2e} | {r.get('vs_chunked_o_rel', float('nan')):.2e} | {r['ok']} |")
    errors = {r.get("kernel", "solve"): r["error"] for r in result["accuracy"] + result.get("solve", []) if "error" in r}
    if errors:
        lines += ["", "## Kernels that failed to build or run", ""] + [f"- {k}: `{e}`" for k, e in errors.items()]
    if result.get("solve"):
        lines += ["", "## Blocked 64 x 64 solve vs torch.linalg.solve_triangular (fp64; max |err| / max |ref|)", "",
                  "| system | seed | precision | rel | ok |", "|---|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['seed']} | {r['precision']} | {r['rel']:.2e} | {r['ok']} |" for r in result["solve"]]
    if result["timing"]:
        names = list(dict.fromkeys(k[:-3] for r in result["timing"] for k in r if k.endswith("_us")))
        lines += ["", "## Graph-replayed time per call (us, median), bf16, 27B shape", "",
                  "| batch | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for r in result["timing"]:
            lines.append(f"| {r['batch']} | " + " | ".join(f"{r.get(n + '_us', NAN):.1f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def isolated_part(part: str, opts, out: Path) -> dict:
    """One part ("solve", "op" or a variant name) run by this script in a child process (``--part``), so that a
    CUDA fault or a failed build ends only that process: its results, or rows saying how it died."""
    result_file = out / "part.json"
    result_file.unlink(missing_ok=True)
    try:
        done = subprocess.run(part_command(part, opts, out), capture_output=True, text=True,
                              timeout=opts.part_timeout)
    except subprocess.TimeoutExpired:
        done = subprocess.CompletedProcess((), "timeout", "", f"ran over --part-timeout {opts.part_timeout} s")
    sys.stdout.write(done.stdout)
    if done.returncode == 0 and result_file.exists():
        return json.loads(result_file.read_text())
    lines = done.stderr.strip().splitlines() or ["no output"]
    cause = next((line for line in reversed(lines) if "Error" in line), lines[-1])
    error = f"child process exit {done.returncode}: {cause}"[:500]
    if part == "solve":
        return dict(solve=[dict(case="-", seed=-1, precision="-", rel=NAN, ok=False, error=error)])
    return dict(accuracy=[dict(kernel=part, lengths=ODD, dtype="-", state="-", o_abs=NAN, o_rel=NAN, s_abs=NAN,
                               s_rel=NAN, ok=False, error=error)], timing=[])


def part_command(part: str, opts, out: Path) -> list[str]:
    """The command line of a child running one part, its results in ``out``."""
    return [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--part", part,
            "--batches", opts.batches, "--reps", str(opts.reps), *(["--no-timing"] if opts.no_timing else [])]


def merge_timing(rows: list[dict], new: list[dict]) -> list[dict]:
    """Timing rows of several parts joined per batch (columns side by side, in the order the parts ran)."""
    by_batch = {r["batch"]: r for r in rows}
    for r in new:
        by_batch.setdefault(r["batch"], {}).update(r)
    return list(by_batch.values())


def run_part(part: str, device: str, opts) -> dict:
    """In this process: the solve check, or one kernel's accuracy (and, on CUDA, timing; the chunked op's with
    the op's part)."""
    if part == "solve":
        return dict(solve=solve_rows(device))
    variant = None if part == "op" else part
    result = dict(accuracy=accuracy_rows([variant], device, (torch.bfloat16, torch.float32)), timing=[])
    if device == "cuda" and not opts.no_timing and not any("error" in r for r in result["accuracy"]):
        batches = [tuple(int(x) for x in b.split("x")) for b in opts.batches.split(",")]
        result["timing"] = timing_rows([variant], batches, opts.reps, with_chunked=part == "op")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gdn_short.json and gdn_short.md")
    parser.add_argument("--variants", default=None, help="comma-separated wy-bv<B>-w<W>-p<P>-s<S>-<precision> "
                        "(two launches) or bv<B>-c<C>-w<W>-<precision> (one launch, v1) names "
                        f"(CUDA default {VARIANTS}; interpreter default {INTERPRET_VARIANTS})")
    parser.add_argument("--batches", default=BATCHES, help="comma-separated <sequences>x<length> for the timing")
    parser.add_argument("--reps", type=int, default=200, help="timed graph replays per kernel and batch")
    parser.add_argument("--no-timing", action="store_true", help="accuracy only")
    parser.add_argument("--part-timeout", type=float, default=300.0, help="seconds one variant's process may run")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child: one part, results in part.json
    opts = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    opts.out.mkdir(parents=True, exist_ok=True)
    if opts.part is not None:
        (opts.out / "part.json").write_text(json.dumps(run_part(opts.part, device, opts), indent=1))
        return 0
    names = (opts.variants or (VARIANTS if device == "cuda" else INTERPRET_VARIANTS)).split(",")
    dk, dv = SHAPES["gpu" if device == "cuda" else "interpret"][2:]
    for name in names:
        options = parse_variant(name)
        check_short_shapes(torch.empty(1, 1, dk), torch.empty(1, 1, dv), options["block_v"],
                                    options["chunk"], options["precision"], options["num_warps"])
    parts = ["solve", "op", *names] if device == "cuda" else ["solve", *names]  # on the CPU the op is the reference
    import triton

    result = dict(device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu (Triton interpreter)",
                  versions=dict(torch=torch.__version__, triton=triton.__version__), solve=[], accuracy=[], timing=[])
    for part in parts:  # CUDA: each in its own process; the interpreter cannot fault the device
        got = isolated_part(part, opts, opts.out / "parts" / part) if device == "cuda" else run_part(part, device, opts)
        result["solve"] += got.get("solve", [])
        result["accuracy"] += got.get("accuracy", [])
        result["timing"] = merge_timing(result["timing"], got.get("timing", []))
        (opts.out / "gdn_short.json").write_text(json.dumps(result, indent=1))
        (opts.out / "gdn_short.md").write_text(markdown(result))
    print(markdown(result))
    failed = [r for r in result["accuracy"] + result["solve"] if not r["ok"]] + [
        r for r in result["timing"] for k, v in r.items() if k.endswith("_replay_ok") and not v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""H200 check of the ``torch.ops.hf_openjev`` CUDA kernels: accuracy, CUDA-graph capture, micro-benchmark.

    python recipes/gpu_ops_check.py --out results/ops-h200

1. every CUDA op vs its plain-torch reference (run on the host CPU, fp32 math) on random bf16 and fp32 inputs at
   the 27B shapes (GDN Hk=16, Hv=48, Dk=Dv=128; conv C=10240, K=4; attention H=24, Hkv=4, D=256; hidden 5120,
   MLP 17408), odd sequence lengths, non-zero states: max abs error, max abs error / max |ref|, pass/fail;
2. capture-and-replay per op (static buffers, new data of the same shapes copied in, replay == eager);
3. median kernel time (CUDA events) at 107, 936, 3399 and 8192 tokens packed as 4/8/12/16 sequences, eager
   and graph-replayed; for the elementwise group also ``torch.compile`` of the plain code (+ graph-replayed).

Writes ``ops_check.json`` and ``ops_check.md`` under --out (after every section). ``--sections`` picks
``accuracy,capture`` (correctness: may share the GPU) or ``bench`` (timing: run it alone). Exits 1 when an accuracy or capture check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from pathlib import Path

import torch
from benchlib.timing import graph_of, median_ms

import hf_openjev.ops  # noqa: F401  (registers torch.ops.hf_openjev.*)
from hf_openjev.ops import causal_conv, elementwise, gdn_prefill, packed_attention
from hf_openjev.ops._checks import (
    attention_inputs,
    capture_replay,
    conv_inputs,
    gdn_inputs,
    max_errors,
    prefix_inputs,
    split_lengths,
    to_device,
)
from hf_openjev.ops._fla import versions

OPS = torch.ops.hf_openjev
DEVICE = "cuda"  # "cpu" only for --cpu-smoke (plumbing check of the accuracy section on a machine without GPU)
HIDDEN, MLP, EPS = 5120, 17408, 1e-6
TOKENS = {107: 4, 936: 8, 3399: 12, 8192: 16}  # tokens -> packed sequences
ODD = [1, 2, 63, 64, 65, 127, 300, 317]  # accuracy lengths (939 tokens)
TOL = {  # max |err| / max |ref|
    "gdn": {torch.bfloat16: 3e-2, torch.float32: 5e-3},
    "conv": {torch.bfloat16: 1e-2, torch.float32: 1e-5},
    "attn": {torch.bfloat16: 2e-2, torch.float32: 1e-4},
    "ew": {torch.bfloat16: 1e-2, torch.float32: 1e-5},
}


def elementwise_inputs(name: str, lengths: list[int], dtype, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def r(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dt)

    return {
        "rms_norm": lambda: dict(x=r(T, HIDDEN, scale=3.0), weight=r(HIDDEN, scale=0.3), eps=EPS),
        "add_rms_norm": lambda: dict(x=r(T, HIDDEN), residual=r(T, HIDDEN, scale=4.0), weight=r(HIDDEN, scale=0.3),
                                     eps=EPS),
        "qk_norm_rope": lambda: dict(query=r(T, 24, 256), key=r(T, 4, 256), q_weight=r(256, scale=0.1),
                                     k_weight=r(256, scale=0.1), q_eps=EPS, k_eps=EPS, cos=r(T, 64).clamp(-1, 1),
                                     sin=r(T, 64).clamp(-1, 1)),
        "gdn_gates": lambda: dict(a=r(T, 48), b=r(T, 48), A_log=r(48, dt=torch.float32), dt_bias=r(48)),
        "gated_rms_norm": lambda: dict(x=r(T * 48, 128), gate=r(T * 48, 128), weight=r(128, scale=0.3), eps=EPS),
        "silu_mul": lambda: dict(gate=r(T, MLP), up=r(T, MLP)),
        "silu_qkv": lambda: dict(mixed=r(T, 2 * 2048 + 6144, scale=3.0), key_dim=2048, value_dim=6144),
        "sigmoid_gate": lambda: dict(x=r(T, 24 * 256), gate=r(T, 24 * 256)),
    }[name]()


# name -> (op, reference, tolerance group, input builder(lengths, dtype, seed))
CASES = {
    "gdn_prefill": (OPS.gdn_prefill, gdn_prefill.gdn_prefill_reference, "gdn",
                    lambda ls, dt, s: gdn_inputs(ls, 16, 48, 128, 128, dt, DEVICE, state=True, seed=s)),
    "causal_conv1d_packed[fla]": (OPS.causal_conv1d_packed, causal_conv.causal_conv1d_packed_reference, "conv",
                                  lambda ls, dt, s: conv_inputs(ls, 10240, 4, dt, DEVICE, seed=s, fla=True)),
    "causal_conv1d_packed[torch]": (OPS.causal_conv1d_packed, causal_conv.causal_conv1d_packed_reference, "conv",
                                    lambda ls, dt, s: conv_inputs(ls, 10240, 4, dt, DEVICE, seed=s, fla=False)),
    "packed_attention": (OPS.packed_attention, packed_attention.packed_attention_reference, "attn",
                         lambda ls, dt, s: attention_inputs(ls, ls, 24, 4, 256, dt, DEVICE, seed=s)),
    "packed_attention[suffix]": (OPS.packed_attention, packed_attention.packed_attention_reference, "attn",
                                 lambda ls, dt, s: attention_inputs([max(1, n // 2) for n in ls], [n + 64 for n in ls],
                                                                    24, 4, 256, dt, DEVICE, seed=s)),
    "prefix_attention": (OPS.prefix_attention, packed_attention.prefix_attention_reference, "attn",
                         lambda ls, dt, s: prefix_inputs(ls, [64, 0, 512, 1024], [i % 4 for i in range(len(ls))],
                                                         24, 4, 256, dt, DEVICE, seed=s)),
}
for _name in ("rms_norm", "add_rms_norm", "qk_norm_rope", "gated_rms_norm", "silu_mul", "silu_qkv", "sigmoid_gate",
              "gdn_gates"):
    CASES[_name] = (getattr(OPS, _name), getattr(elementwise, f"{_name}_reference"), "ew",
                    lambda ls, dt, s, _n=_name: elementwise_inputs(_n, ls, dt, s))


def accuracy(name: str, dtype) -> dict:
    op, reference, group, build = CASES[name]
    args = build(ODD, dtype, 1)
    t0 = time.perf_counter()
    out = op(**args)  # the first call of a dtype includes Triton compilation / fla autotuning
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    ref = reference(**to_device(args, "cpu"))  # plain torch on the host CPU, fp32 math
    abs_err, rel_err = max_errors(out, ref)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    dtypes_ok = [o.dtype for o in outs] == [r.dtype for r in refs]
    tol = TOL[group][dtype]
    return dict(op=name, dtype=str(dtype).removeprefix("torch."), tokens=sum(ODD), max_abs=abs_err, max_rel=rel_err,
                tol=tol, dtypes_ok=dtypes_ok, ok=bool(rel_err < tol and dtypes_ok), first_call_s=first_call_s)


def capture(name: str) -> dict:
    op, _, _, build = CASES[name]
    lengths = split_lengths(936, 8, random.Random(0))
    replayed, eager = capture_replay(op, build(lengths, torch.bfloat16, 1), build(lengths[::-1], torch.bfloat16, 2))
    abs_err, _ = max_errors(replayed, eager)
    return dict(op=name, max_abs=abs_err, ok=abs_err == 0.0)


def bench(name: str, tokens: int, compile_budget_ok: bool) -> dict:
    op, reference, group, build = CASES[name]
    lengths = split_lengths(tokens, TOKENS[tokens], random.Random(tokens))
    args = build(lengths, torch.bfloat16, 3)
    reps = 50 if tokens <= 936 else 20
    row = dict(op=name, tokens=tokens, sequences=len(lengths), max_len=max(lengths))
    row["eager_ms"] = median_ms(lambda: op(**args), reps)
    graph = graph_of(op, args)
    row["graph_ms"] = median_ms(graph.replay, reps)
    del graph
    if group == "ew" and compile_budget_ok:
        t0 = time.perf_counter()
        compiled = torch.compile(reference, dynamic=False, fullgraph=True)
        compiled(**args)
        torch.cuda.synchronize()
        row["compile_s"] = time.perf_counter() - t0
        row["compiled_ms"] = median_ms(lambda: compiled(**args), reps)
        graph = graph_of(compiled, args)
        row["compiled_graph_ms"] = median_ms(graph.replay, reps)
        del graph
    return row


def guarded(section: list, fn, *args):
    try:
        section.append(fn(*args))
    except Exception as exc:  # noqa: BLE001 - record and go on: one broken op must not hide the others
        traceback.print_exc()
        section.append(dict(op=args[0], ok=False, error=f"{type(exc).__name__}: {exc}"[:500]))
    print(json.dumps(section[-1], default=str), flush=True)


def markdown(result: dict) -> str:
    lines = [f"# hf_openjev CUDA ops check — {result['device']}", "",
             f"versions: {result['versions']}; total {result['elapsed_s']:.0f} s", "",
             "## Accuracy (CUDA op vs reference, 939 tokens in 8 odd sequences)", "",
             "| op | dtype | max abs | max abs / max ref | tol | ok | first call s |", "|---|---|---|---|---|---|---|"]
    for r in result["accuracy"]:
        lines.append(f"| {r['op']} | {r.get('dtype', '')} | {r.get('max_abs', float('nan')):.3g} | "
                     f"{r.get('max_rel', float('nan')):.3g} | {r.get('tol', '')} | {r['ok']} {r.get('error', '')} | "
                     f"{r.get('first_call_s', float('nan')):.2f} |")
    lines += ["", "## CUDA graph capture and replay (bf16, 936 tokens, 8 sequences, replay vs eager)", "",
              "| op | max abs | ok |", "|---|---|---|"]
    lines += [f"| {r['op']} | {r.get('max_abs', '')} | {r['ok']} {r.get('error', '')} |" for r in result["capture"]]
    lines += ["", "## Median time per call (ms, bf16, CUDA events)", "",
              "| op | tokens | seqs | eager | graph | compiled | compiled+graph | compile s |",
              "|---|---|---|---|---|---|---|---|"]

    def f(x):
        return f"{x:.4f}" if isinstance(x, float) else ""

    for r in result["bench"]:
        if "error" in r:
            lines.append(f"| {r['op']} | | | error: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['op']} | {r['tokens']} | {r['sequences']} | {f(r['eager_ms'])} | {f(r['graph_ms'])} | "
                     f"{f(r.get('compiled_ms'))} | {f(r.get('compiled_graph_ms'))} | {f(r.get('compile_s'))} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--compile-budget-s", type=float, default=150.0,
                        help="skip further torch.compile benchmarks once this many seconds have passed")
    parser.add_argument("--ops", nargs="*", default=list(CASES), help="subset of: " + ", ".join(CASES))
    parser.add_argument("--sections", default="accuracy,capture,bench",
                        help="comma-separated: accuracy (bf16 and fp32), capture, bench (micro-benchmark)")
    parser.add_argument("--cpu-smoke", action="store_true", help="run only the accuracy section, on the CPU")
    cli = parser.parse_args()
    if cli.cpu_smoke:
        global DEVICE
        DEVICE = "cpu"
        rows: list = []
        for name in cli.ops:
            guarded(rows, accuracy, name, torch.float32)
        return 0 if all(r["ok"] for r in rows) else 1
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sections = set(cli.sections.split(","))
    t0 = time.perf_counter()
    result = dict(device=torch.cuda.get_device_name(), versions=versions(), sections=sorted(sections),
                  accuracy=[], capture=[], bench=[])
    cli.out.mkdir(parents=True, exist_ok=True)

    def save():  # after every section, so a run cut short by its time limit keeps what it measured
        result["elapsed_s"] = time.perf_counter() - t0
        (cli.out / "ops_check.json").write_text(json.dumps(result, indent=1, default=str))
        (cli.out / "ops_check.md").write_text(markdown(result))

    # bf16 accuracy first (the serving dtype), then capture, then fp32 accuracy (it re-autotunes fla for fp32)
    steps = [("accuracy", "accuracy", accuracy, (torch.bfloat16,)), ("capture", "capture", capture, ()),
             ("accuracy", "accuracy", accuracy, (torch.float32,))]
    for section, key, fn, extra in steps:
        if section in sections:
            for name in cli.ops:
                guarded(result[key], fn, name, *extra)
            save()
    if "bench" in sections:
        for name in cli.ops:
            for tokens in TOKENS:
                guarded(result["bench"], bench, name, tokens, time.perf_counter() - t0 < cli.compile_budget_s)
            save()
    save()
    print(markdown(result))
    failed = [r["op"] for r in result["accuracy"] + result["capture"] if not r["ok"]]
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'} ({result['elapsed_s']:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The host's time to launch each elementwise op, by layer of the call: where a warm-up's ~0.1 ms a call goes.

    python recipes/op_launch_cost.py --out results/launch

A warm-up runs every bucket's forward twice on the host (the eager run, then the recording), so what the host
spends per op call counts twice per graph; s22's op profile of a 2B warm-up put 0.09-0.14 ms of own time on each
Triton elementwise op. Here each op of ``ops/elementwise.py`` is called back to back, never synchronized inside the
loop (the kernels are tiny: the host is the bottleneck), and timed per call at three layers:

- ``custom op``: ``torch.ops.hf_openjev.<name>``, as the patched model calls it (dispatcher, Dynamo's disable
  wrapper, the checks, the launch), under ``torch.no_grad`` as ``score_fast`` runs it, and again under
  ``torch.inference_mode`` (no autograd keys: a CPU times the dispatch 8.2 against 4.7 us);
- ``cuda impl``: the op's CUDA implementation called directly (the checks and the launch);
- ``triton``: the Triton wrapper of ``ops/elementwise_triton.py`` alone (allocations, launch arguments, launch).

Baselines: ``torch.add`` of the same tensors (one ATen kernel) and an empty ``@triton.jit`` kernel (Triton's own
launch path). Rows: the tokens (``--tokens``) at the shape's widths (``--shape``). Writes ``op_launch_cost.json``
and ``.md`` (medians of ``--repeats`` rounds). Needs CUDA and Triton.

``--gdn`` times the Gated DeltaNet's two fla-backed ops too (``gdn_prefill``, ``causal_conv1d_packed``: the largest
shares of a 27B graph's recording, recipes/RESULTS.md s26), one call over one sequence of each ``--tokens``, as the
patched layer calls them, and cProfiles their CUDA implementations called directly (below the custom op, whose
boundary hides the frames from cProfile): fla's and Triton's functions by cumulative time per call.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from benchlib.provenance import command_line, package_relative, versions
from benchlib.shapes import SHAPES

EPS = 1e-6


def op_inputs(shape, tokens: int, device) -> dict[str, tuple]:
    """``op name -> arguments`` at ``tokens`` rows and ``shape``'s widths (bf16; the GDN's gates fp32 as loaded)."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def r(*size, dtype=torch.bfloat16):
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    s = shape  # a benchlib.shapes.SHAPES entry
    hidden, key_dim = s["hidden_size"], s["linear_num_key_heads"] * s["linear_key_head_dim"]
    value_heads, value_head_dim = s["linear_num_value_heads"], s["linear_value_head_dim"]
    value_dim = value_heads * value_head_dim
    heads, kv_heads, head_dim = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    rotary = head_dim // 4  # partial_rotary_factor 0.25
    return {
        "rms_norm": (r(tokens, hidden), r(hidden), EPS),
        "add_rms_norm": (r(tokens, hidden), r(tokens, hidden), r(hidden), EPS),
        "gated_rms_norm": (r(tokens, value_heads, value_head_dim), r(tokens, value_heads, value_head_dim),
                           r(value_head_dim), EPS),
        "qk_norm_rope": (r(tokens, heads, head_dim), r(tokens, kv_heads, head_dim), r(head_dim), r(head_dim), EPS, EPS,
                         r(tokens, rotary), r(tokens, rotary)),
        "gdn_gates": (r(tokens, value_heads), r(tokens, value_heads), r(value_heads, dtype=torch.float32),
                      r(value_heads)),
        "silu_mul": (r(tokens, s["intermediate_size"]), r(tokens, s["intermediate_size"])),
        "sigmoid_gate": (r(tokens, heads, head_dim), r(tokens, heads, head_dim)),
        "silu_qkv": (r(tokens, 2 * key_dim + value_dim), key_dim, value_dim),
    }


def gdn_inputs(shape, lengths: list[int], device) -> dict[str, tuple]:
    """``op name -> arguments`` of the Gated DeltaNet's fla-backed ops for one call over sequences of ``lengths``
    (fresh states, final states kept), at ``shape``'s widths, as ``patches/packed_candidates.py`` calls them."""
    from hf_openjev.ops.varlen import prepare_varlen_metadata

    gen = torch.Generator(device="cpu").manual_seed(0)

    def r(*size, dtype=torch.bfloat16):
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    s, tokens = shape, sum(lengths)
    key_heads, key_dim, value_heads = s["linear_num_key_heads"], s["linear_key_head_dim"], s["linear_num_value_heads"]
    value_dim = s["linear_value_head_dim"]
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    meta = prepare_varlen_metadata(list(itertools.accumulate(lengths, initial=0)), device=device)
    g = -torch.rand(tokens, value_heads, generator=gen).to(device)  # fp32 log decays <= 0
    beta = torch.rand(tokens, value_heads, generator=gen).to(device=device, dtype=torch.bfloat16)
    return {
        "causal_conv1d_packed": (r(tokens, conv_dim), r(conv_dim, 4), meta.cu_seqlens, None, meta.chunk_indices,
                                 False, True),
        "gdn_prefill": (r(tokens, key_heads, key_dim), r(tokens, key_heads, key_dim), r(tokens, value_heads, value_dim),
                        g, beta, meta.cu_seqlens, None, meta.chunk_indices, True, meta.chunk_offsets),
    }


def gdn_impls() -> dict:
    """The CUDA implementations of the GDN ops, called below the custom op."""
    from hf_openjev.ops import causal_conv, gdn_prefill

    return {"causal_conv1d_packed": causal_conv._causal_conv1d_packed_cuda,
            "gdn_prefill": gdn_prefill._gdn_prefill_cuda}


def profile_calls(fn, args, *, calls: int, top: int = 25) -> list[str]:
    """cProfile of ``calls`` calls of ``fn(*args)``: the ``top`` functions by cumulative time, with us per call of
    ``fn`` (package-relative file names)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn(*args)
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][3])[:top]  # (file, line, name) -> (.., cumtime)
    lines = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in rows:
        where = package_relative(f"{file}:{line}")
        lines.append(f"{1e6 * cumtime / calls:8.1f} us cum {1e6 * tottime / calls:7.1f} us own "
                     f"{ncalls / calls:5.1f} calls  {where}({name})")
    return lines


def per_call_us(fn, args, *, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the host's microseconds per call of ``fn(*args)``, ``calls`` back to back."""
    for _ in range(20):
        fn(*args)
    torch.cuda.synchronize()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(rounds), 1)


def layers_of(name: str):
    """(custom op, cuda impl) of one op, each taking the op's arguments."""
    from hf_openjev.ops import elementwise as ew

    return getattr(torch.ops.hf_openjev, name), getattr(ew, f"_{name}_cuda")


def triton_wrapper(name: str):
    """The Triton wrapper behind one op, taking the op's arguments (imports Triton)."""
    from hf_openjev.ops import elementwise_triton as tr

    triton_calls = {
        "rms_norm": lambda x, w, eps: tr.rms_norm(x, w, eps),
        "add_rms_norm": lambda x, res, w, eps: tr.rms_norm(x, w, eps, residual=res),
        "gated_rms_norm": tr.gated_rms_norm,
        "qk_norm_rope": lambda q, k, qw, kw, qe, ke, cos, sin: (tr.norm_rope(q, qw, qe, cos, sin),
                                                                 tr.norm_rope(k, kw, ke, cos, sin)),
        "gdn_gates": tr.gdn_gates, "silu_mul": tr.silu_mul, "sigmoid_gate": tr.sigmoid_gate, "silu_qkv": tr.silu_qkv,
    }
    return triton_calls[name]


def empty_triton_kernel():
    import triton

    @triton.jit
    def _nothing(X, n):
        pass

    return lambda x: _nothing[(1,)](x, x.shape[0])


def render_markdown(result: dict) -> str:
    lines = [f"# Host time per elementwise op call, {result['shape']} widths", "",
             f"Command: `{result['command']}`", "", f"Device: {result['device']}; {result['versions']}", "",
             f"Baselines: torch.add {result['baselines']['torch.add']} us, an empty Triton kernel "
             f"{result['baselines']['empty triton kernel']} us.", "",
             "| op | tokens | custom op, us | custom op in inference_mode, us | cuda impl, us | triton wrapper, us |",
             "|---|---|---|---|---|---|"]
    for row in result["ops"]:
        lines.append(f"| {row['op']} | {row['tokens']} | {row['custom op']} | {row['custom op, inference mode']} | "
                     f"{row['cuda impl']} | {row['triton']} |")
    for row in result.get("gdn_ops", []):
        lines += ["", f"## {row['op']}, one sequence of {row['tokens']} tokens: custom op {row['custom op']} us, "
                      f"cuda impl {row['cuda impl']} us a call", "", "cProfile of the cuda impl, per call:", "", "```",
                  *row["profile"], "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="16,512", help="comma-separated row counts")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gdn", action="store_true",
                        help="also the GDN's fla-backed ops, one sequence of each --tokens, with a cProfile of fla")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("op_launch_cost: needs CUDA (it times kernel launches)", file=sys.stderr)
        return 2
    import hf_openjev.ops  # noqa: F401  (registers the custom ops)

    shape, device = SHAPES[args.shape], torch.device("cuda")
    timing = dict(calls=args.calls, repeats=args.repeats)
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for name, call_args in op_inputs(shape, tokens, device).items():
            (custom, impl), triton_call = layers_of(name), triton_wrapper(name)
            with torch.no_grad():
                no_grad_us = per_call_us(custom, call_args, **timing)
            with torch.inference_mode():
                inference_us = per_call_us(custom, call_args, **timing)
            rows.append({"op": name, "tokens": tokens, "custom op": no_grad_us,
                         "custom op, inference mode": inference_us, "cuda impl": per_call_us(impl, call_args, **timing),
                         "triton": per_call_us(triton_call, call_args, **timing)})
            print(rows[-1], flush=True)
    gdn_rows, impls = [], gdn_impls() if args.gdn else {}
    for tokens in [int(t) for t in args.tokens.split(",")] if args.gdn else []:
        for name, call_args in gdn_inputs(shape, [tokens], device).items():
            custom, impl = getattr(torch.ops.hf_openjev, name), impls[name]
            with torch.no_grad():
                gdn_rows.append({"op": name, "tokens": tokens, "custom op": per_call_us(custom, call_args, **timing),
                                 "cuda impl": per_call_us(impl, call_args, **timing),
                                 "profile": profile_calls(impl, call_args, calls=args.calls)})
            print({k: v for k, v in gdn_rows[-1].items() if k != "profile"}, flush=True)
    x = torch.randn(16, shape["hidden_size"], device=device, dtype=torch.bfloat16)
    result = {"command": command_line(), "versions": versions(), "device": torch.cuda.get_device_name(0),
              "shape": args.shape, "calls": args.calls, "repeats": args.repeats,
              "baselines": {"torch.add": per_call_us(torch.add, (x, x), **timing),
                            "empty triton kernel": per_call_us(empty_triton_kernel(), (x,), **timing)},
              "ops": rows, "gdn_ops": gdn_rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "op_launch_cost.json").write_text(json.dumps(result, indent=1))
    (out / "op_launch_cost.md").write_text(render_markdown(result))
    print(render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark's markdown report and result file names."""

from __future__ import annotations

from pathlib import Path

from benchlib.groups import native_comparison_lines
from benchlib.warmth import warmth_note


def bench_stem(args) -> str:
    """``bench_<shape>_<dtype>``, or ``bench_<shape>_fp8-<mode>`` with --fp8."""
    return f"bench_{args.shape}_fp8-{args.fp8}" if args.fp8 else f"bench_{args.shape}_{args.dtype}"


def fp8_lines(results: dict) -> list[str]:
    """The markdown's FP8 paragraph (nothing without --fp8): mode, weights before/after, the cap, the largest peak
    of the fast path (arms C/E, singles, long candidate)."""
    info = results.get("fp8")
    if not info:
        return []
    peaks = [r["peak_memory_gb"] for arm, r in results["arms"].items() if arm in ("C", "E")]
    peaks += [v["peak_memory_gb"] for v in results.get("single_candidate", {}).values()]
    peaks += [results["long_candidate"]["peak_memory_gb"]] if "long_candidate" in results else []
    peak = max(peaks, default=float("nan"))
    return ["", f"FP8 {info['mode']} (arms C/E, sweep, closed loop; A/B ran first on the bf16 weights): "
                f"{info['swapped']} projections, weights {info['weights_gb_bf16']:.2f} -> {info['weights_gb']:.2f} GB, "
                f"memory cap {info['memory_cap_gb']} GB, fast-path peak {peak:.2f} GB"]


def write_markdown(results: dict, path: Path) -> None:
    lines = [f"# JevBench-231 benchmark, {results['shape']} shape, {results['dtype']}, random weights", "",
             f"Command: `{results['command']}`", "", "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
             "", f"Workload: {results.get('manifest')} (sha256 {results.get('manifest_sha256')})",
             "", f"CUDA graphs: {results.get('cuda_graphs')}; patch options: {results.get('patch_options', {})}",
             "", f"Effective patch options (defaults included): {results.get('effective_patch_options', {})}",
             *fp8_lines(results),
             "", "| arm | n | mean ms | p50 ms | p95 ms | warm-up s | passes | peak GB |", "|---|---|---|---|---|---|---|---|"]
    for arm, r in results["arms"].items():
        if r.get("parity_only"):
            lines.append(f"| {arm} | {r['n']} | parity only: no warm-up, times include autotuning | | | | "
                         f"{r['passes']} | {r['peak_memory_gb']:.1f} |")
            continue
        name = arm + warmth_note(r.get("cold", False), r.get("warmup_requests", 0), r["n"])
        lines.append(f"| {name} | {r['n']} | {r['mean_ms']:.1f} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | "
                     f"{r['warmup_s']:.1f} | {r['passes']} | {r['peak_memory_gb']:.1f} |")
    for key in ("speedup_C_over_A", "speedup_C_over_B"):
        if key in results:
            lines.append(f"\n{key}: {results[key]:.2f}x")
    for key in ("parity_C_vs_A", "parity_B_vs_A", "parity_C_vs_B", "parity_E_vs_A", "parity_C_vs_E", "parity_A1_vs_A",
                "parity_B1_vs_B"):
        if key in results:
            lines.append(f"\n{key}: {results[key]}")
    for arm, r in results["arms"].items():
        if "graphs" in r:
            lines.append(f"\narm {arm} CUDA graphs: {r['graphs']}")
        if "compile_ahead" in r:  # --compile-threads: the first pass of its warm-up
            a = r["compile_ahead"]
            lines.append(f"\narm {arm} warm-up's compile-ahead pass: {a['seconds']:.1f} s of its {r['warmup_s']:.1f}, "
                         f"{a['compiles']} compiles on {a['threads']} threads (the end waited {a['compile_wait_s']:.1f} s), "
                         f"{a['loads']} kernels loaded in {a['load_s']:.1f} s, {a['untuned']} untuned, "
                         f"{len(a['failures'])} failed")
    for arm, r in results["arms"].items():
        if r.get("parity_only"):
            continue
        lines += ["", f"## arm {arm}: mean ms by kind x longest candidate", "", "| kind / bucket | n | mean ms |",
                  "|---|---|---|"]
        lines += [f"| {k} | {v['n']} | {v['mean_ms']:.1f} |" for k, v in r["table"].items()]
    timed = {arm: r for arm, r in results["arms"].items() if not r.get("parity_only")}
    if timed:
        lines += native_comparison_lines(timed)
    if results.get("closed_loop"):
        lines += ["", "## closed-loop clients through the server's batcher (arm C)", "",
                  "| in flight | decisions/s | p50 ms | p95 ms | forwards | graph captures while measured |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {c} | {v['decisions_per_s']:.1f} | {v['p50_ms']:.1f} | {v['p95_ms']:.1f} | {v['groups']} | "
                  f"{v.get('captures_while_measured', '-')} |" for c, v in results["closed_loop"].items()]
    if "sweep" in results:
        lines += ["", "## sweep of score_fast options (arm C; one warm-up and one measured pass each)", "",
                  "| options (over --fast-options) | mean ms | p50 ms | p95 ms | parity vs A | parity vs B | "
                  "singles, median ms |",
                  "|---|---|---|---|---|---|---|"]

        def parity_cell(p):
            return "-" if p is None else f"{p['max_abs_dp']:.4g}, {p['decision_flips']} flips"

        def singles_cell(singles):
            return " / ".join(f"{n}: {v['median_ms']:.1f}" for n, v in singles.items()) if singles else "-"
        lines += [f"| `{k}` | {v['mean_ms']:.1f} | {v['p50_ms']:.1f} | {v['p95_ms']:.1f} | "
                  f"{parity_cell(v.get('parity_vs_A'))} | {parity_cell(v.get('parity_vs_B'))} | "
                  f"{singles_cell(v.get('single_candidate'))} |"
                  for k, v in results["sweep"].items()]
    for n, v in results.get("single_candidate", {}).items():
        lines.append(f"\nsingle {n}-token candidate (C): median {v['median_ms']:.1f} ms of 5 (first call "
                     f"{v['first_ms']:.1f} ms), peak {v['peak_memory_gb']:.1f} GB")
    if "long_candidate" in results:
        lines.append(f"\nlong candidate: {results['long_candidate']}")
    path.write_text("\n".join(lines) + "\n")

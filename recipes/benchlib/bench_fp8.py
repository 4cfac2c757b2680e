"""The benchmark's ``--fp8`` arms: their options, checks, and the in-place quantization before the fast path."""

from __future__ import annotations

import argparse
import time

import torch

from benchlib.random_model import weights_gb
from benchlib.timing import sync


def add_fp8_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp8", default=None, choices=["all", "no-gdn"],
                        help="FP8 projections for the fast path (C, E, sweep, closed loop): the reference arms run "
                             "first on the bf16 weights (and --oracle hashes them), then the model is quantized in "
                             "place (hf_openjev.fp8.swap.quantize_model_fp8); writes bench_<shape>_fp8-<mode>")
    parser.add_argument("--memory-cap-gb", type=float, default=None, metavar="GB",
                        help="with --fp8, on CUDA: torch.cuda.set_per_process_memory_fraction(GB / total) right "
                             "after quantizing, so every fast-path pass runs under it (GB = 1e9 bytes)")


def check_fp8_arguments(parser, args, arms: list[str], c_options, sweep_entries):
    """--fp8: (arms with the reference ones first, C's options with ``fp8``); a sweep entry may not set fp8 (it
    would quantize the model for good in the middle of the run) and --memory-cap-gb needs --fp8."""
    if any("fp8" in entry for entry in sweep_entries):
        parser.error("--sweep: fp8 cannot be swept (quantizing is for good: the next entries would all be FP8); "
                     "use --fp8 MODE, one run per mode")
    if args.memory_cap_gb is not None and (args.fp8 is None or not args.memory_cap_gb > 0):
        parser.error("--memory-cap-gb needs --fp8 and a positive size")
    if args.fp8 is None:
        return arms, c_options
    reference_first = [a for a in arms if a not in ("C", "E")] + [a for a in arms if a in ("C", "E")]
    return reference_first, c_options.replace(fp8=args.fp8)


def quantize_for_fast_path(model, args, results: dict) -> None:
    """--fp8: quantize the model in place, once (later calls return at once), and record results["fp8"]: mode,
    modules, weights GB before and after, seconds; then --memory-cap-gb caps this process's CUDA memory."""
    if not args.fp8 or "fp8" in results:
        return
    from hf_openjev.fp8.swap import fp8_modules, quantize_model_fp8

    sync()
    start = time.perf_counter()
    count = quantize_model_fp8(model, args.fp8)
    sync()
    info = results["fp8"] = {"mode": args.fp8, "modules": list(fp8_modules(model)), "swapped": count,
                             "seconds": time.perf_counter() - start, "weights_gb_bf16": results["weights_gb"],
                             "weights_gb": weights_gb(model), "memory_cap_gb": None}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bf16 weights' blocks, cached by the allocator
        if args.memory_cap_gb is not None:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gb * 1e9 / total))
            info["memory_cap_gb"] = args.memory_cap_gb
    elif args.memory_cap_gb is not None:
        info["memory_cap_note"] = "no CUDA device: the cap was not applied"
    print(f"fp8 {args.fp8}: {count} projections swapped in {info['seconds']:.1f} s; weights "
          f"{info['weights_gb_bf16']:.2f} -> {info['weights_gb']:.2f} GB; memory cap {info['memory_cap_gb']}",
          flush=True)

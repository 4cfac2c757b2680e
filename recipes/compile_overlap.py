"""How much Triton's compiles overlap when ``ops/parallel_compile.compiling_in_parallel`` runs them on threads (issue 39).

    python recipes/compile_overlap.py --out results/compile_overlap [--kernels 6] [--threads 2] [--size 40]

Compiles ``--kernels`` distinct Triton kernels (each a chain of ``--size`` x 3..8 unrolled elementwise steps, heavy
enough for LLVM and ptxas to take a while) one after another (Triton's ``warmup``: compile, no launch), then again
on an emptied cache inside a ``compiling_in_parallel(--threads)`` block, and reports both wall times. Each side gets
its own emptied ``TRITON_CACHE_DIR`` under ``--out``.

Runs without a GPU: with no CUDA device, Triton's driver is replaced by a stand-in that names an sm_90 target, so
the compiles are real (Triton's passes, LLVM, ptxas) and only loading the binaries, which needs a device, fails (the
block reports those failures; expected). Needs Triton (3.6) in its environment, never the project's CPU one: e.g.
``python -m venv ~/triton-env && ~/triton-env/bin/pip install torch==2.13.0 triton==3.6.0``. Writes
``compile_overlap.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_parallel_compile():
    """``ops/parallel_compile.py`` by its path (it imports torch and the standard library only), so the recipe runs
    in an environment where this package is not installed."""
    spec = importlib.util.spec_from_file_location("parallel_compile", REPO / "ops" / "parallel_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use_a_stand_in_target() -> None:
    """Triton's active driver replaced by one that names an H100/H200 target (sm_90) and nothing else."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class TargetOnly:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def __getattr__(self, name):  # loading and launching need a device
            raise AttributeError(f"no GPU here: the stand-in driver has no {name}")

    driver.set_active(TargetOnly())


def make_kernels(count: int, size: int):
    import triton
    import triton.language as tl

    def make():
        @triton.jit
        def chain(OUT, N, STEPS: tl.constexpr, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(OUT + offsets, mask=offsets < N, other=0.0)
            for _ in tl.static_range(STEPS):
                x = tl.sqrt(x * x + 1.0) * 0.5 + tl.exp(x) * 0.1
            tl.store(OUT + offsets, x, mask=offsets < N)
        return chain

    return [(make(), size * (3 + i % 6)) for i in range(count)]  # a new JITFunction each: its own compile


def empty_cache(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    os.environ["TRITON_CACHE_DIR"] = str(folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kernels", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", type=int, default=40, help="unrolled steps per kernel, times 3..8")
    args = parser.parse_args(argv)
    if min(args.kernels, args.threads, args.size) < 1:
        parser.error("--kernels, --threads and --size: 1 or more")
    try:
        import torch
        import triton
    except ImportError:
        parser.error("needs torch and triton in this environment (see the docstring)")
    args.out.mkdir(parents=True, exist_ok=True)
    parallel_compile = load_parallel_compile()
    gpu = torch.cuda.is_available()
    if not gpu:
        use_a_stand_in_target()
    device = "cuda" if gpu else "cpu"
    out = torch.zeros(100, device=device)

    empty_cache(args.out / "cache_serial")
    start = time.perf_counter()
    for kernel, steps in make_kernels(args.kernels, args.size):
        kernel.warmup(out, 100, STEPS=steps, BLOCK=128, grid=(1,))  # compiled, not launched
    serial_s = time.perf_counter() - start

    empty_cache(args.out / "cache_threads")
    start = time.perf_counter()
    with parallel_compile.compiling_in_parallel(args.threads) as report:
        for kernel, steps in make_kernels(args.kernels, args.size):
            kernel[(1,)](out, 100, STEPS=steps, BLOCK=128)  # a launch call: compiled on the pool, not launched
    threads_s = time.perf_counter() - start
    for folder in ("cache_serial", "cache_threads"):
        shutil.rmtree(args.out / folder, ignore_errors=True)

    result = {"command": "python recipes/compile_overlap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "triton": triton.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(0)
              if gpu else f"none: compiled for sm_90 on {os.cpu_count()} CPU cores",
              "kernels": args.kernels, "threads": args.threads, "size": args.size, "serial_s": round(serial_s, 2),
              "threads_s": round(threads_s, 2), "speedup": round(serial_s / threads_s, 2),
              "block": {k: v for k, v in report.items() if k != "failures"},
              "failures": len(report["failures"]), "first_failure": report["failures"][:1]}
    (args.out / "compile_overlap.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Triton's compiles, one after another and on threads", "", f"`{result['command']}`", "",
             f"Triton {result['triton']}, torch {result['torch']}, device: {result['device']}", "",
             "| kernels | one after another s | threads | on threads s | speedup |", "|---|---|---|---|---|",
             f"| {args.kernels} | {serial_s:.2f} | {args.threads} | {threads_s:.2f} | {serial_s / threads_s:.2f}x |",
             "", f"The block: {result['block']}; {result['failures']} load failures"
             + ("" if gpu else " (expected: no GPU to load onto)")]
    (args.out / "compile_overlap.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

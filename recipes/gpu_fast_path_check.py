"""GPU check of the fast path: each op as the patched model calls it, then fast vs reference on a small model.

Prints full tracebacks (the pipeline wraps failures into InferenceError). Run on the device:
  python recipes/gpu_fast_path_check.py
"""

import random
import sys
import time
import traceback

import torch
from benchlib.random_model import build_model
from benchlib.shapes import VOCAB
from benchlib.workload import MANIFEST, build_workload

from hf_openjev.fast_options import FastPathOptions
from hf_openjev.fast_path import score_fast
from hf_openjev.patches import apply_patches
from hf_openjev.reference import score_reference


def main() -> int:
    model = build_model("mid", seed=0, device="cuda")
    apply_patches(model)
    work = build_workload(MANIFEST, vocab=VOCAB, seed=0, limit=None)
    rng = random.Random(0)
    picked = rng.sample(work, 40)
    for fast_opts in ({}, {"max_tokens": 512, "max_sequences": 2}):
        try:
            t = time.perf_counter()
            flat, _ = score_fast(model, [p.tokens for _, p in picked], FastPathOptions(**fast_opts))
            torch.cuda.synchronize()
            print(f"fast {fast_opts}: {len(flat)} scores in {time.perf_counter() - t:.1f}s", flush=True)
            ref = score_reference(model, [s for _, p in picked for s in p.sequences])
            d = max(abs(a - b) for a, b in zip(flat, ref))
            print(f"  max |dscore| fast vs reference (bf16): {d:.4f}", flush=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

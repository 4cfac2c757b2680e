"""One short request on the CPU at a family shape (random weights): what a user without a GPU can expect.

It reports the build time, the first and the second request's time (wall clock, and the CPU seconds of this process
over all its threads: on a shared machine the wall clock also counts waiting for a core) and the peak resident
memory; docs/usage.md "On a CPU" quotes it.

    python recipes/cpu_request.py --shape 2b --dtype float32      # one dtype per process: peak RSS is per process
    python recipes/cpu_request.py --shape 2b --dtype bfloat16

The model is the benchmark's seeded random one (``benchlib.random_model.build_model``) with the real Qwen3.5
tokenizer (the ``[tokenizer]`` extra) and the Qwen3.5 chat halves, scored through ``pipeline("jev-decision")`` on
the CPU with its defaults; the request is the README's example (one choice of two options) with a longer state.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time

import torch
from benchlib.provenance import command_line, git_commit
from benchlib.random_model import build_model
from benchlib.shapes import SHAPES

CHAT_PREFIX = "<|im_start|>user\n"
CHAT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
REQUEST = {"state": "Where is my package? I ordered it two weeks ago and the tracking page has not moved since.",
           "questions": {"intent": {"type": "choice", "instructions": "Which intent?",
                                    "criteria": {"track_order": "Wants to know where an order is",
                                                 "cancel_order": None}}}}


def peak_rss_gb() -> float:
    """This process's peak resident set (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def measure(shape: str, dtype: str) -> dict:
    from transformers import pipeline

    import hf_openjev  # noqa: F401 - registers the "jev-decision" task
    from hf_openjev.tokenizer.qwen_tokenizer import load_qwen_tokenizer

    started = time.perf_counter()
    model = build_model(shape, seed=0, device="cpu", dtype=getattr(torch, dtype))
    model.tokenizer = load_qwen_tokenizer()
    model.manifest = dataclasses.replace(model.manifest, chat_prefix=CHAT_PREFIX, chat_suffix=CHAT_SUFFIX)
    jev = pipeline("jev-decision", model=model, device="cpu")
    built = time.perf_counter() - started
    rss_built = peak_rss_gb()
    times, cpu_times, response = [], [], None
    for _ in range(2):
        t0, c0 = time.perf_counter(), time.process_time()
        response = jev(REQUEST)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    return {"shape": shape, "dtype": dtype, "build_s": round(built, 1), "peak_rss_after_build_gb": round(rss_built, 2),
            "first_request_s": round(times[0], 2), "second_request_s": round(times[1], 2),
            "first_request_cpu_s": round(cpu_times[0], 2), "second_request_cpu_s": round(cpu_times[1], 2),
            "load_average_1min": round(os.getloadavg()[0], 2),
            "peak_rss_gb": round(peak_rss_gb(), 2), "input_tokens": response["usage"]["input_tokens"],
            "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "commit": git_commit(), "command": command_line(sys.argv)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2b", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.shape, args.dtype)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``hf-openjev demo``: build the tiny random checkpoint (once), answer requests of every kind, print them."""

from __future__ import annotations

import json
from pathlib import Path

from .examples import DEMO_REQUESTS


def run_demo(*, cache_dir: str | Path | None = None, device: str | None = None, dtype: str = "float32",
             fast: bool | None = None, print_fn=print) -> list[dict]:
    """Build (if absent) and load the tiny checkpoint, answer ``DEMO_REQUESTS``, print and return the responses."""
    import torch
    from transformers import pipeline

    import hf_openjev  # noqa: F401 - registers the pipeline
    from .export.tiny import build_tiny_checkpoint
    from .checkpoint.tiny import default_cache_dir

    root = Path(cache_dir) if cache_dir else default_cache_dir() / "tiny-demo"
    tiny = build_tiny_checkpoint(root)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    jev = pipeline("jev-decision", model=str(tiny.export), device=device, dtype=dtype, fast=fast)
    print_fn(f"hf-openjev demo: tiny checkpoint at {tiny.export} on {device} ({dtype}).")
    print_fn("The weights are RANDOM: these answers show the response format, not real decisions.\n")
    responses = []
    for request in DEMO_REQUESTS:
        response = jev(request)
        responses.append(response)
        print_fn(json.dumps(response, ensure_ascii=False, indent=2))
    print_fn("\nReminder: random weights; use `hf-openjev export` on a real Open-Jev package for real answers.")
    return responses


def add_arguments(parser) -> None:
    parser.add_argument("--cache-dir", help="where to build the tiny checkpoint (default: ~/.cache/hf_openjev/tiny-demo)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def run(args) -> int:
    run_demo(cache_dir=args.cache_dir, device=args.device, dtype=args.dtype)
    return 0

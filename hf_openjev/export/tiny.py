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
                          overwrite: bool = False) -> TinyCheckpoint:
    """Build base, package and merged export under ``root`` (skipped when a complete build is already there)."""
    root = Path(root)
    tiny = TinyCheckpoint(root, root / "base", root / "package", root / "export")
    if not overwrite and _is_current_build(tiny.export / MANIFEST_NAME):
        return tiny
    if root.exists():
        shutil.rmtree(root)
    write_tiny_base_and_package(root, seed=seed, config=config, max_length=max_length)
    merge_lora(tiny.base, tiny.package, tiny.export, max_length=max_length, verify=False, progress=False)
    return tiny

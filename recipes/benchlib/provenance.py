"""What a result file records about where it came from: versions, device, git commit."""

from __future__ import annotations

import os
import platform
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def command_line(argv: list[str] | None = None) -> str:
    """The command as a result file records it: ``python3`` and the script relative to the repository, every other
    absolute path shortened to ``…/<its last part>`` (a result file names no machine's paths)."""
    def shown(arg: str) -> str:
        if not os.path.isabs(arg):
            return arg
        path = Path(arg)
        try:
            return str(path.resolve().relative_to(ROOT))
        except ValueError:
            return f"…/{path.name}"

    return " ".join(["python3", *map(shown, sys.argv if argv is None else argv)])


def package_relative(text: str) -> str:
    """``text`` (a profiler's line) with each file path cut to its package (``…/site-packages/fla/x.py`` ->
    ``fla/x.py``) or to the repository (``<root>/ops/x.py`` -> ``ops/x.py``): a result file names no machine's
    paths."""
    return re.sub(r"\S*/(site|dist)-packages/", "", text).replace(f"{ROOT}/", "")


def versions() -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"}
    for name in ("triton", "fla"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            info[name] = None
    return info


def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` when tracked files changed), or None outside a git checkout.

    ``$HF_OPENJEV_COMMIT`` wins: a device run from an exported snapshot of a commit names that commit."""
    import subprocess

    if os.environ.get("HF_OPENJEV_COMMIT"):
        return os.environ["HF_OPENJEV_COMMIT"]

    try:
        def git(*cmd):
            return subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True, text=True, check=True,
                                  timeout=30).stdout.strip()
        commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")

"""What ``evaluate`` checks before anything loads or is written: its options (``batch_size``, ``dtype``) and the
output directory; and the one repair of a results file that an interrupted run may leave: a torn record.

Every check raises a one-line :class:`~hf_openjev.eval.tasks.EvalInputError` or
:class:`~hf_openjev.errors.UsageError` (``hf-openjev eval`` prints it, exit status 2, no traceback).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import UsageError
from .tasks import EvalInputError

__all__ = ["check_batch_size", "check_dtype_name", "check_out_dir", "drop_torn_records", "remove_repair_leftovers"]


def check_batch_size(batch_size) -> int:
    """``batch_size`` (tasks per forward batch) if it is a positive integer, else a one-line UsageError."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UsageError(f"batch_size (--batch-size) must be a positive integer (tasks per forward batch), got "
                         f"{batch_size!r}")
    return batch_size


def check_dtype_name(dtype) -> str:
    """The backbone dtype's name (``"bfloat16"`` for ``"auto"``/None) for ``run.json``; a one-line UsageError for an
    unknown one such as ``"bf16"``."""
    from ..dtypes import resolve_dtype

    try:
        return str(resolve_dtype(dtype)).removeprefix("torch.")
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_out_dir(out_dir) -> Path:
    """``out_dir`` if it is, or can become, a writable directory: a file, or a parent that cannot be written, is
    refused before the model loads."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise EvalInputError(f"--out {out_dir} is a file; pass a directory (it will hold results.jsonl, summary.json, "
                             "report.md and reliability.png)")
    existing = out_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise EvalInputError(f"--out {out_dir}: {existing} is a file, so the directory cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise EvalInputError(f"--out {out_dir}: {existing} is not writable; choose another output directory")
    return out_dir


def remove_repair_leftovers(path: Path) -> list[Path]:
    """Remove the ``.<name>.repair-<pid>`` files of ``path`` left by earlier repairs that died (a kill, a full
    disk before this version); the results file has one writer, so none of them is in use. Returns them."""
    path = Path(path)
    removed = []
    if path.parent.is_dir():
        for leftover in path.parent.glob(f".{path.name}.repair-*"):
            if leftover.is_file() and not leftover.is_symlink():
                leftover.unlink(missing_ok=True)
                removed.append(leftover)
    return removed


def drop_torn_records(path: Path) -> int:
    """Rewrite the results file ``path`` without its torn records (an unterminated last line, or a line that is not
    a JSON object: an interrupted write or a full disk), so that it stays valid JSONL and the next record starts on
    its own line; returns how many were dropped (0: the file is left untouched).

    The rewrite goes to ``.<name>.repair-<pid>`` beside it, renamed over it when complete; a failed rewrite (a full
    disk: ``OSError``, raised) removes it, and every call first removes those of earlier runs
    (:func:`remove_repair_leftovers`), so no temporary outlives a resume."""
    path = Path(path)
    remove_repair_leftovers(path)
    if not path.is_file():
        return 0
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    kept, dropped = [], 1 if tail.strip() else 0
    for line in lines:
        try:
            ok = isinstance(json.loads(line), dict)
        except (ValueError, UnicodeDecodeError):
            ok = False
        if ok:
            kept.append(line)
        elif line.strip():
            dropped += 1
    if not dropped and not tail:
        return 0
    tmp = path.with_name(f".{path.name}.repair-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(b"".join(line + b"\n" for line in kept))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dropped

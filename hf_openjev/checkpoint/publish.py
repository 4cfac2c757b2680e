"""Temporary directories of the export commands and putting an export in place.

:func:`claim_temp_dir` makes ``.OUT.<kind>-<token>`` beside ``OUT`` together with a lock file
``.OUT.<kind>-<token>.lock`` that this process holds (``flock``) until :meth:`TempDir.release`; the operating
system drops the lock when the process dies, however it dies. :func:`remove_stale_temps` therefore removes exactly
the temporaries of earlier runs that are provably stale: those whose lock nobody holds (a directory of another live
export is left alone, and so is one without a lock file, made by an older version).

:func:`put_in_place` renames the finished directory to ``OUT``. Over an existing ``OUT`` (``--overwrite``) it
exchanges the two in one ``renameat2(RENAME_EXCHANGE)`` on Linux, so that ``OUT`` always holds a whole export, the
old one or the new one, whenever the process stops; where the exchange is not available it falls back to two
renames: the old export is moved aside to ``.OUT.old-<token>`` (locked like any temporary), the new one renamed to
``OUT``, and only then is the old one removed. A process that dies between those two renames leaves no ``OUT`` and
the old export aside, unlocked: the next export to ``OUT`` first puts it back (:func:`restore_interrupted_swap`), and
:func:`remove_stale_temps` never removes a moved-aside export while ``OUT`` is missing.

Only an export (its manifest present) or an empty directory is ever replaced (:func:`~.out_dir.is_replaceable`,
checked again at the swap).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from .out_dir import is_replaceable, read_umask

__all__ = ["TempDir", "claim_export_temp", "claim_temp_dir", "put_back_interrupted_swap", "put_in_place",
           "remove_stale_temps", "restore_interrupted_swap"]

_KINDS = ("tmp", "old", "bf16")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@dataclass
class TempDir:
    """A temporary directory this process owns, and the open, locked lock file that says so."""

    path: Path
    lock_path: Path
    lock_fd: int | None

    def release(self) -> None:
        """Unlock and remove the lock file (the directory itself is the caller's: renamed or removed)."""
        with contextlib.suppress(OSError):
            self.lock_path.unlink()
        if self.lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)
            self.lock_fd = None

    def discard(self) -> None:
        """Remove the directory (whatever it holds) and release it: a failed export's temporary."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()


def _lock(path: Path, *, create: bool) -> int | None:
    """An open fd of ``path`` locked exclusively by this process, or None when another process holds it."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no provable staleness
        return None
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        if create:
            raise
        return None
    return fd


def claim_temp_dir(out_dir: Path, kind: str = "tmp") -> TempDir:
    """Create ``.OUT.<kind>-<token>`` beside ``out_dir`` (mode 0o700, like ``mkdtemp``) with its held lock file."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    out_dir = Path(out_dir)
    while True:
        base = out_dir.parent / f".{out_dir.name}.{kind}-{secrets.token_hex(4)}"
        lock_path = base.with_name(base.name + ".lock")
        try:
            fd = _lock(lock_path, create=True)
        except FileExistsError:
            continue
        try:
            base.mkdir(mode=0o700)
        except FileExistsError:
            os.close(fd) if fd is not None else None
            lock_path.unlink()
            continue
        except BaseException:
            os.close(fd) if fd is not None else None
            lock_path.unlink()
            raise
        return TempDir(base, lock_path, fd)


def claim_export_temp(out_dir: Path, *, say, what: str) -> TempDir:
    """The temporary an export of ``out_dir`` is written into: ``out_dir``'s parent made, the stale temporaries
    beside it removed (each one told to ``say`` as ``"<what>: removed ..."``), a fresh one claimed
    (:func:`claim_temp_dir`) and given an ordinary directory's permissions (``0o777`` minus the umask)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    put_back_interrupted_swap(out_dir, say=say, what=what)
    for stale in remove_stale_temps(out_dir):
        say(f"{what}: removed {stale}, left by an export that did not finish")
    claim = claim_temp_dir(out_dir)
    try:
        os.chmod(claim.path, 0o777 & ~read_umask())  # made 0o700; the export is an ordinary directory
    except BaseException:
        claim.discard()
        raise
    return claim


def remove_stale_temps(out_dir: Path) -> list[Path]:
    """Remove the temporaries beside ``out_dir`` left by export runs that died (their lock is free); returns them."""
    out_dir = Path(out_dir)
    parent = out_dir.parent
    if not parent.is_dir():
        return []
    out_missing = not (out_dir.exists() or out_dir.is_symlink())
    removed = []
    for lock_path in sorted(parent.iterdir()):
        kind = _temp_kind(out_dir, lock_path)
        if kind is None or (kind == "old" and out_missing):  # a moved-aside export is kept while OUT is missing
            continue
        try:
            fd = _lock(lock_path, create=False)
        except OSError:
            continue
        if fd is None:  # a live export holds it
            continue
        try:
            target = lock_path.with_name(lock_path.name[:-len(".lock")])
            if target.exists() or target.is_symlink():
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                else:
                    target.unlink()
                removed.append(target)
            lock_path.unlink()
        finally:
            os.close(fd)
    return removed


def _temp_kind(out_dir: Path, lock_path: Path) -> str | None:
    """The kind (``tmp``, ``old``, ``bf16``) of the temporary of ``out_dir`` whose lock file is ``lock_path``."""
    pattern = rf"^\.{re.escape(out_dir.name)}\.({'|'.join(_KINDS)})-[0-9a-f]+\.lock$"
    match = re.match(pattern, lock_path.name)
    return match.group(1) if match else None


def restore_interrupted_swap(out_dir: Path) -> Path | None:
    """Put back the export an ``--overwrite`` moved aside (``.OUT.old-<token>``) when its process died before the
    new one took its place: only while ``OUT`` is missing and nobody holds the backup's lock. Returns where it
    was, or None when there was nothing to restore."""
    out_dir = Path(out_dir)
    parent = out_dir.parent
    if out_dir.exists() or out_dir.is_symlink() or not parent.is_dir():
        return None
    for lock_path in sorted(parent.iterdir()):
        if _temp_kind(out_dir, lock_path) != "old":
            continue
        backup = lock_path.with_name(lock_path.name[:-len(".lock")])
        try:
            fd = _lock(lock_path, create=False)
        except OSError:
            continue
        if fd is None:  # a live export is in the middle of its swap
            continue
        try:
            if not backup.is_dir() or backup.is_symlink():
                continue
            backup.rename(out_dir)
            lock_path.unlink()
            return backup
        finally:
            os.close(fd)
    return None


def put_back_interrupted_swap(out_dir: Path, *, say, what: str) -> None:
    """:func:`restore_interrupted_swap`, told to ``say`` as ``"<what>: put back ..."``; every export command calls it
    before checking ``OUT``, so that ``--overwrite`` (or its absence) applies to the restored export."""
    restored = restore_interrupted_swap(out_dir)
    if restored is not None:
        say(f"{what}: put back {out_dir} from {restored}, where an interrupted --overwrite had moved it aside")


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically (Linux ``renameat2``); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a))


def put_in_place(tmp: TempDir, out_dir: Path, *, overwrite: bool, refuse) -> None:
    """Rename ``tmp.path`` to ``out_dir``; an existing ``out_dir`` (only with ``overwrite``, else ``refuse()``, an
    exception to raise) is exchanged with it and then removed. ``tmp`` is released."""
    out_dir = Path(out_dir)
    if not (out_dir.exists() or out_dir.is_symlink()):
        tmp.path.rename(out_dir)
        tmp.release()
        return
    if not overwrite:
        raise refuse()
    if not is_replaceable(out_dir):
        raise CheckpointError(f"{out_dir} changed while exporting: it is no longer an export or an empty folder, so "
                              "it was not replaced; move it away and run the export again")
    if _exchange(tmp.path, out_dir):
        shutil.rmtree(tmp.path, ignore_errors=True)  # now the old export; a kill here leaves it stale (unlocked)
        tmp.release()
        return
    _swap_by_renames(tmp, out_dir)


def _swap_by_renames(tmp: TempDir, out_dir: Path) -> None:
    """Where no atomic exchange exists: the old ``out_dir`` aside (locked), the new one in place, then the old one
    removed; an error between the renames puts the old one back, a dead process leaves it for the next run."""
    backup = claim_temp_dir(out_dir, "old")
    backup.path.rmdir()
    out_dir.rename(backup.path)
    try:
        tmp.path.rename(out_dir)
    except BaseException:
        backup.path.rename(out_dir)
        backup.release()
        raise
    tmp.release()
    shutil.rmtree(backup.path, ignore_errors=True)
    backup.release()

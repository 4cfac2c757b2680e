"""Reading and writing the package's JSON files (a leaf: the manifest, the FP8 scheme and the oracles use it).

A file whose name ends in ``.gz`` is gzip-compressed JSON (the committed oracles, ``data/bench/oracle_*.json.gz``),
any other name plain JSON; the suffix alone decides, on reading and on writing. Errors are one line naming the file.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path

from .errors import CheckpointError, InputFileError

GZIP_SUFFIX = ".gz"


def is_gzipped(path: str | Path) -> bool:
    """Whether ``path`` names a gzip-compressed file (its name ends in ``.gz``)."""
    return Path(path).name.endswith(GZIP_SUFFIX)


def read_json_file(path: str | Path, *, error: type[ValueError] = InputFileError) -> object:
    """The JSON value in ``path``, gunzipped first when :func:`is_gzipped`; ``error`` (one line naming the file)
    when it is missing, unreadable, a corrupt gzip stream, not UTF-8 or not JSON."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path} is missing") from None
    except OSError as exc:
        raise error(f"{path} cannot be read: {exc.strerror or exc}") from None
    if is_gzipped(path):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile is an OSError; a cut stream an EOFError
            raise error(f"{path} is not a valid gzip file (corrupt or truncated: {exc})") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path} is not valid JSON: {exc}") from None


def read_json_object(path: Path, what: str | None = None) -> dict:
    """A JSON file that must hold an object; ``what`` names it in the errors (all ``CheckpointError``)."""
    suffix = f" ({what})" if what else ""
    if not Path(path).is_file():
        raise CheckpointError(f"{path} is missing{suffix}")
    data = read_json_file(path, error=CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object{suffix}")
    return data


def write_json_text(path: str | Path, text: str) -> None:
    """Write ``text`` (JSON) to ``path`` atomically (a temporary file beside it, synced, then a rename), gzip-compressed
    (level 9, no name or time in the header: the same text gives the same bytes) when :func:`is_gzipped`."""
    path = Path(path)
    data = text.encode("utf-8")
    if is_gzipped(path):
        data = gzip.compress(data, compresslevel=9, mtime=0)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())  # on disk before the rename: a crash leaves the old file or the new, never an empty one
    os.replace(tmp, path)

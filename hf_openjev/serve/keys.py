"""API keys for ``hf-openjev serve``: where they come from and how a presented key is checked.

Keys come from ``--api-key-file PATH`` (one key a line; blank lines and ``#`` comments ignored) and/or the
environment variable :data:`API_KEYS_ENV` (comma-separated); with neither, the server takes no key. A key is
checked against every configured key with :func:`hmac.compare_digest` on SHA-256 digests (so neither the content
nor the length of a key shows in the timing, and no early exit on a match tells which key matched). Keys are never
logged, and error messages name files and line numbers, never a key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path

from ..errors import InputFileError, UsageError

__all__ = ["API_KEYS_ENV", "KeyChecker", "read_api_keys"]

API_KEYS_ENV = "HF_OPENJEV_API_KEYS"
_KEY_RE = re.compile(r"[\x21-\x7e]{1,512}")  # visible ASCII, as an HTTP header carries it (no spaces)


def _read_key_file(path) -> list[str]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputFileError(f"--api-key-file {path}: no such file") from None
    except IsADirectoryError:
        raise InputFileError(f"--api-key-file {path}: is a directory, not a file of keys") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputFileError(f"--api-key-file {path}: cannot read it ({type(exc).__name__})") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not _KEY_RE.fullmatch(line):
            raise InputFileError(f"--api-key-file {path}, line {number}: a key must be 1..512 visible ASCII "
                                 "characters without spaces")
        keys.append(line)
    if not keys:
        raise InputFileError(f"--api-key-file {path} holds no key (one key a line; blank lines and # comments "
                             "are ignored)")
    return keys


def _read_env_keys(value: str) -> list[str]:
    keys = [part.strip() for part in value.split(",") if part.strip()]
    if not keys:  # set but empty: refuse rather than serve without keys by mistake
        raise UsageError(f"{API_KEYS_ENV} is set but holds no key (comma-separated keys; unset it to serve "
                         "without keys)")
    for position, key in enumerate(keys, 1):
        if not _KEY_RE.fullmatch(key):
            raise UsageError(f"{API_KEYS_ENV}: key {position} must be 1..512 visible ASCII characters without "
                             "spaces")
    return keys


def read_api_keys(path=None, *, environ=None) -> tuple[str, ...]:
    """The keys of ``path`` (``--api-key-file``) and of ``$HF_OPENJEV_API_KEYS``, in that order, duplicates
    dropped; ``()`` (the server takes no key) when neither is given.

    A missing, unreadable or empty file, or a malformed key, raises :class:`~hf_openjev.errors.InputFileError`
    (the environment variable: :class:`~hf_openjev.errors.UsageError`) naming the file and line, never the key.
    """
    environ = os.environ if environ is None else environ
    keys = _read_key_file(path) if path is not None else []
    if environ.get(API_KEYS_ENV) is not None:
        keys += _read_env_keys(environ[API_KEYS_ENV])
    return tuple(dict.fromkeys(keys))


class KeyChecker:
    """Checks ``Authorization: Bearer <key>`` against the configured keys in constant time."""

    def __init__(self, keys=()):
        self._digests = [hashlib.sha256(key.encode("utf-8")).digest() for key in keys]

    def __len__(self) -> int:
        return len(self._digests)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @staticmethod
    def bearer_token(header: bytes | None) -> bytes | None:
        """The token of an ``Authorization`` header value (scheme ``Bearer``, any case), else None."""
        if not header:
            return None
        scheme, _, token = header.strip().partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return None
        return token

    def matches(self, token: bytes) -> bool:
        """Whether ``token`` is one of the keys: compared with every key, whatever matched before."""
        return self.identify(token) is not None

    def identify(self, token: bytes) -> int | None:
        """Which configured key ``token`` is (its position, the key's id: never the key itself), else None;
        compared with every key, whatever matched before."""
        presented = hashlib.sha256(token).digest()
        found = -1
        for position, digest in enumerate(self._digests):
            matched = hmac.compare_digest(presented, digest)
            found = max(found, position * matched - (not matched))  # no branch on the comparison
        return None if found < 0 else found

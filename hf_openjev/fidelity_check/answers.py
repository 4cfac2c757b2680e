"""Each configuration's answers, kept in ``<out>/answers_<name>.json`` so that a cut or repeated run does not
answer them again.

A fidelity run answers every request with B and with each configuration before it writes its report. On a big
model that takes minutes per configuration, most of it in the configuration's warm-up pass. A run cut before the
report (a time limit, a crash, Ctrl-C) used to lose every answer. Now the answers are written after each
configuration, atomically.

Each configuration's answers are keyed by what decides them:

- the stored weights' fingerprints;
- the configuration's options (``None`` for B, the reference path);
- the versions and the device (:func:`~hf_openjev.fidelity_check.run.run_info`);
- for a fast-path configuration, this package's version and commit (``$HF_OPENJEV_COMMIT``, when set:
  :func:`~hf_openjev.fidelity_check.run.package_identity`): the fast path is this package's code, so another commit
  answers again. B and B1 are stock Transformers and fla (their versions are in the key) and are reused across
  commits.

A later run into the same ``--out`` with the same ``--name`` reuses a configuration's answers when its key is equal
and every request it compares is there with the same token ids. Otherwise the configuration answers again. Its new
entries replace the old ones of the same ids, and entries of other requests are kept.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..errors import InputFileError, UsageError
from ..json_files import read_json_file, write_json_text

ANSWERS_FORMAT = "hf-openjev-fidelity-answers/1"


def answers_path(out: str | Path, name: str) -> Path:
    """``<out>/answers_<name>.json``."""
    return Path(out) / f"answers_{name}.json"


def answer_key(*, weights: dict, options, info: dict, package: dict) -> dict:
    """What a configuration's answers depend on: ``weights`` (the fingerprints), ``options`` (a FastPathOptions, or
    None for B), ``info`` (versions and device) and, for a fast-path configuration, ``package`` (this package's
    version and commit)."""
    key = {"weights": dict(weights), "options": None if options is None else options.to_dict(), "run": dict(info)}
    if options is not None:
        key["package"] = dict(package)
    return key


class AnswerStore:
    """The answers file of one run name: read when made (refused in one line if it is not one), written whole after
    every :meth:`record`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.configurations: dict[str, dict] = {}
        if not self.path.exists():
            return
        try:
            data = read_json_file(self.path)
        except InputFileError as exc:
            raise UsageError(f"{exc}; delete it to answer every configuration again") from None
        if not isinstance(data, dict) or data.get("format") != ANSWERS_FORMAT \
                or not isinstance(data.get("configurations"), dict):
            raise UsageError(f"{self.path} is not a {ANSWERS_FORMAT} file; delete it or choose another --out or --name")
        self.configurations = data["configurations"]

    def reuse(self, config: str, key: dict, items: Sequence) -> list[dict] | None:
        """The stored entries of ``config`` for ``items`` (in their order) when its key is ``key`` and every item is
        there with its token ids; else None."""
        stored = self.configurations.get(config)
        if not isinstance(stored, dict) or stored.get("key") != key:
            return None
        by_id = {e.get("id"): e for e in stored.get("entries", []) if isinstance(e, dict)}
        found = [by_id.get(item.id) for item in items]
        if any(e is None or e.get("tokens_sha256") != item.tokens_sha256 for e, item in zip(found, items)):
            return None
        return found

    def record(self, config: str, key: dict, entries: Sequence[dict]) -> None:
        """Keep ``entries`` as ``config``'s answers under ``key`` (with a stored key unchanged, entries of other
        ids stay) and write the file."""
        stored = self.configurations.get(config)
        kept = stored.get("entries", []) if isinstance(stored, dict) and stored.get("key") == key else []
        new_ids = {e["id"] for e in entries}
        merged = [e for e in kept if isinstance(e, dict) and e.get("id") not in new_ids] + list(entries)
        self.configurations[config] = {"key": key, "entries": merged}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_text(self.path, json.dumps({"format": ANSWERS_FORMAT, "configurations": self.configurations}))

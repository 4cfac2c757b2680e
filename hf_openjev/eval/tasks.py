"""JevBench task inputs for ``hf-openjev eval``: files and datasets -> validated :class:`Task` objects.

Inputs (:func:`resolve_inputs` checks them all before anything is read; :class:`EvalInputError` otherwise):

- ``*.jsonl``: task files (``data/jevbench/`` holds the public set), read line by line (exact JSON; errors carry
  the line number; blank lines skipped).
- ``*.json`` / ``*.parquet``: loaded with ``datasets.load_dataset("json" | "parquet", data_files=...)``; a row's
  "line" is its 1-based row number.
- a directory: a ``Dataset.save_to_disk`` directory through ``datasets.load_from_disk`` (all splits, in name
  order); any other directory is searched recursively for those files (hidden folders skipped).

A task's *tier* is its input's file stem (``easy.jsonl`` -> ``easy``) or directory name; two inputs with one tier
name are an error. Rows loaded through ``datasets`` pass through Arrow, which gives struct columns the union of
every row's keys (missing ones null): criteria keys that are not among ``labels`` and hold null are dropped, and a
``question`` stored as a JSON string is decoded. Keep nested values as JSON strings (or use ``.jsonl``) for
byte-exact prompts.

Task -> request (docs/contract.md §1): ``{"state": task["state"], "questions": {task["id"] or "q": {"type",
"instructions", "criteria"}}}`` with the criteria reordered to follow ``labels``: choice -> ``{label:
criteria[label] for label in labels}`` (the keys must be exactly the labels); score -> the array as given
(``labels`` must be ``"0".."n-1"``, ``expected`` an integer level index, stored as its string); noul -> criteria as
given (``labels`` must be ``"no"`` and ``"yes"``). A malformed line, missing or inconsistent fields or a duplicate id
within a tier make a task invalid (``{file, line, tier, id, stage: "input", error}``); a task without ``id`` gets
``"<tier>:<line>"``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..contract import KIND_NAMES, MSG_TYPE

DATASET_SUFFIXES = {".json": "json", ".parquet": "parquet"}


class EvalInputError(ValueError):
    """Evaluation inputs that cannot be used (missing file, unsupported format, unreadable dataset, ...)."""


class _TaskError(ValueError):
    """One invalid task (internal)."""


@dataclass(frozen=True)
class Source:
    path: Path
    tier: str


@dataclass
class Task:
    id: str
    tier: str
    family: str
    kind: str
    group: str | None
    labels: list[str]
    expected: str
    request: dict
    file: str
    line: int

    @property
    def key(self) -> tuple[str, str]:
        return (self.tier, self.id)

    @property
    def qid(self) -> str:
        return next(iter(self.request["questions"]))


# -- inputs ----------------------------------------------------------------------------------------------------------

def resolve_inputs(data) -> list[Source]:
    """Check every input path (exists, supported) and name its tier; raises :class:`EvalInputError`."""
    if isinstance(data, (str, os.PathLike)):
        data = [data]
    paths = [Path(p) for p in (data or [])]
    if not paths:
        raise EvalInputError("no evaluation data given; pass one or more task files or dataset directories")
    sources: list[Source] = []
    seen: dict[str, Path] = {}
    for path in paths:
        if not path.exists():
            raise EvalInputError(f"{path}: no such file or directory")
        if path.is_dir():
            tier = path.resolve().name
            if not _is_saved_dataset(path) and not _data_files(path):
                raise EvalInputError(f"{path}: the directory holds no .jsonl, .json or .parquet files")
        elif path.is_file():
            if path.suffix.lower() not in (".jsonl", *DATASET_SUFFIXES):
                raise EvalInputError(f"{path}: unsupported input; use .jsonl, .json, .parquet files or a directory")
            if not os.access(path, os.R_OK):
                raise EvalInputError(f"{path}: not readable")
            tier = path.stem
        else:
            raise EvalInputError(f"{path}: not a regular file or directory")
        if tier in seen:
            raise EvalInputError(f"{seen[tier]} and {path} both give the tier name {tier!r}; rename one of them")
        seen[tier] = path
        sources.append(Source(path, tier))
    return sources


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _data_files(directory: Path) -> list[Path]:
    files = []
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).parts
        if any(part.startswith(".") for part in rel):
            continue
        if p.is_file() and p.suffix.lower() in (".jsonl", *DATASET_SUFFIXES):
            files.append(p)
    return files


def _read_jsonl(path: Path) -> Iterator[tuple[int, object, str | None]]:
    """``(line number, parsed object or None, error or None)``; blank lines are skipped."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield number, None, f"invalid UTF-8: {exc}"
                continue
            if not text.strip():
                continue
            try:
                yield number, json.loads(text), None
            except json.JSONDecodeError as exc:
                yield number, None, f"malformed JSON: {exc}"


def _load_dataset_rows(path: Path, progress: bool = True) -> Iterator[tuple[str, int, dict]]:
    """Rows of a ``.json``/``.parquet`` file or a saved dataset directory, via ``datasets``."""
    import datasets

    bars_were_on = not datasets.are_progress_bars_disabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                parts = [(f"{path}[{name}]", loaded[name]) for name in sorted(loaded)]
            else:
                parts = [(str(path), loaded)]
        else:
            builder = DATASET_SUFFIXES[path.suffix.lower()]
            parts = [(str(path), datasets.load_dataset(builder, data_files=str(path), split="train"))]
    except Exception as exc:  # any loader failure is an input error
        raise EvalInputError(f"{path}: cannot load with datasets: {type(exc).__name__}: {exc}") from exc
    finally:
        if bars_were_on and not progress:
            datasets.enable_progress_bars()
    for where, ds in parts:
        for index, row in enumerate(ds, start=1):
            yield where, index, row


def _iter_raw(source: Source, progress: bool = True) -> Iterator[tuple[str, int, object, str | None, bool]]:
    """``(file, line, row, error, from_arrow)`` for every task line/row of a source."""
    path = source.path
    if path.is_dir() and _is_saved_dataset(path):
        files = [path]
    elif path.is_dir():
        files = _data_files(path)
    else:
        files = [path]
    for f in files:
        if f.is_file() and f.suffix.lower() == ".jsonl":
            for number, row, error in _read_jsonl(f):
                yield str(f), number, row, error, False
        else:
            for where, number, row in _load_dataset_rows(f, progress):
                yield where, number, row, None, True


def _criteria_for(kind: str, question: dict, labels: list[str], from_arrow: bool):
    criteria = question.get("criteria")
    if kind == "choice":
        if not isinstance(criteria, dict):
            raise _TaskError("choice criteria must be an object")
        extra = [k for k in criteria if k not in labels and not (from_arrow and criteria[k] is None)]
        missing = [label for label in labels if label not in criteria]
        if extra or missing:
            raise _TaskError(f"labels do not match the criteria keys (missing {missing}, extra {extra})")
        return {label: criteria[label] for label in labels}
    if kind == "score":
        if not isinstance(criteria, list):
            raise _TaskError("score criteria must be an array")
        if labels != [str(i) for i in range(len(criteria))]:
            raise _TaskError(f"score labels must be '0'..'{len(criteria) - 1}', got {labels}")
        return criteria
    # noul
    if sorted(labels) != ["no", "yes"]:
        raise _TaskError(f"noul labels must be ['no', 'yes'], got {labels}")
    if from_arrow and isinstance(criteria, dict):
        criteria = {k: v for k, v in criteria.items() if k in ("true", "false") or v is not None}
        if all(v is None for v in criteria.values()):
            criteria = None
    return criteria


def _expected_label(kind: str, expected, labels: list[str]) -> str:
    if kind == "score":
        if isinstance(expected, bool) or not isinstance(expected, (int, str, float)):
            raise _TaskError(f"score expected must be an integer level index, got {expected!r}")
        if isinstance(expected, float):
            if not expected.is_integer():
                raise _TaskError(f"score expected must be an integer level index, got {expected!r}")
            expected = int(expected)
        label = str(expected)
    elif kind == "noul" and isinstance(expected, bool):
        label = "yes" if expected else "no"
    elif isinstance(expected, str):
        label = expected
    else:
        raise _TaskError(f"expected must be a label string, got {expected!r}")
    if label not in labels:
        raise _TaskError(f"expected {expected!r} is not one of the labels {labels}")
    return label


def task_from_row(row, *, tier: str, file: str, line: int, from_arrow: bool = False) -> Task:
    """One task -> :class:`Task` (request built, criteria ordered by ``labels``); raises ``_TaskError``."""
    if not isinstance(row, dict):
        raise _TaskError("a task must be a JSON object")
    missing = [k for k in ("state", "question", "labels", "expected") if k not in row or
               (from_arrow and row[k] is None and k != "state")]
    if missing:
        raise _TaskError(f"missing field(s): {', '.join(missing)}")
    question = row["question"]
    if from_arrow and isinstance(question, str):
        try:
            question = json.loads(question)
        except json.JSONDecodeError as exc:
            raise _TaskError(f"question is a string but not JSON: {exc}") from exc
    if not isinstance(question, dict):
        raise _TaskError("question must be an object")
    kind = question.get("type")
    if kind not in KIND_NAMES:
        raise _TaskError(MSG_TYPE)
    labels = row["labels"]
    if not isinstance(labels, (list, tuple)) or not labels or not all(isinstance(x, str) for x in labels):
        raise _TaskError("labels must be a non-empty array of strings")
    labels = list(labels)
    if len(set(labels)) != len(labels):
        raise _TaskError("labels contain duplicates")
    expected = _expected_label(kind, row["expected"], labels)
    criteria = _criteria_for(kind, question, labels, from_arrow)
    task_id = row.get("id")
    if task_id is None or task_id == "":
        task_id = f"{tier}:{line}"
    definition = {k: question[k] for k in ("type", "instructions") if k in question}
    if criteria is not None:
        definition["criteria"] = criteria
    qid = str(row.get("id") or "q")
    request = {"state": row["state"], "questions": {qid: definition}}
    group = row.get("group")
    return Task(id=str(task_id), tier=tier, family=str(row.get("family") or "unknown"), kind=kind,
                group=None if group is None else str(group), labels=labels, expected=expected, request=request,
                file=file, line=line)


def load_tasks(sources: Sequence[Source], *, warn=None, progress: bool = True) -> tuple[list[Task], list[dict]]:
    """Every valid task of ``sources`` in input order, and the invalid ones as ``{file, line, tier, id, error}``."""
    warn = warn or _warn
    tasks: list[Task] = []
    invalid: list[dict] = []
    first_seen: dict[tuple[str, str], str] = {}
    for source in sources:
        for file, line, row, error, from_arrow in _iter_raw(source, progress):
            task_id = row.get("id") if isinstance(row, dict) else None
            if error is None:
                try:
                    task = task_from_row(row, tier=source.tier, file=file, line=line, from_arrow=from_arrow)
                    if task.key in first_seen:
                        raise _TaskError(f"duplicate task id {task.id!r} (first at {first_seen[task.key]})")
                    first_seen[task.key] = f"{file}:{line}"
                    tasks.append(task)
                    continue
                except _TaskError as exc:
                    error = str(exc)
            entry = {"file": file, "line": line, "tier": source.tier,
                     "id": None if task_id is None else str(task_id), "stage": "input", "error": error}
            invalid.append(entry)
            warn(f"{file}:{line}: invalid task: {error}")
    return tasks, invalid


def _warn(message: str) -> None:
    print(f"hf-openjev eval: {message}", file=sys.stderr, flush=True)


# -- results file and resume -----------------------------------------------------------------------------------------

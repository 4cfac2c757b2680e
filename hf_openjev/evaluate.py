"""``hf-openjev eval``: run JevBench-style tasks through the decision pipeline and score them.

Public API::

    evaluate(*, model, data, out_dir, batch_size=16, fast=None, device=None, dtype="auto",
             resume=True, progress=True) -> dict      # the summary, also written to <out_dir>/summary.json

``model`` is a merged export directory or a loaded :class:`~hf_openjev.model.JevModel`; ``data`` one path or a
list of paths. The metric definitions are in :mod:`hf_openjev.eval_metrics`.

Inputs
    - ``*.jsonl``: JevBench task files, read line by line here (exact JSON; errors carry the line number).
    - ``*.json`` / ``*.parquet`` files: loaded with ``datasets.load_dataset("json" | "parquet", data_files=...)``;
      the "line" of a row is its 1-based row number.
    - a directory: a ``Dataset.save_to_disk`` directory is read with ``datasets.load_from_disk`` (all splits, in
      name order); any other directory is searched recursively for ``*.jsonl``, ``*.json`` and ``*.parquet`` files
      (hidden folders skipped), each read as above.

    The *tier* of a task is the input file's stem (``easy.jsonl`` -> ``easy``) or, for a directory, the
    directory's name. Two inputs with the same tier name are an error. A missing or unusable input raises
    :class:`EvalInputError` before the model is loaded.

    Rows loaded through ``datasets`` pass through Arrow, which gives struct columns the union of the keys of all
    rows (missing ones filled with null): criteria keys that are not among ``labels`` and hold null are dropped
    for such rows. A ``question`` column stored as a JSON string is decoded. Keep nested values as JSON strings (or
    use ``.jsonl``) for byte-exact prompts.

Task -> request (contract §1)
    ``{"state": task["state"], "questions": {task["id"] or "q": {"type", "instructions", "criteria"}}}`` with the
    criteria reordered to follow ``labels``: choice -> ``{label: criteria[label] for label in labels}`` (the keys
    must be exactly the labels); score -> the array as given (``labels`` must be ``"0".."n-1"``, ``expected`` an
    integer level index, stored as its string); noul -> criteria as given (``labels`` must be ``["no", "yes"]``).
    A malformed line, a task with missing or inconsistent fields, a duplicate id within a tier, or a request the
    contract rejects (``RequestError``) is *invalid*: reported (file, line, error) on stderr and in the summary,
    counted, and the run goes on. A task without ``id`` gets ``"<tier>:<line>"``. Each invalid entry of the
    summary is ``{file, line, tier, id, stage ("input" or "request"), error}``.

Running
    Pending tasks go through :func:`~hf_openjev.scoring.prepare_request` one by one, then through
    :func:`~hf_openjev.scoring.score_prepared` ``batch_size`` tasks at a time (one forward plan per batch), with a
    tqdm progress bar. **Latency** of a task = the wall time of its batch (tokenization + forward + answers)
    divided by the number of valid tasks in that batch.

Resume
    ``<out_dir>/results.jsonl`` gets one line per scored task, flushed and fsync'ed after every batch, so a
    keyboard interrupt (or a crash) loses only the batch in flight. A re-run with ``resume=True`` skips the
    (tier, id) pairs already there with the same labels and expected answer; a model is not even loaded when
    nothing is pending. Tasks the contract rejected are not stored, so a re-run loads the model to check them
    again (no forward). ``<out_dir>/run.json`` fingerprints the model (its export manifest: head, temperature,
    chat halves, ids); resuming with another model is an error. ``resume=False`` starts the results afresh.

Outputs (``out_dir``)
    ``results.jsonl``, ``run.json``, ``summary.json`` (metrics overall and by tier, family and kind, counts, the
    invalid tasks, the reliability bins), ``report.md`` and ``reliability.png``. Metrics cover the tasks of the
    current inputs only, whichever run scored them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import eval_metrics as M
from .errors import RequestError
from .model import JevModel, load_export
from .scoring import build_answer, prepare_request, score_prepared, use_fast_path

RESULTS_NAME = "results.jsonl"
RUN_NAME = "run.json"
SUMMARY_NAME = "summary.json"
REPORT_NAME = "report.md"
DIAGRAM_NAME = "reliability.png"
KINDS = ("choice", "score", "noul")
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
    except Exception as exc:  # noqa: BLE001 - any loader failure is an input error
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
    if kind not in KINDS:
        raise _TaskError("question type must be choice, score, or noul")
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

def model_fingerprint(manifest) -> dict:
    data = manifest.to_json()
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    return {"model_id": manifest.model_id, "checkpoint_revision": manifest.checkpoint_revision,
            "temperature": manifest.temperature, "fingerprint": digest}


def read_results(path: Path) -> dict[tuple[str, str], dict]:
    """Records of a results file by (tier, id), the last one winning; unparsable (torn) lines are ignored."""
    records: dict[tuple[str, str], dict] = {}
    if not path.is_file():
        return records
    with open(path, encoding="utf-8", errors="replace") as fh:
        for text in fh:
            try:
                record = json.loads(text)
                records[(record["tier"], record["id"])] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return records


def _prepare_out_dir(out_dir: Path, fingerprint: dict, resume: bool) -> dict[tuple[str, str], dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    results, run_file = out_dir / RESULTS_NAME, out_dir / RUN_NAME
    if resume and results.is_file():
        if run_file.is_file():
            try:
                previous = json.loads(run_file.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                previous = {}
            if previous.get("fingerprint") not in (None, fingerprint["fingerprint"]):
                raise EvalInputError(
                    f"{out_dir} holds results of another model ({previous.get('model_id')}, fingerprint "
                    f"{previous.get('fingerprint')}); use another output directory or resume=False (--no-resume)"
                )
        done = read_results(results)
        _terminate_last_line(results)
    else:
        if results.exists():
            results.unlink()
        done = {}
    run_file.write_text(json.dumps(fingerprint, indent=1), encoding="utf-8")
    return done


def _terminate_last_line(path: Path) -> None:
    """A torn last line (interrupted write) must not glue onto the next record."""
    with open(path, "rb+") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() == 0:
            return
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) != b"\n":
            fh.write(b"\n")


def _is_done(task: Task, record: dict | None) -> bool:
    return record is not None and record.get("labels") == task.labels and record.get("expected") == task.expected


# -- running ---------------------------------------------------------------------------------------------------------

def _record(task: Task, answer: dict, latency: float, candidates: int) -> dict:
    probs = M.distribution(task.kind, answer, task.labels)
    prediction = M.predict(probs)
    record = {"id": task.id, "tier": task.tier, "family": task.family, "kind": task.kind, "group": task.group,
              "labels": task.labels, "expected": task.expected, "probabilities": probs, "prediction": prediction,
              "correct": prediction == task.expected, "confidence": M.confidence(probs), "latency": latency,
              "candidates": candidates, "source": f"{task.file}:{task.line}"}
    if task.kind == "score":
        record["expected_level"] = M.expected_level(probs)
    return record


def _run_batches(model, pending: list[Task], *, out_path: Path, batch_size: int, fast, progress: bool,
                 invalid: list[dict], warn) -> int:
    from tqdm.auto import tqdm

    method = "fast" if use_fast_path(model, fast) else "reference"
    scored = 0
    bar = tqdm(total=len(pending), desc="hf-openjev eval", unit="task", disable=not progress, file=sys.stderr)
    if progress:  # keep the bar intact when a task is reported
        warn = lambda message: bar.write(f"hf-openjev eval: {message}", file=sys.stderr)  # noqa: E731
    try:
        with open(out_path, "a", encoding="utf-8") as fh:
            for start in range(0, len(pending), batch_size):
                batch = pending[start:start + batch_size]
                t0 = time.perf_counter()
                ok, prepared = [], []
                for task in batch:
                    try:
                        prepared.append(prepare_request(model, task.request))
                        ok.append(task)
                    except RequestError as exc:
                        invalid.append({"file": task.file, "line": task.line, "tier": task.tier, "id": task.id,
                                        "stage": "request", "error": f"request rejected: {exc}"})
                        warn(f"{task.file}:{task.line}: invalid task: request rejected: {exc}")
                if prepared:
                    result = score_prepared(model, prepared, fast=fast)
                    responses = [build_answer(model, p, s, seconds=result.seconds, prefix_cache=c, method=method)
                                 for p, s, c in zip(prepared, result.scores, result.prefix_cache)]
                    latency = (time.perf_counter() - t0) / len(prepared)
                    lines = []
                    for task, p, response in zip(ok, prepared, responses):
                        record = _record(task, response["answers"][task.qid], latency, p.parsed.candidate_count)
                        lines.append(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
                    fh.write("".join(lines))
                    fh.flush()
                    os.fsync(fh.fileno())
                    scored += len(prepared)
                bar.update(len(batch))
    except KeyboardInterrupt:
        bar.close()
        warn(f"interrupted: {scored} task(s) scored in this run are kept in {out_path}; re-run to continue")
        raise
    bar.close()
    return scored


def evaluate(*, model, data, out_dir, batch_size: int = 16, fast: bool | None = None, device=None,
             dtype="auto", resume: bool = True, progress: bool = True) -> dict:
    """Evaluate ``model`` on the tasks in ``data``; write the outputs to ``out_dir``; return the summary.

    See the module docstring for inputs, resume and outputs, and :mod:`hf_openjev.eval_metrics` for metrics.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    started = time.perf_counter()
    sources = resolve_inputs(data)
    out_dir = Path(out_dir)
    if isinstance(model, JevModel):
        manifest, model_path = model.manifest, None
    else:
        from .manifest import read_manifest

        model_path = Path(model)
        manifest = read_manifest(model_path)  # CheckpointError for a bad export, before reading any task
    fingerprint = model_fingerprint(manifest)
    tasks, invalid = load_tasks(sources, progress=progress)
    done = _prepare_out_dir(out_dir, fingerprint, resume)
    pending = [t for t in tasks if not _is_done(t, done.get(t.key))]
    scored = 0
    if pending:
        if model_path is not None:
            import torch

            if device is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
            model = load_export(model_path, dtype=dtype, device=device)
        scored = _run_batches(model, pending, out_path=out_dir / RESULTS_NAME, batch_size=batch_size, fast=fast,
                              progress=progress, invalid=invalid, warn=_warn)
    all_records = read_results(out_dir / RESULTS_NAME)
    records = [all_records[t.key] for t in tasks if _is_done(t, all_records.get(t.key))]
    invalid.sort(key=lambda e: (e["file"], e["line"]))
    summary = build_summary(records, invalid=invalid, sources=sources, fingerprint=fingerprint,
                            total=len(tasks) + _count_structural(invalid), scored_now=scored,
                            resumed=len(records) - scored, seconds=time.perf_counter() - started)
    write_outputs(summary, out_dir)
    return summary


def _count_structural(invalid: list[dict]) -> int:
    """Invalid entries that are not among the loaded tasks (malformed lines, bad fields, duplicates)."""
    return sum(1 for e in invalid if e["stage"] == "input")


# -- outputs ---------------------------------------------------------------------------------------------------------

DEFINITIONS = {
    "prediction": "argmax of the probabilities; ties go to the lexicographically smallest label; "
                  "noul probabilities are {no: 1-p, yes: p}",
    "accuracy": "mean of prediction == expected",
    "brier": "mean over tasks of sum over labels (p_label - onehot_label)^2 (multi-class)",
    "ece": "top-label confidence (max probability) in 10 equal-width bins [k/10, (k+1)/10), last bin closed; "
           "sum over bins |accuracy - mean confidence| * n_bin / N",
    "log_loss": "mean of -ln(max(p_expected, 1e-15))",
    "ordinal_mae": "score tasks: mean |E - expected| with E = sum_i i p_i the expected level; "
                   "ordinal_mae_argmax uses the predicted level instead",
    "chance_corrected_accuracy": "(accuracy - chance) / (1 - chance), chance = mean of 1/len(labels)",
    "consistency": "groups (group not null) with >= 2 scored tasks: fraction whose tasks are all correct or all "
                   "wrong; group_all_correct: fraction all correct",
    "latency": "seconds per task = wall time of its batch (tokenize + forward + answers) / valid tasks in the "
               "batch; p50/p95 by linear interpolation",
}


def build_summary(records: list[dict], *, invalid: list[dict], sources: Sequence[Source], fingerprint: dict,
                  total: int, scored_now: int, resumed: int, seconds: float) -> dict:
    confs = [M.confidence(r["probabilities"]) for r in records]
    corrects = [bool(r["correct"]) for r in records]
    return {
        "model": fingerprint,
        "data": [{"path": str(s.path), "tier": s.tier} for s in sources],
        "counts": {"tasks": total, "scored": len(records), "invalid": len(invalid), "scored_this_run": scored_now,
                   "resumed": resumed},
        "overall": M.compute_metrics(records),
        "by_tier": M.breakdown(records, "tier"),
        "by_family": M.breakdown(records, "family"),
        "by_kind": M.breakdown(records, "kind"),
        "reliability": M.reliability_bins(confs, corrects) if records else [],
        "invalid": invalid,
        "definitions": DEFINITIONS,
        "seconds": seconds,
    }


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


_COLUMNS = [("n", "n"), ("accuracy", "acc"), ("chance_corrected_accuracy", "cc-acc"), ("brier", "Brier"),
            ("ece", "ECE"), ("log_loss", "log loss"), ("ordinal_mae", "ord. MAE"), ("consistency", "consistency"),
            ("latency_p50", "p50 s"), ("latency_p95", "p95 s")]


def _table(rows: dict[str, dict], first: str) -> list[str]:
    lines = ["| " + " | ".join([first] + [title for _, title in _COLUMNS]) + " |",
             "|" + "---|" * (len(_COLUMNS) + 1)]
    for name, m in rows.items():
        lines.append("| " + " | ".join([name] + [_fmt(m.get(key)) for key, _ in _COLUMNS]) + " |")
    return lines


def render_report(summary: dict) -> str:
    c, model = summary["counts"], summary["model"]
    lines = [
        "# JevBench evaluation",
        "",
        f"Model: `{model['model_id']}` (revision `{model['checkpoint_revision']}`, T = {model['temperature']}, "
        f"fingerprint `{model['fingerprint']}`)",
        "",
        "Data: " + ", ".join(f"`{d['path']}` ({d['tier']})" for d in summary["data"]),
        "",
        f"Tasks: {c['tasks']} · scored: {c['scored']} · invalid: {c['invalid']} · scored in this run: "
        f"{c['scored_this_run']} · resumed: {c['resumed']}",
        "",
        "## Overall",
        "",
        *_table({"all": summary["overall"]}, ""),
        "",
    ]
    for key, title in (("by_tier", "tier"), ("by_family", "family"), ("by_kind", "kind")):
        lines += [f"## By {title}", "", *_table(summary[key], title), ""]
    lines += ["## Reliability", "", f"![reliability diagram]({DIAGRAM_NAME})", "",
              "| bin | n | confidence | accuracy |", "|---|---|---|---|"]
    for b in summary["reliability"]:
        close = "]" if b["hi"] >= 1.0 else ")"
        lines.append(f"| [{b['lo']:.1f}, {b['hi']:.1f}{close} | {b['n']} | {_fmt(b['confidence'])} | "
                     f"{_fmt(b['accuracy'])} |")
    lines.append("")
    if summary["invalid"]:
        lines += ["## Invalid tasks", "", "| file | line | id | error |", "|---|---|---|---|"]
        for e in summary["invalid"][:200]:
            error = str(e["error"]).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{e['file']}` | {e['line']} | {e['id'] or '–'} | {error} |")
        if len(summary["invalid"]) > 200:
            lines.append(f"| … | | | {len(summary['invalid']) - 200} more in summary.json |")
        lines.append("")
    lines += ["## Definitions", ""] + [f"- **{k}**: {v}" for k, v in summary["definitions"].items()] + [""]
    return "\n".join(lines)


def plot_reliability(summary: dict, path: Path) -> None:
    """Reliability diagram (accuracy vs confidence per bin, plus counts) with the Agg canvas (no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    bins = summary["reliability"]
    fig = Figure(figsize=(5.5, 6.5), dpi=100)
    FigureCanvasAgg(fig)
    top = fig.add_axes((0.14, 0.36, 0.8, 0.56))
    bottom = fig.add_axes((0.14, 0.08, 0.8, 0.2), sharex=top)
    top.plot([0, 1], [0, 1], linestyle="--", color="gray", linewidth=1, label="perfect calibration")
    filled = [b for b in bins if b["n"]]
    top.bar([b["lo"] for b in filled], [b["accuracy"] for b in filled], width=0.1, align="edge",
            edgecolor="black", color="#4c72b0", alpha=0.8, label="accuracy")
    top.scatter([b["confidence"] for b in filled], [b["accuracy"] for b in filled], color="#dd8452", zorder=3,
                s=18, label="mean confidence")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.set_ylabel("accuracy")
    ece = summary["overall"].get("ece")
    top.set_title(f"Reliability ({summary['overall']['n']} tasks, ECE = {_fmt(ece)})")
    top.legend(loc="upper left", fontsize=8)
    bottom.bar([b["lo"] for b in bins], [b["n"] for b in bins], width=0.1, align="edge", edgecolor="black",
               color="#8c8c8c")
    bottom.set_xlabel("confidence (max probability)")
    bottom.set_ylabel("tasks")
    fig.savefig(str(path))


def write_outputs(summary: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=1, ensure_ascii=False, allow_nan=False) + "\n",
                                        encoding="utf-8")
    (out_dir / REPORT_NAME).write_text(render_report(summary), encoding="utf-8")
    plot_reliability(summary, out_dir / DIAGRAM_NAME)


# -- command line ----------------------------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    import argparse

    parser.add_argument("--model", required=True, help="merged export directory (from `hf-openjev export`)")
    parser.add_argument("--data", required=True, nargs="+", metavar="PATH",
                        help="JevBench .jsonl task files, .json/.parquet files or dataset directories")
    parser.add_argument("--out", default="jevbench-eval", metavar="DIR",
                        help="output directory: results.jsonl, summary.json, report.md, reliability.png "
                             "(default: ./jevbench-eval)")
    parser.add_argument("--batch-size", type=int, default=16, help="tasks per forward batch (default 16)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="backbone dtype (default: auto = bfloat16)")
    parser.add_argument("--fast", action=argparse.BooleanOptionalAction, default=None,
                        help="force the fast path on/off (default: on for CUDA)")
    parser.add_argument("--no-resume", dest="resume", action="store_false",
                        help="start afresh instead of skipping tasks already in OUT/results.jsonl")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args) -> int:
    try:
        summary = evaluate(model=args.model, data=args.data, out_dir=args.out, batch_size=args.batch_size,
                           fast=args.fast, device=args.device, dtype=args.dtype, resume=args.resume,
                           progress=args.progress)
    except EvalInputError as exc:
        print(f"hf-openjev eval: error: {exc}", file=sys.stderr)
        return 2
    o, c = summary["overall"], summary["counts"]
    print(f"{c['scored']} tasks scored ({c['invalid']} invalid): accuracy {_fmt(o['accuracy'])}, "
          f"Brier {_fmt(o['brier'])}, ECE {_fmt(o['ece'])}, log loss {_fmt(o['log_loss'])}")
    print(f"wrote {Path(args.out) / SUMMARY_NAME}, {Path(args.out) / REPORT_NAME}, {Path(args.out) / DIAGRAM_NAME}")
    return 0

"""``hf-openjev eval``: run JevBench-style tasks through the decision pipeline and score them.

Public API::

    evaluate(*, model, data, out_dir, batch_size=16, fast=None, device=None, dtype="auto",
             resume=True, progress=True) -> dict      # the summary, also written to <out_dir>/summary.json

``model`` is a merged export directory or a loaded :class:`~hf_openjev.model.JevModel`; ``data`` one path or a
list of paths. The metric definitions are in :mod:`hf_openjev.eval.metrics`.

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

Files: :mod:`hf_openjev.eval.tasks` (inputs -> tasks), this module (the run, resume, CLI),
:mod:`hf_openjev.eval.report` (summary, report, diagram), :mod:`hf_openjev.eval.metrics` (the metrics).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from . import metrics as M
from .report import DIAGRAM_NAME, REPORT_NAME, SUMMARY_NAME, _count_structural, _fmt, build_summary, write_outputs
from .tasks import EvalInputError, Task, _warn, load_tasks, resolve_inputs
from ..errors import RequestError
from ..model import JevModel, load_export
from ..scoring import build_answer, prepare_request, score_prepared, use_fast_path

RESULTS_NAME = "results.jsonl"
RUN_NAME = "run.json"


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

    See the module docstring for inputs, resume and outputs, and :mod:`hf_openjev.eval.metrics` for metrics.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    started = time.perf_counter()
    sources = resolve_inputs(data)
    out_dir = Path(out_dir)
    if isinstance(model, JevModel):
        manifest, model_path = model.manifest, None
    else:
        from ..manifest import read_manifest

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




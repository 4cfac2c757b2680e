"""``hf-openjev eval``'s run: score JevBench-style tasks through the decision pipeline, resumably, on one process
or several, and write the results, summary, report and diagram.

    evaluate(*, model, data, out_dir, batch_size=16, fast=None, device=None, dtype="auto", resume=True,
             progress=True, fp8="off", batch_tokens=16384, limit=None, fast_options=None) -> dict  # the summary

``model`` is a merged export directory or a loaded :class:`~hf_openjev.model.JevModel`; ``data`` one path or a
list (``.jsonl``, ``.json``, ``.parquet`` files or directories; each input's tier is its file stem or directory
name). Reading the inputs and turning a task into a request (docs/contract.md §1) is
:mod:`hf_openjev.eval.tasks`; bad inputs raise :class:`EvalInputError` before the model loads, and a task that is
malformed or that the contract rejects is reported (file, line, error), counted in the summary and skipped.

Tasks are tokenized (:func:`~hf_openjev.scoring.prepare_request`) as their batch fills, and a batch of at most
``batch_size`` tasks that make the backbone run at most ``batch_tokens`` tokens (a bigger task alone; each reference
forward at most ``batch_tokens`` padded tokens) is scored in one :func:`~hf_openjev.scoring.score_prepared` call; a
task's **latency** is its batch's wall time (its tasks' tokenization, forward, answers) divided by its tasks. ``<out_dir>/results.jsonl`` gets one record per task,
fsync'ed per batch, so an interrupted run loses only the batch in flight; with ``resume`` a re-run skips the tasks
already recorded with the same labels and expected answer, and refuses an ``out_dir`` whose ``run.json`` holds
another model's fingerprint (:func:`model_fingerprint`: the manifest, the ``fp8`` mode, the dtype and the fast-path
options given). ``fp8`` (opt-in, an export directory only; see :data:`hf_openjev.fp8.option.FP8_HELP`) loads the
model with FP8 projections. ``fast_options`` (``--fast-options``): a mapping of
:class:`~hf_openjev.fast_options.FastPathOptions` names to values other than the defaults; they select the fast path
and are checked before any task is read (:func:`~hf_openjev.fast_options.resolve_fast_options`).

Under a launcher (``accelerate launch``, ``torchrun``) every rank tokenizes every pending task, scores its
token-balanced shard (:mod:`hf_openjev.eval.sharding`) into ``results.rank<k>.jsonl``, and rank 0 merges the shards
and writes the outputs (:mod:`hf_openjev.eval.report`); every rank returns the same summary. Metrics
(:mod:`hf_openjev.eval.metrics`) cover the tasks of the current inputs, whichever run scored them. The command
line is :mod:`hf_openjev.eval.cli`.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

from ..devices import check_device
from ..errors import RequestError, UsageError
from ..family import text_model_of
from ..fast_options import options_for
from ..model import JevModel, load_export
from ..scoring import PreparedRequest, build_answer, prepare_path, prepare_request, score_prepared
from ..work_tokens import DEFAULT_BATCH_TOKENS, check_batch_tokens, split_by_tokens, task_cost
from . import metrics as M
from .report import SUMMARY_NAME, _count_structural, build_summary, write_outputs
from .run_checks import check_batch_size, check_dtype_name, check_out_dir, drop_torn_records
from .sharding import (
    RESULTS_NAME,
    Processes,
    current_processes,
    merge_results,
    rank_device,
    rank_results_path,
    results_files,
    shard_by_tokens,
)
from .tasks import EvalInputError, Task, _warn, load_tasks, resolve_inputs

RUN_NAME = "run.json"


def model_fingerprint(manifest, fp8: str = "off", dtype: str = "bfloat16", options=None) -> dict:
    """What ``run.json`` records of the model: ids, temperature and a digest of the manifest, of the ``fp8`` mode
    when it is on, of the backbone ``dtype`` when it is not bfloat16 and of the fast-path ``options`` run with
    (a FastPathOptions, or None) where they differ from the defaults other than in ``fp8`` (their answers differ:
    results of another mode, dtype or options are not resumed; ``"off"``, bfloat16 and the default options keep
    earlier digests)."""
    changed = {} if options is None else options.to_dict(changed_only=True)
    fast_options = {name: value for name, value in changed.items() if name != "fp8"}
    data = manifest.to_json()
    if fp8 != "off":
        data = {**data, "fp8": fp8}
    if dtype != "bfloat16":
        data = {**data, "dtype": dtype}
    if fast_options:
        data = {**data, "fast_options": fast_options}
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    out = {"model_id": manifest.model_id, "checkpoint_revision": manifest.checkpoint_revision,
           "temperature": manifest.temperature, "dtype": dtype, "fingerprint": digest}
    if fast_options:
        out["fast_options"] = fast_options
    return out if fp8 == "off" else {**out, "fp8": fp8}


def loaded_model_settings(model: JevModel) -> tuple[str, str]:
    """``(fp8 mode, dtype name)`` of a loaded model, for its fingerprint: the mode of its FP8 projections
    (``"custom"`` for a set that is no mode) and its backbone's floating dtype."""
    from ..fp8.swap import fp8_mode_of

    dtypes = {p.dtype for p in model.backbone.parameters() if p.is_floating_point()}
    dtype = str(next(iter(dtypes)) if len(dtypes) == 1 else "mixed").removeprefix("torch.")
    return fp8_mode_of(model) or "custom", dtype


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


def read_done(out_dir: Path) -> dict[tuple[str, str], dict]:
    """The records of ``results.jsonl`` and of every per-rank ``results.rank<k>.jsonl``, by (tier, id)."""
    records: dict[tuple[str, str], dict] = {}
    for path in results_files(out_dir):
        records.update(read_results(path))
    return records


def _check_previous_run(out_dir: Path, fingerprint: dict) -> None:
    """Refuse to resume results of another model (read only: every rank checks, before anything is written)."""
    run_file = out_dir / RUN_NAME
    if not run_file.is_file() or not any(p.is_file() for p in results_files(out_dir)):
        return
    try:
        previous = json.loads(run_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        previous = {}
    if previous.get("fingerprint") not in (None, fingerprint["fingerprint"]):
        raise EvalInputError(
            f"{out_dir} holds results of another model, FP8 mode, dtype or fast-path options "
            f"({previous.get('model_id')}, fp8 {previous.get('fp8', 'off')}, "
            f"dtype {previous.get('dtype', 'bfloat16')}, options {json.dumps(previous.get('fast_options', {}))}, "
            f"fingerprint {previous.get('fingerprint')}); use another output directory or resume=False (--no-resume)"
        )


def _prepare_out_dir(out_dir: Path, fingerprint: dict, resume: bool,
                     processes: Processes | None = None) -> dict[tuple[str, str], dict]:
    """Check, set up (rank 0) and read the output directory; every rank returns the same finished records.

    Three barriers (none with one process): after the read-only check, after rank 0's changes, and after every
    rank has read (so that no rank appends a record another one has not read yet)."""
    processes = processes or Processes()
    if resume:
        _check_previous_run(out_dir, fingerprint)
    processes.wait()
    if processes.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            for path in results_files(out_dir):
                if path.exists():
                    path.unlink()
        else:
            for path in results_files(out_dir):
                if drop_torn_records(path):
                    _warn(f"{path}: dropped a torn record (an interrupted write); it is scored again")
        (out_dir / RUN_NAME).write_text(json.dumps(fingerprint, indent=1), encoding="utf-8")
    processes.wait()
    done = read_done(out_dir)
    processes.wait()
    return done


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


class _TaskProgress:
    """Advances the bar as each task of a batch is scored, not once per batch.

    On the reference path the backbone runs the batch's candidates in request order, a few dozen sequences per
    forward; a forward hook counts the sequences done and ticks every task whose last candidate is among them.
    (The fast path runs a batch as one packed plan: its tasks finish together.)
    """

    def __init__(self, bar, backbone):
        self.bar, self.ends, self.seen, self.ticked = bar, [], 0, 0
        self.handle = backbone.register_forward_hook(self._hook, with_kwargs=True)

    def start(self, candidates: list[int]) -> None:
        self.ends, self.seen, self.ticked = list(itertools.accumulate(candidates)), 0, 0

    def _hook(self, _module, args, kwargs, _output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        self.seen += int(ids.shape[0])
        done = bisect.bisect_right(self.ends, self.seen)
        if done > self.ticked:
            self.bar.update(done - self.ticked)
            self.ticked = done

    def close(self) -> None:
        self.handle.remove()


def _prepared_stream(model, tasks: list[Task], *, prepared_by_key: dict, invalid: list[dict], warn, bar):
    """``(task, PreparedRequest, seconds its tokenization took)`` for each valid task of ``tasks``, in order,
    tokenized as it is reached (or taken from ``prepared_by_key``); a rejected task is reported (``invalid``,
    ``warn``) and ticks ``bar``."""
    for task in tasks:
        if task.key in prepared_by_key:
            request, seconds = prepared_by_key[task.key]
            yield task, request, seconds
            continue
        t0 = time.perf_counter()
        try:
            request = prepare_request(model, task.request)
        except RequestError as exc:
            reason = f"request rejected: {exc}"  # the contract's message (the detail)
            invalid.append({"file": task.file, "line": task.line, "tier": task.tier, "id": task.id,
                            "stage": "request", "error": reason})
            warn(f"{task.file}:{task.line}: invalid task: {reason}")
            bar.update(1)
            continue
        yield task, request, time.perf_counter() - t0


def _run_batches(model, pending: list[Task], *, out_path: Path, batch_size: int, fast, progress: bool,
                 invalid: list[dict], warn, done: int = 0, total: int | None = None,
                 prepared_by_key: dict | None = None, desc: str = "hf-openjev eval",
                 batch_tokens: int = DEFAULT_BATCH_TOKENS, options=None) -> int:
    """Score ``pending`` batch by batch; the bar counts all ``total`` tasks and starts at the ``done`` ones.

    A batch holds at most ``batch_size`` tasks that make the backbone run at most ``batch_tokens`` tokens together
    (:func:`~hf_openjev.work_tokens.task_cost` on the path that runs; a bigger task alone), and each reference
    forward at most ``batch_tokens`` padded tokens. A task's latency is its batch's scoring time divided among
    its tasks plus their tokenization times, averaged. ``prepared_by_key``: (tier, id) -> (PreparedRequest,
    seconds it took) of tasks tokenized beforehand (the sharded run); ``options``: the fast path's
    (:class:`~hf_openjev.fast_options.FastPathOptions`; None: the model's own)."""
    from tqdm.auto import tqdm

    method = prepare_path(model, fast, options)  # "fast" or "reference"; the fast path patches the model here, once
    scored = 0
    bar = tqdm(total=total if total is not None else len(pending), initial=done, desc=desc,
               unit="task", disable=not progress, file=sys.stderr)
    ticker = _TaskProgress(bar, model.backbone) if progress and method == "reference" else None
    if progress:  # keep the bar intact when a task is reported
        warn = lambda message: bar.write(f"hf-openjev eval: {message}", file=sys.stderr)  # noqa: E731
    stream = _prepared_stream(model, pending, prepared_by_key=prepared_by_key or {}, invalid=invalid, warn=warn,
                              bar=bar)
    try:
        with open(out_path, "a", encoding="utf-8") as fh:
            for batch in split_by_tokens(stream, lambda item: task_cost(item[1], method), max_items=batch_size,
                                         max_tokens=batch_tokens):
                t0 = time.perf_counter()
                tasks, prepared, seconds = (list(column) for column in zip(*batch))
                if ticker is not None:
                    ticker.start([p.parsed.candidate_count for p in prepared])
                result = score_prepared(model, prepared, fast=fast, batch_tokens=batch_tokens)
                responses = [build_answer(model, p, s, seconds=result.seconds, prefix_cache=c, method=result.path)
                             for p, s, c in zip(prepared, result.scores, result.prefix_cache)]
                latency = (time.perf_counter() - t0 + sum(seconds)) / len(prepared)
                lines = []
                for task, p, response in zip(tasks, prepared, responses):
                    record = _record(task, response["answers"][task.qid], latency, p.parsed.candidate_count)
                    lines.append(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
                fh.write("".join(lines))
                fh.flush()
                os.fsync(fh.fileno())
                scored += len(prepared)
                bar.update(len(batch) - (ticker.ticked if ticker is not None else 0))
    except KeyboardInterrupt:
        bar.close()
        warn(f"interrupted: {scored} task(s) scored in this run are kept in {out_path}; re-run to continue")
        raise
    finally:
        if ticker is not None:
            ticker.close()
    bar.close()
    return scored


# -- several processes -----------------------------------------------------------------------------------------------

def _requests_model(model, model_path: Path | None) -> JevModel:
    """What :func:`~hf_openjev.scoring.prepare_request` reads of a model (tokenizer, manifest), without loading
    weights for an export directory: a rank tokenizes before it knows whether it has anything to score."""
    if model_path is None:
        return model
    import torch

    from ..checkpoint.files import load_tokenizer
    from ..checkpoint.manifest import read_manifest

    return JevModel(torch.nn.Module(), torch.nn.Linear(1, 1), load_tokenizer(model_path), read_manifest(model_path),
                    method="merged")


def prepare_tasks(model, tasks: list[Task], *, invalid: list[dict] | None = None,
                  warn=None) -> tuple[list[Task], dict[tuple[str, str], tuple[PreparedRequest, float]]]:
    """Validate and tokenize every task up front: (the valid tasks in input order, (tier, id) -> (PreparedRequest,
    seconds its ``prepare_request`` took)). A rejected task (``RequestError``) is appended to ``invalid`` (when
    given) as an entry of stage "request" and passed to ``warn`` (when given)."""
    valid, prepared = [], {}
    for task in tasks:
        t0 = time.perf_counter()
        try:
            request = prepare_request(model, task.request)
        except RequestError as exc:
            reason = f"request rejected: {exc}"  # the contract's message (the detail)
            if invalid is not None:
                invalid.append({"file": task.file, "line": task.line, "tier": task.tier, "id": task.id,
                                "stage": "request", "error": reason})
            if warn is not None:
                warn(f"{task.file}:{task.line}: invalid task: {reason}")
            continue
        prepared[task.key] = (request, time.perf_counter() - t0)
        valid.append(task)
    return valid, prepared


def select_shard(tasks: list[Task], prepared: dict, processes: Processes, *, path: str,
                 warn=None) -> list[Task]:
    """This rank's part of ``tasks`` (all in ``prepared``, as :func:`prepare_tasks` returns them): the
    :func:`~hf_openjev.eval.sharding.shard_by_tokens` shard of index ``processes.rank``, costs by
    :func:`~hf_openjev.work_tokens.task_cost` on ``path`` ("fast" or "reference"). Every rank computes the same
    shards from the same tasks; no communication. ``warn`` (when given) gets one line describing all the shards."""
    costs = [task_cost(prepared[t.key][0], path) for t in tasks]
    shards = shard_by_tokens(costs, processes.world)
    if warn is not None:
        loads = "; ".join(f"rank {k}: {len(s)} tasks, {sum(costs[i] for i in s)} tokens" for k, s in enumerate(shards))
        warn(f"{len(tasks)} pending tasks over {processes.world} processes, balanced by tokens ({path} path): "
             f"{loads}")
    return [tasks[i] for i in shards[processes.rank]]


def _score_sharded(model, pending: list[Task], *, model_path, processes: Processes, out_dir: Path, device,
                   dtype, batch_size: int, fast, progress: bool, invalid: list[dict], fp8: str = "off",
                   allow_unknown_shape: bool = False, batch_tokens: int = DEFAULT_BATCH_TOKENS, options=None) -> None:
    """One rank of a run over several processes: tokenize every pending task (same result on every rank; the
    rejected ones are reported by rank 0 only), take this rank's token-balanced shard, load the model only when
    the shard is not empty and append its records to ``results.rank<k>.jsonl``. No collective call."""
    import torch

    main = processes.is_main
    requester = _requests_model(model, model_path)
    valid, prepared = prepare_tasks(requester, pending, invalid=invalid if main else None,
                                    warn=_warn if main else None)
    if model_path is not None:
        fast_path = fast if fast is not None else torch.device(device).type == "cuda"
    else:
        from ..scoring import use_fast_path

        fast_path = use_fast_path(model, fast)
    mine = select_shard(valid, prepared, processes, path="fast" if fast_path else "reference",
                        warn=_warn if main else None)
    own = rank_results_path(out_dir, processes.rank)
    drop_torn_records(own)  # this rank's own file: nobody else writes it
    if not mine:
        return
    if model_path is not None:
        model = _load(model_path, dtype=dtype, device=device, fp8=fp8, allow_unknown_shape=allow_unknown_shape,
                      progress=progress and main)
    score_shard(model, mine, prepared, out_path=own, batch_size=batch_size, fast=fast, progress=progress and main,
                desc=f"hf-openjev eval (rank 0 of {processes.world})", batch_tokens=batch_tokens, options=options)


def score_shard(model, tasks: list[Task], prepared: dict, *, out_path: Path, batch_size: int = 16, fast=None,
                progress: bool = False, desc: str = "hf-openjev eval", batch_tokens: int = DEFAULT_BATCH_TOKENS,
                options=None) -> int:
    """Score ``tasks`` (each one's (PreparedRequest, tokenize seconds) in ``prepared``, by (tier, id)) in batches of
    at most ``batch_size`` tasks and ``batch_tokens`` tokens, appending one record per task to ``out_path`` (fsync'ed per batch); returns the number scored.
    The scoring loop of a run over several processes (``evaluate``'s own loop, without tokenization)."""
    own = {t.key: prepared[t.key] for t in tasks}
    return _run_batches(model, tasks, out_path=Path(out_path), batch_size=batch_size, fast=fast, progress=progress,
                        invalid=[], warn=_warn, total=len(tasks), prepared_by_key=own, desc=desc,
                        batch_tokens=batch_tokens, options=options)


def _check_run_options(batch_size, batch_tokens, limit) -> None:
    """``batch_size``, ``batch_tokens`` and ``limit`` (None or a positive integer): a one-line UsageError, before
    anything loads."""
    from ..errors import UsageError

    check_batch_size(batch_size)
    try:
        check_batch_tokens(batch_tokens, "batch_tokens (--batch-tokens)")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise UsageError(f"limit (--limit) must be a positive integer (the first N tasks), got {limit!r}")


def _refuse_fp8_for_a_loaded_model(model, fp8: str) -> None:
    from ..errors import UsageError

    if fp8 != "off" and isinstance(model, JevModel):
        raise UsageError(f"fp8={fp8!r} is set up when evaluate loads an export directory; for a loaded model, set it "
                         "up first (hf_openjev.patches.apply_patches(model, FastPathOptions(fp8=...))) and leave "
                         "fp8 'off', or pass the export directory")


def _check_path_options(model, fast, fp8: str, fast_options):
    """The path and the fast-path options a run asks for, before anything is read: FP8 and ``fast_options`` select
    the fast path; a one-line UsageError for either with ``fast=False``, for a bad option, or for ``fp8`` with a
    loaded model. Returns (FastPathOptions or None: the model's own, ``fast``)."""
    from ..fast_options import resolve_fast_options
    from ..fp8.option import select_fp8_path

    fast = select_fp8_path(fp8, fast)
    options, fast = resolve_fast_options(fast_options, fp8=fp8, fast=fast, reference_flag="fast=False (--no-fast)")
    _refuse_fp8_for_a_loaded_model(model, fp8)
    return options, fast


def _with_loaded_fp8(options, fp8: str):
    """``options`` (or None) for a loaded model whose FP8 projections are ``fp8``: that mode in them, since the
    model's patches cannot drop it; a one-line UsageError for a set of FP8 projections that is no mode."""
    if options is None or fp8 == "off":
        return options
    if fp8 == "custom":
        raise UsageError("fast_options for a model whose FP8 projections are no mode of --fp8: set its options up "
                         "with hf_openjev.patches.apply_patches and leave fast_options out")
    return options.replace(fp8=fp8)


def _load(model_path: Path, *, progress: bool, **kwargs) -> JevModel:
    """:func:`~hf_openjev.model.load_export`, without Transformers' weight-loading bar when ``progress`` is off."""
    from ..progress_bars import progress_bars

    with progress_bars(progress):
        return load_export(model_path, **kwargs)


def evaluate(*, model, data, out_dir, batch_size: int = 16, fast: bool | None = None, device=None,
             dtype="auto", resume: bool = True, progress: bool = True, fp8: str = "off",
             allow_unknown_shape: bool = False, batch_tokens: int = DEFAULT_BATCH_TOKENS,
             limit: int | None = None, fast_options=None) -> dict:
    """Evaluate ``model`` on the tasks in ``data``; write the outputs to ``out_dir``; return the summary.

    See the module docstring for resume, outputs, ``fp8`` and several processes, :mod:`hf_openjev.eval.tasks` for
    inputs, and :mod:`hf_openjev.eval.metrics` for metrics. Under a launcher (``accelerate launch``, ``torchrun``)
    every rank calls this and returns the same summary; rank 0 writes it. An export whose shape is no Open-Jev model's is
    refused before any task is read (:mod:`hf_openjev.family`) unless ``allow_unknown_shape``.

    ``batch_tokens``: the tokens one batch makes the backbone run (and one reference forward's padded size);
    ``limit``: the first ``limit`` valid tasks only, in input order. ``progress=False``: no bar, not even loading's.
    ``fast_options``: see the module docstring.
    """
    _check_run_options(batch_size, batch_tokens, limit)
    dtype_name = check_dtype_name(dtype)
    check_out_dir(out_dir)  # a file, or an unwritable parent: refused before any task is read or model loaded
    check_device(device)  # a CUDA device without CUDA: UsageError before any task is read
    options, fast = _check_path_options(model, fast, fp8, fast_options)
    started = time.perf_counter()
    sources = resolve_inputs(data)
    out_dir = Path(out_dir)
    if isinstance(model, JevModel):
        manifest, model_path = model.manifest, None
        fp8, dtype_name = loaded_model_settings(model)  # what it runs, for the fingerprint
        options = _with_loaded_fp8(options, fp8)
        member = text_model_of(model).config
    else:
        from ..checkpoint.manifest import read_manifest
        from ..family import check_export_shape

        model_path = Path(model)
        manifest = read_manifest(model_path)  # CheckpointError for a bad export, before reading any task
        member = check_export_shape(model_path, allow_unknown=allow_unknown_shape)
    if options is not None:  # the options given, over the model's own defaults (its family member's)
        options = options_for(member, fast_options, fp8=options.fp8)
    fingerprint = model_fingerprint(manifest, fp8, dtype_name, options)
    processes = current_processes()
    main = processes.is_main
    tasks, invalid = load_tasks(sources, progress=progress and main, warn=None if main else (lambda _m: None))
    tasks = tasks if limit is None else tasks[:limit]
    done = _prepare_out_dir(out_dir, fingerprint, resume, processes)
    pending = [t for t in tasks if not _is_done(t, done.get(t.key))]
    if main and len(pending) < len(tasks):
        _warn(f"resuming: {len(tasks) - len(pending)} of {len(tasks)} tasks done (in {out_dir / RESULTS_NAME}; "
              "--no-resume starts afresh)")
    scored = 0
    if pending and processes.world > 1:
        _score_sharded(model, pending, model_path=model_path, processes=processes, out_dir=out_dir,
                       device=rank_device(device, processes), dtype=dtype, batch_size=batch_size, fast=fast,
                       progress=progress, invalid=invalid, fp8=fp8, allow_unknown_shape=allow_unknown_shape,
                       batch_tokens=batch_tokens, options=options)
    elif pending:
        if model_path is not None:
            import torch

            if device is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
            model = _load(model_path, dtype=dtype, device=device, fp8=fp8, allow_unknown_shape=allow_unknown_shape,
                          progress=progress)
        scored = _run_batches(model, pending, out_path=out_dir / RESULTS_NAME, batch_size=batch_size, fast=fast,
                              progress=progress, invalid=invalid, warn=_warn, done=len(tasks) - len(pending),
                              total=len(tasks), batch_tokens=batch_tokens, options=options)
    processes.wait()  # every rank gets here, whatever its shard (empty included)
    if not main:
        processes.wait()  # rank 0 has merged the results and written the summary
        return json.loads((out_dir / SUMMARY_NAME).read_text(encoding="utf-8"))
    merge_results(out_dir, read_results, [t.key for t in tasks])  # per-rank files of this or an earlier run
    all_records = read_results(out_dir / RESULTS_NAME)
    records = [all_records[t.key] for t in tasks if _is_done(t, all_records.get(t.key))]
    if processes.world > 1:
        scored = sum(1 for t in tasks if _is_done(t, all_records.get(t.key)) and not _is_done(t, done.get(t.key)))
    invalid.sort(key=lambda e: (e["file"], e["line"]))
    summary = build_summary(records, invalid=invalid, sources=sources, fingerprint=fingerprint,
                            total=len(tasks) + _count_structural(invalid), scored_now=scored,
                            resumed=len(records) - scored, seconds=time.perf_counter() - started)
    write_outputs(summary, out_dir)
    processes.wait()
    return summary

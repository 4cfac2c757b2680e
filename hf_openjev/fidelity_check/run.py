"""``check_fidelity``: the fidelity gate on a user's own checkpoint and data.

Order of work (every check that needs no weights comes first):

1. configurations, inputs (task files or a workload), the oracle file (read: ``.json`` or gzipped ``.json.gz``) and
   ``oracle_device`` are checked; the export's manifest and tensor headers are read (its fp32 size);
2. the export is loaded in bf16 on the GPU (the CPU without one) and its stored weights hashed; the requests are
   tokenized; an oracle (``oracle=`` and ``<out>/oracle_<name>.json``) of other weights or other token ids under
   the same request id is refused;
3. B (the reference path in bf16, right-padded batches, whatever kernels Transformers bound) and each bf16
   configuration answer every request (the fast path patched in place), each written to ``<out>/answers_<name>.json``
   as it finishes; answers an earlier run wrote there under the same weights, options, versions and device are
   reused instead (:mod:`.answers`), so a cut run loses at most the configuration it was answering;
4. the bf16 model is freed and the fp32 oracle scores the requests it lacks, placed where it fits
   (:mod:`.placement`), written after every request to ``<out>/oracle_<name>.json``;
5. each FP8 configuration whose answers are not stored loads the export again with its mode (quantized on the
   CPU) and answers;
6. :func:`~.report.judge_against_oracle` writes ``fidelity_<name>.{json,md,png}``.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

from ..errors import UsageError
from ..family import text_model_of
from .answers import AnswerStore, answer_key, answers_path
from .configs import REFERENCE, REFERENCE_ONE_BY_ONE, describe_options, fp8_mode, options_of, parse_configs
from .placement import PLACEMENTS
from .report import early_verdict
from .requests import answer_items, entries_from_responses, items_from_tasks, items_from_workload


def run_info() -> dict:
    """Versions and the device, for the report and the oracle file."""
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"}
    try:
        import fla

        info["fla"] = fla.__version__
    except Exception:  # noqa: BLE001 - fla-core is optional
        info["fla"] = None
    return info


def package_identity() -> dict:
    """This package's version, and ``git_commit`` when ``$HF_OPENJEV_COMMIT`` names the commit of a checkout copied
    without its history (the GPU campaign sets it): in the report, and in the answers' key of the fast-path
    configurations only (:func:`~hf_openjev.fidelity_check.answers.answer_key`)."""
    from .. import __version__

    commit = os.environ.get("HF_OPENJEV_COMMIT")
    return {"hf_openjev": __version__, **({"git_commit": commit} if commit else {})}


def check_report_not_replaced(out: Path, name: str, limit: int | None, overwrite: bool) -> None:
    """A ``limit`` run writes the same ``fidelity_<name>.*`` as a full one: refuse it (one-line UsageError) when
    ``out`` holds a report that is not provably a limited one (its ``limit`` recorded), unless ``overwrite``."""
    path = Path(out) / f"fidelity_{name}.json"
    if limit is None or overwrite or not path.is_file():
        return
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        previous = None
    if isinstance(previous, dict) and previous.get("limit") is not None:
        return  # a limited report: replacing it loses no full run
    count = previous.get("requests_compared") if isinstance(previous, dict) else None
    of = f" of {count} requests" if isinstance(count, int) else ""
    raise UsageError(f"--out {out} already holds the full report {path.name}{of}, which this --limit {limit} run "
                     "would replace; pass --overwrite to replace it, or another --out or --name")


def check_arguments(*, model, out, data, workload, configs, oracle, oracle_device, name, limit=None,
                    overwrite: bool = False) -> tuple[dict, list, str]:
    """(configurations, task sources, the run's name) once every argument is usable; a one-line UsageError."""
    from ..checkpoint.manifest import read_manifest
    from ..eval.tasks import EvalInputError, resolve_inputs
    from .gate import load_oracle
    from .workload import check_workload_file

    if (data is None) == (workload is None):
        raise UsageError("give the requests as task files (data / --data) or as a workload (--workload), one of them")
    if oracle_device not in PLACEMENTS:
        raise UsageError(f"oracle_device must be one of {', '.join(PLACEMENTS)}, got {oracle_device!r}")
    if oracle_device in ("cuda", "multi-gpu", "offload"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--oracle-device {oracle_device} needs a CUDA GPU and none is visible; use cpu or auto")
    try:
        parsed = parse_configs(configs)
        sources = resolve_inputs(data) if data is not None else []
        if workload is not None:
            check_workload_file(workload)
        if oracle is not None:
            if not Path(oracle).is_file():
                raise ValueError(f"--oracle {oracle}: no such file")
            load_oracle(oracle)  # readable (.json or .json.gz) and an oracle, before any weights load
    except (ValueError, EvalInputError) as exc:
        raise UsageError(str(exc)) from None
    if Path(out).exists() and not Path(out).is_dir():
        raise UsageError(f"--out {out} is a file; give a directory")
    read_manifest(Path(model))  # CheckpointError for a bad export, before anything loads
    run_name = name or Path(model).resolve().name
    if not run_name or "/" in run_name:
        raise UsageError(f"name {run_name!r} cannot name a file; pass another name (--name)")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise UsageError(f"--limit must be a positive number of requests, got {limit!r}")
    check_report_not_replaced(Path(out), run_name, limit, overwrite)
    return parsed, sources, run_name


def check_fidelity(*, model, out, data=None, workload=None, seed: int = 0, limit: int | None = None,
                   configs="default", oracle=None, oracle_device: str = "auto", name: str | None = None,
                   progress: bool = True, log=None, command: str | None = None, overwrite: bool = False) -> dict:
    """Judge ``configs`` (see :func:`.configs.parse_configs`) on the export ``model`` against its fp32 oracle on
    the tasks of ``data`` (eval's inputs) or on the benchmark's random-id ``workload`` (a shapes file; ``seed``,
    ``limit``); write ``<out>/fidelity_<name>.{json,md,png}`` and ``<out>/oracle_<name>.json``; return the report.
    ``oracle``: an earlier oracle file to start from (today's ORACLE_FORMAT; ``.json`` or gzipped ``.json.gz``);
    ``command``: what the report and the oracle file record as the command. A ``limit`` run into an ``out`` that
    holds a full report of the same name is refused before anything loads unless ``overwrite``
    (:func:`check_report_not_replaced`); the report records ``limit``. See the module docstring."""
    command = command or "hf_openjev.fidelity_check.check_fidelity"
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    parsed, sources, run_name = check_arguments(model=model, out=out, data=data, workload=workload, configs=configs,
                                                oracle=oracle, oracle_device=oracle_device, name=name, limit=limit,
                                                overwrite=overwrite)
    out = Path(out)
    store = AnswerStore(answers_path(out, run_name))  # an earlier run's answers, refused in one line if unreadable
    tasks, invalid = _read_tasks(sources, progress) if data is not None else ([], [])
    if data is not None and not tasks:
        raise UsageError("no valid task in the data" + (f" (first: {invalid[0]['error']})" if invalid else ""))
    started = time.perf_counter()
    bf16, weights = _load_bf16(model, "off", log)
    config = text_model_of(bf16).config
    parsed = {c: options_of(changes, config) for c, changes in parsed.items()}  # over the model's own defaults
    items, rejected = _make_items(bf16, tasks, workload, seed=seed, limit=limit, log=log)
    if not items:
        raise UsageError(f"no request to compare: the contract rejects all {len(rejected)} task(s) (first: "
                         f"{rejected[0]['error']})" if rejected else "no request to compare")
    own_oracle = out / f"oracle_{run_name}.json"
    progress_file, done = _open_oracle([p for p in (oracle, own_oracle) if p is not None], weights, items)
    pending = [item for item in items if item.id not in done]
    placement = _announce_placement(model, bf16, pending, oracle_device, log) if pending else None
    info, reused, entries = run_info(), [], {}

    def answer(config, options, *, loaded=None, load=None):  # into ``entries``: reused from the store, else answered
        # (by ``loaded``, or the model ``load()`` gives) and recorded there; the verdict logged when the oracle has all
        key = answer_key(weights=weights, options=options, info=info, package=package_identity())
        found = store.reuse(config, key, items)
        if found is not None:
            log(f"{config}: {len(found)} answers reused from {store.path} (same weights, options, versions, device"
                + (", commit)" if options is not None else ")"))
            reused.append(config)
        else:
            found = _answer(loaded if load is None else load(), items, fast=options is not None, options=options,
                            desc="B: reference bf16" if config == REFERENCE else config, progress=progress,
                            one_by_one=config == REFERENCE_ONE_BY_ONE)
            store.record(config, key, found)
        entries[config] = found
        line = early_verdict(done, items, entries, config) if config != REFERENCE else None
        if line is not None:
            log(line + " (against the oracle given; the report follows at the end)")

    answer(REFERENCE, None, loaded=bf16)
    for config, options in parsed.items():
        if fp8_mode(options) == "off":
            answer(config, options, loaded=bf16)
    del bf16
    _release_memory()
    oracle_data = _complete_oracle(model, items, done, progress_file, placement, path=own_oracle, name=run_name,
                                   seed=seed, weights=weights, progress=progress, command=command)
    for config, options in parsed.items():
        if fp8_mode(options) != "off":  # its model loaded (quantized) only when its answers are not stored
            answer(config, options, load=lambda o=options: _load_bf16(model, fp8_mode(o), log, hash_it=False)[0])
            _release_memory()
    from .report import judge_against_oracle

    meta = {"command": command, **package_identity(), "versions": info, "device": info["device"], "shape": run_name,
            "model": str(model),
            "seed": seed, "limit": limit, "inputs": {"data": [str(s.path) for s in sources],
                                     "workload": None if workload is None else str(workload)},
            "invalid_tasks": invalid + rejected,
            "oracle": {"path": str(own_oracle), "complete": oracle_data["complete"],
                       "placement": placement.describe() if placement else "nothing to score: reused"},
            "oracle_sha256_check": {"oracle": oracle_data["weights_sha256"], "run": weights["weights_sha256"],
                                    "oracle_stored": oracle_data.get("stored_weights_sha256"),
                                    "run_stored": weights["stored_weights_sha256"], "match": True},
            "configuration_options": {c: describe_options(o) for c, o in parsed.items()},
            "requests_compared": len(items), "answers_reused": reused, "seconds": time.perf_counter() - started}
    return judge_against_oracle(oracle_data, weights_sha256=weights, items=items, entries_by_name=entries,
                                out=out, name=run_name, meta=meta)


def _read_tasks(sources, progress: bool):
    from ..eval.tasks import load_tasks

    return load_tasks(sources, progress=progress,
                      warn=lambda m: print(f"hf-openjev fidelity: {m}", file=sys.stderr, flush=True))


def _load_bf16(model, fp8: str, log, *, hash_it: bool = True):
    """The export in bf16 on the GPU (CPU without one), with ``fp8`` projections when not "off"; and its weights'
    fingerprints (:func:`~hf_openjev.fidelity_check.gate.weights_identity`, before any patch)."""
    import torch

    from ..model import load_export
    from .gate import weights_identity

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    loaded = load_export(model, dtype="bfloat16", device=device, fp8=fp8)
    sha = weights_identity(loaded) if hash_it else None
    log(f"loaded {model} in bf16{'' if fp8 == 'off' else f' with fp8 {fp8}'} on {device} "
        f"({time.perf_counter() - t0:.1f} s)" + (f"; stored weights sha256 {sha['stored_weights_sha256']}" if sha else ""))
    return loaded, sha


def _make_items(model, tasks, workload, *, seed: int, limit, log):
    if workload is None:
        return items_from_tasks(model, tasks[:limit], warn=log)
    from .workload import build_workload

    return items_from_workload(build_workload(workload, vocab=model.config.vocab_size, seed=seed, limit=limit)), []


def _open_oracle(paths, weights: dict, items):
    """(the oracle files' merged content or None, its entries by id), refused (UsageError) when another
    checkpoint's or when a request id has other token ids."""
    from .oracle import check_oracle_progress, read_oracle_progress

    try:
        progress_file = read_oracle_progress(paths)
        done = {} if progress_file is None else check_oracle_progress(
            progress_file, weights_sha256=weights, where=" / ".join(map(str, paths)),
            tokens_sha256={item.id: item.tokens_sha256 for item in items})
    except ValueError as exc:
        raise UsageError(f"refusing the oracle: {exc}") from None
    return progress_file, done


def _announce_placement(model, bf16, pending, oracle_device: str, log):
    """Choose where the fp32 oracle runs; log it and the estimated time."""
    import torch

    from .placement import (
        activation_bytes,
        choose_oracle_placement,
        estimate_oracle_seconds,
        fp32_sizes,
        measure_free_memory,
    )

    layer_bytes, other_bytes = fp32_sizes(model)
    longest = max(len(seq) for item in pending for seq in item.prepared.sequences)
    gpu_free, host_free = measure_free_memory()
    bf16_gpu = sum(p.numel() * p.element_size() for p in bf16.parameters()) if bf16.device.type == "cuda" else 0
    gpu_free = [f + (bf16_gpu if i == 0 else 0) for i, f in enumerate(gpu_free)]  # freed before the oracle loads
    try:
        placement = choose_oracle_placement(requested=oracle_device, layer_bytes=layer_bytes, other_bytes=other_bytes,
                                            activations=activation_bytes(bf16.config, longest), gpu_free=gpu_free,
                                            host_free=host_free)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    tokens = sum(item.prepared.input_tokens for item in pending)
    sequences = sum(len(item.prepared.sequences) for item in pending)
    seconds = estimate_oracle_seconds(placement, tokens=tokens, sequences=sequences, threads=torch.get_num_threads())
    log(f"{placement.describe()}; {len(pending)} requests ({tokens} tokens, {sequences} forwards) to score, "
        f"roughly {_duration(seconds)} (the progress bar shows the measured rate)")
    return placement


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _answer(model, items, *, fast: bool, options=None, desc: str, progress: bool,
            one_by_one: bool = False) -> list[dict]:
    """The entries of one configuration; the fast path on CUDA answers its second pass (warmed up, as measured);
    the reference path runs right-padded batches (``answer_items``' size; ``one_by_one``: one candidate each)."""
    warm_up = fast and model.device.type == "cuda"
    batch = {"batch_size": 1} if one_by_one else {}
    return entries_from_responses(items, answer_items(model, items, fast=fast, options=options, warm_up=warm_up,
                                                      desc=desc, progress=progress, **batch))


def _release_memory() -> None:
    """Give the memory of models no longer referenced back (the caller has dropped its last reference)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _complete_oracle(model, items, done, progress_file, placement, *, path: Path, name: str, seed: int,
                     weights: dict, progress: bool, command: str) -> dict:
    """Score what the oracle lacks (fp32, where ``placement`` says) and return it, written to ``path``."""
    from .oracle import extend_oracle, write_oracle
    from .placement import load_oracle_model

    if progress_file is not None:
        header = {k: v for k, v in progress_file.items()
                  if k not in ("requests", "n_done", "n_total", "complete", "seconds")}
    else:
        header = {"shape": name, "seed": seed, **weights}  # both fingerprints (hf_openjev.fidelity_check.gate.same_weights)
    if placement is None:  # nothing to score: a copy of what the given files hold
        return write_oracle(path, header, done, [item.id for item in items])
    header.update(command=command, device=run_info()["device"], versions=run_info(), placement=placement.describe())
    fp32 = load_oracle_model(model, placement)
    try:
        return extend_oracle(fp32, [(i.id, i.kind, i.prepared) for i in items], path=path, header=header, done=done,
                             progress=progress)
    finally:
        del fp32
        _release_memory()

"""The fp32 oracle of a checkpoint on a list of requests: build it, extend it, resume it (docs/design.md "Numerics").

Exact arithmetic: stock Transformers (no patches) with its own torch code for the Gated DeltaNet and its conv
(fla / causal-conv1d unbound), the weights upcast to fp32, TF32 off, fp32 matmuls at "highest", SDPA's math
backend, one candidate per forward (the reference path with batch 1: no padding).

The file is :mod:`hf_openjev.fidelity_check.gate`'s oracle format (``ORACLE_FORMAT``), so ``recipes/oracle.py``'s files
(``data/bench/oracle_27b.json.gz``) read here and these read there. It carries the stored weights' fingerprint
(``weights_sha256``, :func:`~hf_openjev.fidelity_check.gate.hash_weights` of the bf16 model) and each request's token-id
hash; a file of other weights, or a request id whose tokens differ, is refused with a one-line ``ValueError``.
Requests of other ids are appended; entries of requests not asked for this time are kept. The file is written
atomically (a temporary file, then a rename) after every request, so a killed run keeps what it finished.
Oracles are read from ``.json`` or gzipped ``.json.gz`` files (the name decides:
:func:`~hf_openjev.json_files.read_json_file`) and written as plain ``.json`` unless the path given ends in ``.gz``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..json_files import write_json_text
from .gate import ORACLE_FORMAT, describe_request, hash_tokens, load_oracle, same_weights, short_weights

KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                "causal_conv1d_update")


@contextlib.contextmanager
def exact_numerics():
    """Inside: TF32 off (matmul, cuDNN), fp32 matmuls at "highest", SDPA's math backend, Transformers' own torch
    code for the GDN kernels; yields ``(numerics, kernels)`` (what is in force, the function each kernel name
    runs). Everything is put back on exit, so the bf16 configurations that follow run as a user's would."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    saved_flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                   torch.get_float32_matmul_precision())
    saved_kernels = {name: getattr(qwen, name) for name in KERNEL_NAMES if hasattr(qwen, name)}
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        kernels = {}
        for name, fn in saved_kernels.items():
            fn = getattr(fn, "__wrapped__", fn)  # the hub / package wrapper's torch fallback
            if not fn.__module__.startswith("transformers."):
                raise RuntimeError(f"{name} runs {fn.__module__}.{fn.__qualname__}, not Transformers' torch code")
            setattr(qwen, name, fn)
            kernels[name] = f"{fn.__module__}.{fn.__qualname__}"
        numerics = {"compute_dtype": "float32", "stored_dtype": "bfloat16",
                    "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                    "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
                    "float32_matmul_precision": torch.get_float32_matmul_precision(),
                    "sdpa_backend": "math", "candidates_per_forward": 1}
        with sdpa_kernel([SDPBackend.MATH]):
            yield numerics, kernels
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_flags[:2]
        torch.set_float32_matmul_precision(saved_flags[2])
        for name, fn in saved_kernels.items():
            setattr(qwen, name, fn)


def read_oracle_progress(paths: Iterable[str | Path]) -> dict | None:
    """The existing oracle files among ``paths`` (``.json`` or ``.json.gz``, :func:`~.gate.load_oracle`) merged
    (entries by id, first file first; their runs), once they share one weights fingerprint (else a one-line
    ``ValueError``); None when none exists."""
    unique = {Path(p).resolve(): Path(p) for p in paths if Path(p).is_file()}
    found = [load_oracle(p) for p in unique.values()]
    if not found:
        return None
    progress = dict(found[0])
    done, runs = {}, {}
    for path, other in zip(unique.values(), found):
        if not same_weights(other, progress):
            raise ValueError(f"{path}: an oracle of other weights than {next(iter(unique.values()))}'s")
        for entry in other["requests"]:
            done.setdefault(str(entry["id"]), entry)
        for run in other.get("runs", []):
            runs.setdefault(json.dumps(run, sort_keys=True), run)
    progress["requests"], progress["runs"] = list(done.values()), list(runs.values())
    return progress


def check_oracle_progress(progress: dict, *, weights_sha256: str, tokens_sha256: dict[str, str],
                          where: str = "the oracle") -> dict[str, dict]:
    """The entries of ``progress`` by id, once its weights are these and every entry asked for again has these
    token ids; else a one-line ``ValueError`` (another checkpoint, or other tasks under the same ids)."""
    if not same_weights(progress, weights_sha256):
        raise ValueError(f"{where} is of other weights (sha256 {short_weights(progress)}, this checkpoint's "
                         f"{short_weights(weights_sha256)}): use its own checkpoint or another --out / --oracle")
    done = {}
    for entry in progress["requests"]:
        rid = str(entry["id"])
        if rid in tokens_sha256 and entry.get("tokens_sha256") != tokens_sha256[rid]:
            raise ValueError(f"{where}: request {rid!r} has other token ids than this run's (different tasks under "
                             "the same id); rename the task or use another --out / --oracle")
        done[rid] = entry
    return done


def score_oracle_request(model, request_id: str, kind: str, prepared) -> dict:
    """One request, one candidate per forward, in whatever ``model`` computes (fp32 for the oracle): its entry."""
    import torch

    from ..scoring import build_answer, score_prepared

    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = score_prepared(model, [prepared], fast=False, batch_size=1)
    response = build_answer(model, prepared, result.scores[0], seconds=result.seconds,
                            prefix_cache=result.prefix_cache[0], method="oracle")
    scores = {q.id: list(s) for q, s in zip(prepared.parsed.questions, result.scores[0])}
    return describe_request(request_id, kind, response, tokens_sha256=hash_tokens(prepared.tokens),
                            tokens=prepared.input_tokens, scores=scores, seconds=time.perf_counter() - start)


def write_oracle(path: Path, header: dict, done: dict[str, dict], order: Sequence[str]) -> dict:
    """Write the oracle atomically: the entries of ``order`` first (in that order), then any other ones kept.
    ``n_total`` is the header's when it has one (``recipes/oracle.py``: the whole workload's size), else the
    number of entries; ``complete``: every id of ``order`` is done. Plain JSON, gzipped when ``path`` ends in
    ``.gz`` (:func:`~hf_openjev.json_files.write_json_text`)."""
    ordered = [done[i] for i in order if i in done]
    seen = set(order)
    ordered += [e for i, e in done.items() if i not in seen]
    n_asked = sum(1 for i in order if i in done)
    oracle = {**header, "format": ORACLE_FORMAT, "n_total": header.get("n_total", len(ordered)),
              "n_done": len(ordered), "complete": n_asked == len(order),
              "seconds": sum(float(e.get("seconds", 0.0)) for e in ordered), "requests": ordered}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_text(path, json.dumps(oracle, indent=1))
    return oracle


def extend_oracle(model, items: Sequence[tuple[str, str, object]], *, path: Path, header: dict,
                  done: dict[str, dict], progress: bool = True) -> dict:
    """Score the ``items`` (``(id, kind, PreparedRequest)``) missing from ``done`` with the fp32 ``model`` under
    :func:`exact_numerics`, writing ``path`` after each; returns the oracle as last written. ``header`` gains the
    run's numerics and kernels."""
    from tqdm.auto import tqdm

    order = [rid for rid, _, _ in items]
    todo = [item for item in items if item[0] not in done]
    with exact_numerics() as (numerics, kernels):
        header = {**header, "numerics": numerics, "kernels": kernels}
        header["runs"] = [*header.get("runs", []), {k: header[k] for k in ("command", "device", "versions",
                                                                            "numerics", "kernels", "placement")
                                                        if k in header}]
        oracle = write_oracle(path, header, done, order)
        tokens = sum(p.input_tokens for _, _, p in todo)
        with tqdm(total=tokens, unit="tok", unit_scale=True, desc="fp32 oracle", disable=not progress or not todo,
                  file=sys.stderr) as bar:
            for rid, kind, prepared in todo:
                done[rid] = score_oracle_request(model, rid, kind, prepared)
                oracle = write_oracle(path, header, done, order)
                bar.update(prepared.input_tokens)
    return oracle

"""The fp32 oracle of the decision-fidelity gate (docs/design.md, Numerics): every JevBench request, exact arithmetic.

The bench's random model (``benchlib.random_model.build_model``: bf16 weights, seeded) is hashed as stored
(``hf_openjev.fidelity.hash_weights``), then upcast to fp32 and run by stock Transformers with its own torch code
(fla unbound as in arm A, SDPA's math backend), TF32 off, one candidate per forward (the reference path with
batch size 1: no padding). The workload is the bench's (``build_workload``, same seed, same random ids) on
``--manifest``, by default ``recipes/data/jevbench231-shapes-estimated.json``, on which the committed oracles were
built (the bench's ``--oracle`` runs then use it too).

Writes ``<out>/oracle_<shape>.json`` (hf_openjev.fidelity's oracle format) after every request, atomically, so
a command killed at its time limit keeps what it finished; a later run resumes from that file (or from
``--resume``) after checking shape, seed, weights and token ids. ``--max-seconds`` stops cleanly before a request
whose estimated time would cross the budget, counted from the start of the command (build, hash, upcast included).

  python recipes/oracle.py --shape mid --out recipes/data
  python recipes/oracle.py --shape 27b --out "$OUT" --resume recipes/data/oracle_27b.json --max-seconds 470
  python recipes/oracle.py --shape 27b --out "$OUT/s1" --shard 1/2   # beside --shard 0/2 on another GPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchlib.fla_binding import bind_fla
from benchlib.provenance import command_line, git_commit, versions
from benchlib.random_model import build_model
from benchlib.shapes import SHAPES, VOCAB
from benchlib.workload import ESTIMATED_MANIFEST, add_manifest_argument, build_workload, check_manifest_argument

from hf_openjev.fidelity import (ORACLE_FORMAT, describe_request, hash_tokens, weights_identity,
                                 load_oracle, verify_oracle_identity)

KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                "causal_conv1d_update")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mid", choices=sorted(SHAPES))
    parser.add_argument("--seed", type=int, default=0, help="the model's and the workload's seed (as the bench's)")
    parser.add_argument("--out", required=True, help="folder of oracle_<shape>.json (resumed when it exists)")
    parser.add_argument("--resume", action="append", default=[],
                        help="an earlier oracle_<shape>.json to continue from (repeat it to merge several)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="time budget of the whole command: no request starts unless its estimate fits")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only (smoke runs)")
    add_manifest_argument(parser, default=ESTIMATED_MANIFEST)
    parser.add_argument("--shard", default=None, metavar="K/N",
                        help="score only the requests whose workload index is K modulo N (one process per GPU; a "
                             "last run with every shard's file as --resume merges them)")
    parser.add_argument("--merge-only", action="store_true",
                        help="merge the --resume files (one model's shards) into <out>/oracle_<shape>.json and stop: "
                             "no model is built, so it runs on any machine")
    args = parser.parse_args(argv)
    check_manifest_argument(parser, args)
    if args.merge_only and not args.resume:
        parser.error("--merge-only needs the files to merge as --resume")
    if args.shard is not None:
        k, _, n = args.shard.partition("/")
        if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
            parser.error(f"--shard {args.shard!r}: give K/N with 0 <= K < N, e.g. 0/2")
        args.shard = (int(k), int(n))
    return args


def set_exact_numerics() -> dict:
    """TF32 off everywhere (matmul and cuDNN), fp32 matmuls at "highest"; returns what is now in force."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    return {"compute_dtype": "float32", "stored_dtype": "bfloat16",
            "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "sdpa_backend": "math", "candidates_per_forward": 1}


def unbind_kernels() -> dict[str, str]:
    """Stock Transformers' own torch code for the GDN and its conv (fla / causal-conv1d unbound, as arm A);
    returns the function each name now runs. Raises if one still resolves outside Transformers."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    bind_fla(False)
    used = {}
    for name in KERNEL_NAMES:
        fn = getattr(qwen, name, None)
        if fn is None:
            continue
        fn = getattr(fn, "__wrapped__", fn)  # the hub/package wrapper's torch fallback
        setattr(qwen, name, fn)
        used[name] = f"{fn.__module__}.{fn.__qualname__}"
        if not fn.__module__.startswith("transformers."):
            raise RuntimeError(f"{name} runs {used[name]}, not Transformers' torch code")
    return used


def read_progress(paths: list[Path], *, shape: str, seed: int) -> dict | None:
    """The existing oracle files of ``paths`` merged (entries by id, the runs of each), once they agree on shape,
    seed and weights; None when there is none."""
    unique = {p.resolve(): p for p in paths if p.exists()}
    found = [load_oracle(p) for p in unique.values()]
    if not found:
        return None
    progress = found[0]
    done, runs = {}, {}
    for other in found:
        verify_oracle_identity(other, shape=shape, seed=seed, weights_sha256=progress)
        for entry in other["requests"]:
            done.setdefault(entry["id"], entry)
        for run in other.get("runs", []):
            runs.setdefault(json.dumps(run, sort_keys=True), run)
    progress["requests"], progress["runs"] = list(done.values()), list(runs.values())
    return progress


def check_progress(progress: dict, *, weights_sha256: dict | str, tokens_sha256: dict[str, str]) -> dict[str, dict]:
    """The entries of an earlier run, by id, once its weights and every entry's token ids match this run's."""
    verify_oracle_identity(progress, shape=progress["shape"], seed=progress["seed"], weights_sha256=weights_sha256)
    done = {}
    for entry in progress["requests"]:
        if tokens_sha256.get(entry["id"]) != entry.get("tokens_sha256"):
            raise ValueError(f"request {entry['id']!r}: its token ids differ from this workload's")
        done[entry["id"]] = entry
    return done


def score_request(model, item: dict, prepared) -> dict:
    """One request, one candidate per forward (the reference path, batch 1): its oracle entry."""
    from hf_openjev.scoring import build_answer, score_prepared

    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = score_prepared(model, [prepared], fast=False, batch_size=1)
    response = build_answer(model, prepared, result.scores[0], seconds=result.seconds,
                            prefix_cache=result.prefix_cache[0], method="oracle")
    scores = {q.id: list(s) for q, s in zip(prepared.parsed.questions, result.scores[0])}
    return describe_request(item["id"], item["kind"], response, tokens_sha256=hash_tokens(prepared.tokens),
                            tokens=prepared.input_tokens, scores=scores, seconds=time.perf_counter() - start)


def write_oracle(path: Path, header: dict, done: dict[str, dict], order: list[str]) -> dict:
    """Write the oracle file atomically (a temporary file, then a rename); entries in workload order."""
    entries = [done[i] for i in order if i in done]
    oracle = {**header, "n_done": len(entries), "complete": len(entries) == header["n_total"],
              "seconds": sum(e["seconds"] for e in entries), "requests": entries}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(oracle, indent=1))
    os.replace(tmp, path)
    return oracle


def estimate_seconds(timings: list[tuple[int, float]], tokens: int) -> float:
    """1.5 x this run's seconds per token (its first request, the warm-up, left out when there are others)."""
    measured = timings[1:] or timings
    if not measured:
        return 0.0
    return 1.5 * tokens * sum(s for _, s in measured) / max(1, sum(n for n, _ in measured))


def make_header(args, model, *, weights_sha256: dict, numerics: dict, kernels: dict, n_total: int,
                runs: list) -> dict:
    info = versions()
    run = {"command": command_line(), "git_commit": git_commit(), "device": info["device"],
           "versions": info, "numerics": numerics, "kernels": kernels,
           "attn_implementation": model.backbone.config._attn_implementation,
           "shard": "/".join(map(str, args.shard)) if args.shard else None}
    return {"format": ORACLE_FORMAT, "shape": args.shape, "shape_config": SHAPES[args.shape], "seed": args.seed,
            "vocab": VOCAB, "temperature": model.temperature, **weights_sha256,
            "workload": args.manifest.name, "workload_sha256": hashlib.sha256(args.manifest.read_bytes()).hexdigest(),
            "n_total": n_total, **run, "runs": [*runs, run]}


def main(argv=None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"oracle_{args.shape}.json"
    try:
        missing = [r for r in args.resume if not Path(r).exists()]
        if missing:
            raise ValueError(f"--resume {missing[0]}: no such file")
        progress = read_progress([Path(r) for r in args.resume] + [path], shape=args.shape, seed=args.seed)
    except ValueError as error:
        print(f"refusing to resume: {error}", file=sys.stderr)
        return 2
    if args.merge_only:
        return merge_oracles(progress, path, manifest=args.manifest)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(args.shape, seed=args.seed, device=device, dtype=torch.bfloat16)
    weights_sha256 = weights_identity(model)  # the stored bf16 weights, before the upcast (both fingerprints)
    model.float()
    if device == "cuda":
        torch.cuda.empty_cache()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    numerics, kernels = set_exact_numerics(), unbind_kernels()
    full = build_workload(args.manifest, vocab=VOCAB, seed=args.seed)
    order = [item["id"] for item, _ in full]
    work = full[:args.limit]
    if args.shard is not None:
        work = [w for i, w in enumerate(work) if i % args.shard[1] == args.shard[0]]
    tokens_sha256 = {item["id"]: hash_tokens(p.tokens) for item, p in full}
    try:
        done = check_progress(progress, weights_sha256=weights_sha256, tokens_sha256=tokens_sha256) if progress else {}
    except ValueError as error:
        print(f"refusing to resume: {error}", file=sys.stderr)
        return 2
    header = make_header(args, model, weights_sha256=weights_sha256, numerics=numerics, kernels=kernels,
                         n_total=len(full), runs=progress.get("runs", []) if progress else [])
    oracle = write_oracle(path, header, done, order)
    todo = [(item, p) for item, p in work if item["id"] not in done]
    print(f"oracle {args.shape}: {len(done)} done, {len(todo)} to score; weights sha256 {weights_sha256['weights_sha256']}; "
          f"kernels {kernels}", flush=True)
    stop = run_requests(model, todo, done, path=path, header=header, order=order, start=start,
                        max_seconds=args.max_seconds)
    oracle = write_oracle(path, header, done, order)
    state = ("complete" if oracle["complete"] else f"stopped: {stop}" if stop != "done"
             else "incomplete: --limit / --shard left requests out")
    print(f"{path}: {oracle['n_done']}/{oracle['n_total']} requests, {state}", flush=True)
    return 0


def merge_oracles(progress: dict, path: Path, *, manifest: Path = ESTIMATED_MANIFEST) -> int:
    """Write the union of shards that ``read_progress`` checked to be one model's (shape, seed, weights)."""
    order = [item["id"] for item in json.loads(Path(manifest).read_text())["requests"]]
    header = {k: v for k, v in progress.items() if k not in ("requests", "n_done", "complete", "seconds")}
    header["shard"] = None
    oracle = write_oracle(path, header, {e["id"]: e for e in progress["requests"]}, order)
    print(f"{path}: {oracle['n_done']}/{oracle['n_total']} requests merged, "
          f"{'complete' if oracle['complete'] else 'incomplete'}", flush=True)
    return 0


def run_requests(model, todo, done, *, path, header, order, start, max_seconds) -> str:
    """Score ``todo`` into ``done`` (writing the file after each), within the budget; why it stopped."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from tqdm import tqdm

    timings: list[tuple[int, float]] = []
    with sdpa_kernel([SDPBackend.MATH]), tqdm(total=len(todo), unit="req", desc="oracle", file=sys.stderr,
                                               mininterval=5.0) as bar:
        for item, prepared in todo:
            if max_seconds is not None:
                elapsed = time.monotonic() - start
                if elapsed + estimate_seconds(timings, prepared.input_tokens) > max_seconds:
                    return f"--max-seconds {max_seconds:g}: {elapsed:.0f} s spent, next request {item['id']!r}"
            entry = score_request(model, item, prepared)
            done[item["id"]] = entry
            timings.append((entry["tokens"], entry["seconds"]))
            write_oracle(path, header, done, order)
            bar.update(1)
            bar.set_postfix(tokens_per_s=f"{sum(n for n, _ in timings) / sum(s for _, s in timings):.0f}")
    return "done"


if __name__ == "__main__":
    sys.exit(main())

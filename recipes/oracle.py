"""The fp32 oracle of the decision-fidelity gate (docs/design.md, Numerics): every JevBench request, exact arithmetic.

The bench's random model (``benchlib.random_model.build_model``: bf16 weights, seeded) is hashed as stored
(``hf_openjev.fidelity_check.gate.hash_weights``), then upcast to fp32 and run by stock Transformers with its own torch code
(fla unbound as in arm A, SDPA's math backend), TF32 off, one candidate per forward (the reference path with
batch size 1: no padding). The workload is the bench's (``build_workload``, same seed, same random ids) on
``--manifest``, by default ``data/bench/jevbench231-shapes-estimated.json``, on which the committed oracles were
built (the bench's ``--oracle`` runs then use it too). The numerics, the scoring of a request, the merging and
checking of earlier files and the atomic writes are ``hf-openjev fidelity``'s own
(``hf_openjev.fidelity_check.oracle``); this script adds the bench's model, shards and the time budget.

Writes ``<out>/oracle_<shape>.json`` (hf_openjev.fidelity_check.gate's oracle format) after every request, atomically, so
a command killed at its time limit keeps what it finished; a later run resumes from that file (or from
``--resume``, plain ``.json`` or gzipped ``.json.gz`` like the committed ``data/bench/oracle_<shape>.json.gz``)
after checking shape, seed, weights and token ids. ``--max-seconds`` stops cleanly before a request whose estimated
time would cross the budget, counted from the start of the command (build, hash, upcast included). The committed
oracles are this file gzipped (``gzip -9 -n``: no name or time in the header, so the same JSON gives the same bytes):

  python recipes/oracle.py --shape mid --out "$OUT" && gzip -9 -n -c "$OUT/oracle_mid.json" >data/bench/oracle_mid.json.gz
  python recipes/oracle.py --shape 27b --out "$OUT" --resume data/bench/oracle_27b.json.gz --max-seconds 470
  python recipes/oracle.py --shape 27b --out "$OUT/s1" --shard 1/2   # beside --shard 0/2 on another GPU
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from benchlib.fla_binding import bind_fla
from benchlib.provenance import command_line, git_commit, versions
from benchlib.random_model import build_model
from benchlib.shapes import SHAPES, VOCAB
from benchlib.workload import ESTIMATED_MANIFEST, add_manifest_argument, build_workload, check_manifest_argument

from hf_openjev.fidelity_check.gate import (
    ORACLE_FORMAT,
    hash_tokens,
    load_oracle,
    verify_oracle_identity,
    weights_identity,
)
from hf_openjev.fidelity_check.oracle import (
    check_oracle_progress,
    exact_numerics,
    read_oracle_progress,
    score_oracle_request,
    write_oracle,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mid", choices=sorted(SHAPES))
    parser.add_argument("--seed", type=int, default=0, help="the model's and the workload's seed (as the bench's)")
    parser.add_argument("--out", required=True, help="folder of oracle_<shape>.json (resumed when it exists)")
    parser.add_argument("--resume", action="append", default=[],
                        help="an earlier oracle_<shape>.json or .json.gz to continue from (repeat it to merge several)")
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


def read_progress(paths: list[Path], *, shape: str, seed: int) -> dict | None:
    """The existing oracle files of ``paths`` merged (entries by id, the runs of each), once each is of this shape
    and seed and all are of one model's weights; None when there is none."""
    for path in paths:
        if path.is_file():
            verify_oracle_identity(load_oracle(path), shape=shape, seed=seed)
    return read_oracle_progress(paths)


def check_progress(progress: dict, *, weights_sha256: dict | str, tokens_sha256: dict[str, str]) -> dict[str, dict]:
    """The entries of an earlier run, by id, once its weights are this run's and every entry is a request of this
    workload with the same token ids."""
    done = check_oracle_progress(progress, weights_sha256=weights_sha256, tokens_sha256=tokens_sha256)
    foreign = next((rid for rid in done if rid not in tokens_sha256), None)
    if foreign is not None:
        raise ValueError(f"request {foreign!r} is not a request of this workload")
    return done


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
    bind_fla(False)  # as arm A; exact_numerics then runs Transformers' own torch code for every kernel, or raises
    with exact_numerics() as (numerics, kernels):  # put back on exit
        return score_workload(args, model, progress, path=path, start=start, weights_sha256=weights_sha256,
                              numerics=numerics, kernels=kernels)


def score_workload(args, model, progress: dict | None, *, path: Path, start: float, weights_sha256: dict,
                   numerics: dict, kernels: dict) -> int:
    """Under exact numerics: resume ``progress`` (checked against this workload), score what is left of this
    run's share within the budget, writing ``path`` after each request; the exit status."""
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
    ids = set(order)
    kept = {e["id"]: e for e in progress["requests"] if e["id"] in ids}  # the workload's requests only
    oracle = write_oracle(path, header, kept, order)
    print(f"{path}: {oracle['n_done']}/{oracle['n_total']} requests merged, "
          f"{'complete' if oracle['complete'] else 'incomplete'}", flush=True)
    return 0


def run_requests(model, todo, done, *, path, header, order, start, max_seconds) -> str:
    """Score ``todo`` into ``done`` (writing the file after each), within the budget; why it stopped. Runs inside
    ``exact_numerics`` (SDPA's math backend included)."""
    from tqdm import tqdm

    timings: list[tuple[int, float]] = []
    with tqdm(total=len(todo), unit="req", desc="oracle", file=sys.stderr, mininterval=5.0) as bar:
        for item, prepared in todo:
            if max_seconds is not None:
                elapsed = time.monotonic() - start
                if elapsed + estimate_seconds(timings, prepared.input_tokens) > max_seconds:
                    return f"--max-seconds {max_seconds:g}: {elapsed:.0f} s spent, next request {item['id']!r}"
            entry = score_oracle_request(model, item["id"], item["kind"], prepared)
            done[item["id"]] = entry
            timings.append((entry["tokens"], entry["seconds"]))
            write_oracle(path, header, done, order)
            bar.update(1)
            bar.set_postfix(tokens_per_s=f"{sum(n for n, _ in timings) / sum(s for _, s in timings):.0f}")
    return "done"


if __name__ == "__main__":
    sys.exit(main())

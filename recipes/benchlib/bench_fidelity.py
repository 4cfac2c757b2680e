"""The benchmark's ``--oracle`` run: the oracle checked, this run's weights hashed, each configuration compared
with the fp32 oracle and judged by the fidelity gate against B, with ``hf-openjev fidelity``'s code
(``hf_openjev.fidelity_check``: the same entries, checks, gate and report files)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from benchlib.provenance import git_commit
from benchlib.workload import ESTIMATED_MANIFEST, manifest_identity


def open_oracle(args, parser):
    """--oracle: the oracle file, read and checked against --shape and --seed before any work (None without it).
    Without --manifest the workload is the oracle's (the estimated shapes); a --manifest other than the one the
    oracle was built on is refused."""
    if not args.oracle:
        return None
    from hf_openjev.fidelity_check.gate import load_oracle, verify_oracle_identity

    try:
        oracle = load_oracle(args.oracle)
        verify_oracle_identity(oracle, shape=args.shape, seed=args.seed)
    except (OSError, ValueError) as error:
        parser.error(f"--oracle {args.oracle}: {error}")
    args.manifest = args.manifest or ESTIMATED_MANIFEST
    built_on = oracle.get("workload_sha256")
    if built_on and manifest_identity(args.manifest)["manifest_sha256"] != built_on:
        parser.error(f"--oracle {args.oracle} was built on another workload than --manifest {args.manifest}: "
                     f"drop --manifest (the oracle's is data/bench/{ESTIMATED_MANIFEST.name})")
    return oracle


def start_fidelity(oracle, model, work, *, args, out: Path, results: dict) -> dict | None:
    """Hash this run's weights (as built, before any patch) and refuse (None, a message) unless they are the
    oracle's and the oracle holds every request of ``work`` with the same token ids; else the context
    add_fidelity fills: the oracle, the weights' fingerprints, the requests as fidelity items, the report's meta."""
    from hf_openjev.fidelity_check import items_from_workload, select_oracle_entries
    from hf_openjev.fidelity_check.gate import verify_oracle_identity, weights_identity

    t0 = time.perf_counter()
    weights = weights_identity(model)
    sha = results["weights_sha256"] = weights["weights_sha256"]
    results["stored_weights_sha256"] = weights["stored_weights_sha256"]
    items = items_from_workload(work)
    try:
        verify_oracle_identity(oracle, shape=args.shape, seed=args.seed, weights_sha256=weights)
        select_oracle_entries(oracle, weights_sha256=weights, items=items)  # what add_fidelity judges against
    except ValueError as error:
        print(f"--oracle {args.oracle}: {error}", file=sys.stderr)
        return None
    print(f"weights sha256 {sha} = the oracle's ({time.perf_counter() - t0:.1f} s)", flush=True)
    meta = {"command": results["command"], "versions": results["versions"], "device": results["versions"]["device"],
            "git_commit": git_commit(), "shape": args.shape, "seed": args.seed, "dtype": args.dtype, "fp8": args.fp8,
            "oracle": {"path": str(args.oracle), "complete": oracle.get("complete"), "n_done": len(oracle["requests"]),
                       "git_commit": oracle.get("git_commit"), "device": oracle.get("device")},
            "oracle_sha256_check": {"oracle": oracle["weights_sha256"], "run": sha, "match": True},
            "requests_compared": len(work)}
    return {"oracle": oracle, "weights": weights, "items": items, "entries": {}, "out": out, "meta": meta}


def add_fidelity(fidelity: dict, name: str, responses) -> None:
    """One configuration's answers (one response per request, in workload order) against the oracle; rewrites
    fidelity_<shape>.json/.md/.png with every configuration so far, judged by ``hf-openjev fidelity``'s own back
    end (``hf_openjev.fidelity_check.judge_against_oracle``: the gate against B when the run has B, the decision
    agreement with the oracle)."""
    from hf_openjev.fidelity_check import entries_from_responses, judge_against_oracle

    fidelity["entries"][name] = entries_from_responses(fidelity["items"], responses)
    report = judge_against_oracle(fidelity["oracle"], weights_sha256=fidelity["weights"], items=fidelity["items"],
                                  entries_by_name=fidelity["entries"], out=fidelity["out"],
                                  name=fidelity["meta"]["shape"], meta=fidelity["meta"])
    stats = report["configurations"][name]
    print(f"fidelity {name} vs oracle: max {stats['max_abs_dp']:.4g}, p99 {stats['p99_abs_dp']:.4g}, mean "
          f"{stats['mean_abs_dp']:.4g}, {stats['flips']} flips (+{stats['near_tie_flips']} near-tie); passes "
          f"{stats['passes']}", flush=True)


def configuration_name(name: str, args) -> str:
    """The name of an arm or sweep entry in fidelity_<shape>.json: with --fp8 the fast path's are ``fp8-<mode>``
    (C), ``fp8-<mode>-eager`` (E) and ``fp8-<mode> <sweep entry>``; the reference arms keep theirs (bf16)."""
    if not args.fp8 or name in ("A", "B", "A1", "B1"):
        return name
    return {"C": f"fp8-{args.fp8}", "E": f"fp8-{args.fp8}-eager"}.get(name, f"fp8-{args.fp8} {name}")

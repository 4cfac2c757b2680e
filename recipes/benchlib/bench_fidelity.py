"""The benchmark's ``--oracle`` run: the oracle checked, this run's weights hashed, each configuration compared
with the fp32 oracle and judged by the fidelity gate against B (``hf_openjev.fidelity``)."""

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
    from hf_openjev.fidelity import load_oracle, verify_oracle_identity

    try:
        oracle = load_oracle(args.oracle)
        verify_oracle_identity(oracle, shape=args.shape, seed=args.seed)
    except (OSError, ValueError) as error:
        parser.error(f"--oracle {args.oracle}: {error}")
    args.manifest = args.manifest or ESTIMATED_MANIFEST
    built_on = oracle.get("workload_sha256")
    if built_on and manifest_identity(args.manifest)["manifest_sha256"] != built_on:
        parser.error(f"--oracle {args.oracle} was built on another workload than --manifest {args.manifest}: "
                     f"drop --manifest (the oracle's is recipes/data/{ESTIMATED_MANIFEST.name})")
    return oracle


def start_fidelity(oracle, model, work, *, args, out: Path, results: dict) -> dict | None:
    """Hash this run's weights (as built, before any patch) and refuse (None, a message) unless they are the
    oracle's; else the context add_fidelity fills: the oracle's entries for this run's requests, token hashes."""
    from hf_openjev.fidelity import hash_tokens, select_requests, verify_oracle_identity, weights_identity

    t0 = time.perf_counter()
    weights = weights_identity(model)
    sha = results["weights_sha256"] = weights["weights_sha256"]
    results["stored_weights_sha256"] = weights["stored_weights_sha256"]
    try:
        verify_oracle_identity(oracle, shape=args.shape, seed=args.seed, weights_sha256=weights)
        oracle_requests = select_requests(oracle["requests"], [item["id"] for item, _ in work])
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
    return {"oracle_requests": oracle_requests, "tokens_sha256": [hash_tokens(p.tokens) for _, p in work],
            "stats": {}, "out": out, "meta": meta}


def add_fidelity(fidelity: dict, name: str, work, responses) -> None:
    """One configuration's answers against the oracle; rewrites fidelity_<shape>.json/.md/.png with every
    configuration so far, each judged by the gate against B when the run has B."""
    from hf_openjev.fidelity import build_fidelity_report, compare_with_oracle, describe_request, write_fidelity_report

    entries = [describe_request(item["id"], item["kind"], response, tokens_sha256=tokens)
               for (item, _), response, tokens in zip(work, responses, fidelity["tokens_sha256"])]
    stats = fidelity["stats"][name] = compare_with_oracle(fidelity["oracle_requests"], entries)
    report = build_fidelity_report(fidelity["stats"], **fidelity["meta"])
    write_fidelity_report(fidelity["out"], f"fidelity_{fidelity['meta']['shape']}", report)
    print(f"fidelity {name} vs oracle: max {stats.max_abs_dp:.4g}, p99 {stats.p99_abs_dp:.4g}, mean "
          f"{stats.mean_abs_dp:.4g}, {stats.flips} flips (+{stats.near_tie_flips} near-tie); passes "
          f"{report['configurations'][name]['passes']}", flush=True)


def configuration_name(name: str, args) -> str:
    """The name of an arm or sweep entry in fidelity_<shape>.json: with --fp8 the fast path's are ``fp8-<mode>``
    (C), ``fp8-<mode>-eager`` (E) and ``fp8-<mode> <sweep entry>``; the reference arms keep theirs (bf16)."""
    if not args.fp8 or name in ("A", "B", "A1", "B1"):
        return name
    return {"C": f"fp8-{args.fp8}", "E": f"fp8-{args.fp8}-eager"}.get(name, f"fp8-{args.fp8} {name}")

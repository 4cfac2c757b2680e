"""Join the fidelity reports of several benchmark runs of one shape into one ``fidelity_<shape>.json`` (+ .md, .png).

Each run of ``bench_jevbench.py --oracle`` judges its configurations against the B it measured itself. A run can
hold only one FP8 mode (quantizing is for good), so the table of a shape comes from several runs. This joins them,
and refuses unless they can stand in one table: the same shape, seed, oracle and weights (sha256), and B's
statistics identical in every run (B is deterministic for given weights and requests, so a difference means the
runs did not compare the same thing). Every configuration keeps the gate verdict of its own run and names the run
it came from (``run``, an index into ``runs``: command, git commit, versions, fp8 mode). Per-request figures are
kept to 4 significant digits, the plot's need: a probe's table of a dozen configurations stays a small file.

    python recipes/merge_fidelity.py OUT_DIR RUN1/fidelity_27b.json RUN2/fidelity_27b.json \\
        --rename 1:C=share_tails-off --rename '1:{"min_shared_tokens": 16, "share_tails": true}=default'

``--rename RUN:OLD=NEW`` renames configuration OLD of run RUN (1-based, in the order given); B appears once, and
so does a configuration that several runs answered identically (a probe that reused its stored answers). A report
this recipe wrote is an input too: its runs join the list in their order, so a committed table takes a new run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# what every run must share, besides the oracle check (a bench report names its dtype; the command's runs bf16)
IDENTITY = ("shape", "seed", "dtype")
RUN_KEYS = ("command", "git_commit", "device", "versions", "fp8")
B_STATS = ("n_requests", "n_probabilities", "max_abs_dp", "p99_abs_dp", "mean_abs_dp", "flips", "near_tie_flips",
           "per_request_max_abs_dp")


def parse_renames(items: list[str], n_runs: int) -> dict[tuple[int, str], str]:
    """``RUN:OLD=NEW`` -> {(run index from 0, OLD): NEW}; a ValueError naming the bad item."""
    renames = {}
    for item in items:
        run, sep, rest = item.partition(":")
        old, eq, new = rest.rpartition("=")
        if not (sep and eq and run.isdigit() and 1 <= int(run) <= n_runs and old and new):
            raise ValueError(f"--rename {item!r}: write RUN:OLD=NEW with RUN between 1 and {n_runs}")
        renames[(int(run) - 1, old)] = new
    return renames


def kept_digits(values: list[float]) -> list[float]:
    """Per-request figures to 4 significant digits, the plot's need."""
    return [float(f"{value:.4g}") for value in values]


def same_statistics(a: dict, b: dict) -> bool:
    """Whether two entries of one configuration judged the same answers: every statistic of ``B_STATS`` equal (the
    per-request figures to the digits a merged table keeps)."""
    return all(kept_digits(a[key]) == kept_digits(b[key]) if key == "per_request_max_abs_dp"
               else a.get(key) == b.get(key) for key in B_STATS)


def merge_reports(reports: list[dict], renames: dict[tuple[int, str], str] | None = None) -> dict:
    """One report from several runs' reports (see the module docstring); a ValueError when they cannot be joined
    (another shape, oracle or weights; B differing; a configuration name given twice; a rename of nothing)."""
    renames = dict(renames or {})
    first = reports[0]
    merged = {key: first[key] for key in IDENTITY if key in first}
    merged.update(oracle=first["oracle"], oracle_sha256_check=first["oracle_sha256_check"], gate=first["gate"],
                  requests_compared=first["requests_compared"], runs=[], configurations={})
    for index, report in enumerate(reports):
        for key in IDENTITY:
            if report.get(key) != first.get(key):
                raise ValueError(f"run {index + 1}: {key} {report.get(key)!r} differs from run 1's {first.get(key)!r}")
        check = report["oracle_sha256_check"]
        if not check.get("match") or check["oracle"] != first["oracle_sha256_check"]["oracle"]:
            raise ValueError(f"run {index + 1}: another oracle or weights ({check})")
        if report["gate"] != first["gate"] or report["requests_compared"] != first["requests_compared"]:
            raise ValueError(f"run {index + 1}: another gate or another set of requests than run 1")
        b = report["configurations"].get("B")
        if b is None:
            raise ValueError(f"run {index + 1} has no B: its gate verdicts were judged against nothing")
        if not same_statistics(b, first["configurations"]["B"]):
            raise ValueError(f"run {index + 1}: B's statistics differ from run 1's: the runs did not compare the same "
                             "model on the same requests")
        base = len(merged["runs"])
        if "runs" in report:  # a merged report: its runs, which its entries' "run" indexes
            merged["runs"].extend(report["runs"])
        else:
            merged["runs"].append({key: report.get(key) for key in RUN_KEYS})
        for name, entry in report["configurations"].items():
            if name == "B" and index > 0:
                continue
            new = renames.pop((index, name), name)
            if new in merged["configurations"]:
                if same_statistics(merged["configurations"][new], entry):
                    continue  # the same answers again (a probe reuses stored answers): kept once, from its first run
                raise ValueError(f"configuration {new!r} appears twice (run {index + 1}) with other statistics: "
                                 "rename one (--rename)")
            merged["configurations"][new] = {**entry, "run": base + entry.get("run", 0),
                                             # 231 figures x a dozen configurations: kept small
                                             "per_request_max_abs_dp": kept_digits(entry["per_request_max_abs_dp"])}
    if renames:
        raise ValueError(f"--rename of configurations no run has: {sorted(renames)}")
    used = sorted({entry["run"] for entry in merged["configurations"].values()})  # a run all of whose rows were
    merged["runs"] = [merged["runs"][i] for i in used]  # kept from an earlier one names nothing: dropped
    for entry in merged["configurations"].values():
        entry["run"] = used.index(entry["run"])
    return merged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for fidelity_<shape>.json/.md/.png")
    parser.add_argument("reports", nargs="+", help="fidelity_<shape>.json of each run")
    parser.add_argument("--rename", action="append", default=[], metavar="RUN:OLD=NEW")
    args = parser.parse_args(argv)
    try:
        reports = [json.loads(Path(path).read_text()) for path in args.reports]
        merged = merge_reports(reports, parse_renames(args.rename, len(reports)))
    except (OSError, ValueError, KeyError) as error:
        parser.error(str(error))
    from hf_openjev.fidelity_check.gate import write_fidelity_report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_fidelity_report(out, f"fidelity_{merged['shape']}", merged)
    for name, entry in merged["configurations"].items():
        print(f"{name}: max {entry['max_abs_dp']:.4g}, mean {entry['mean_abs_dp']:.4g}, {entry['flips']} flips "
              f"(+{entry['near_tie_flips']} near-tie), passes {entry['passes']} (run {entry['run'] + 1})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

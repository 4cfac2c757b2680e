"""``hf-openjev fidelity``: the command line over :func:`hf_openjev.fidelity_check.check_fidelity`."""

from __future__ import annotations

import shlex
import sys

from .configs import NAMED_CONFIGS, REFERENCE_ONE_BY_ONE
from .placement import PLACEMENTS


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="merged export directory (from `hf-openjev export`)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", nargs="+", metavar="PATH",
                        help="JevBench task files (.jsonl, .json, .parquet) or dataset directories, as eval reads them")
    source.add_argument("--workload", metavar="SHAPES.json",
                        help="the benchmark's request shapes (data/bench/jevbench231-shapes.json) filled with "
                             "seeded random token ids, as recipes/bench_jevbench.py builds them")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0, the benchmark's)")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="the first N requests only; the report is recorded as limited, and a --limit run into "
                             "an --out holding a full report of the same --name is refused before anything loads "
                             "(pass --overwrite, or another --out or --name)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="fidelity_<name>.json/.md/.png, the oracle, oracle_<name>.json (plain JSON; resumed "
                             "when there), and each configuration's answers, answers_<name>.json (written as each "
                             "finishes; reused when the weights, options, versions and device are the same)")
    parser.add_argument("--name", default=None, help="the <name> of the files (default: the export's folder name)")
    parser.add_argument("--configs", default="default", metavar="LIST",
                        help=f"comma-separated configurations judged against B (the reference path in bf16): "
                             f"{', '.join(NAMED_CONFIGS)}, a FastPathOptions .json file "
                             f"(changes over the model's defaults), or {REFERENCE_ONE_BY_ONE} (B "
                             "again, one candidate per forward: the flips bf16 rounding alone moves; default: default)")
    parser.add_argument("--oracle", default=None, metavar="FILE",
                        help="an earlier oracle file to start from, .json or gzipped .json.gz (e.g. "
                             "data/bench/oracle_27b.json.gz); refused unless its weights fingerprint is this export's")
    parser.add_argument("--oracle-device", default="auto", choices=PLACEMENTS,
                        help="where the fp32 oracle runs: auto (one GPU when it fits, else several, else offloaded "
                             "layer by layer from the host; the CPU without a GPU), cpu, cuda, multi-gpu, offload")
    parser.add_argument("--overwrite", action="store_true",
                        help="let a --limit run replace a full report in --out (a run without --limit always "
                             "writes its report; the oracle file is extended, never truncated)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def run(args) -> int:
    from .report import describe_verdict
    from .run import check_fidelity

    command = "hf-openjev " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    report = check_fidelity(model=args.model, out=args.out, data=args.data, workload=args.workload, seed=args.seed,
                            limit=args.limit, configs=args.configs, oracle=args.oracle,
                            oracle_device=args.oracle_device, name=args.name, progress=args.progress, command=command,
                            overwrite=args.overwrite)
    for config, c in report["configurations"].items():
        print(describe_verdict(config, c))
    print(f"wrote {args.out}/fidelity_{report['shape']}.json, .md, .png")
    return 0

"""``hf-openjev eval``: the command line over :func:`hf_openjev.eval.evaluate.evaluate`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..family import UNKNOWN_SHAPE_HELP
from ..fast_options import FAST_OPTIONS_HELP, fast_options_argument
from ..fp8.option import FP8_CHOICES, FP8_HELP, select_fp8_path
from ..work_tokens import DEFAULT_BATCH_TOKENS


def positive_int(text: str) -> int:
    """``--batch-size``, ``--batch-tokens`` and ``--limit``'s type: an integer of at least 1 (argparse prints the one-line error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="merged export directory (from `hf-openjev export`)")
    parser.add_argument("--data", required=True, nargs="+", metavar="PATH",
                        help="JevBench .jsonl task files, .json/.parquet files or dataset directories")
    parser.add_argument("--out", default="jevbench-eval", metavar="DIR",
                        help="output directory: results.jsonl, summary.json, report.md, reliability.png "
                             "(default: ./jevbench-eval)")
    parser.add_argument("--batch-size", type=positive_int, default=16, metavar="N",
                        help="at most N tasks per forward batch (default 16)")
    parser.add_argument("--batch-tokens", type=positive_int, default=DEFAULT_BATCH_TOKENS, metavar="N",
                        help="at most N tokens per forward batch: the tokens a batch's tasks make the backbone run, "
                             "and the padded size of one reference forward; a bigger task runs alone "
                             f"(default {DEFAULT_BATCH_TOKENS})")
    parser.add_argument("--limit", type=positive_int, default=None, metavar="N",
                        help="score only the first N valid tasks of the inputs, in input order")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="backbone dtype (default: auto = bfloat16)")
    parser.add_argument("--fast", action=argparse.BooleanOptionalAction, default=None,
                        help="force the fast path on/off (default: on for CUDA)")
    parser.add_argument("--fast-options", type=fast_options_argument, default=None, metavar="JSON",
                        help=FAST_OPTIONS_HELP + "; results of other options in --out are not resumed")
    parser.add_argument("--fp8", default="off", choices=FP8_CHOICES,
                        help=FP8_HELP + "; results of another --fp8 mode in --out are not resumed")
    parser.add_argument("--allow-unknown-shape", action="store_true", help=UNKNOWN_SHAPE_HELP)
    parser.add_argument("--no-resume", dest="resume", action="store_false",
                        help="start afresh instead of skipping tasks already in OUT/results.jsonl")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bars (the weights' loading bar included)")


def _nothing_scored(summary: dict, out: Path) -> str:
    """The one-line error of a run that scored no task (every task invalid, or none found)."""
    c = summary["counts"]
    if not c["tasks"]:
        return "no task was scored: the data holds no tasks"
    first = summary["invalid"][0] if summary["invalid"] else None
    example = f" (first: {first['file']}:{first['line']}: {first['error']})" if first else ""
    return (f"no task was scored: all {c['tasks']} task(s) are invalid{example}; the list is in "
            f"{out / 'report.md'}")


def run(args) -> int:
    from ..errors import UsageError
    from .evaluate import evaluate
    from .report import DIAGRAM_NAME, REPORT_NAME, SUMMARY_NAME, _fmt
    from .sharding import close_processes, current_processes
    from .tasks import EvalInputError

    processes = current_processes()
    main = processes.is_main  # under a launcher, rank 0 alone prints (every rank returns the same code)
    try:
        fast = select_fp8_path(args.fp8, args.fast, fp8_flag="--fp8", reference_flag="--no-fast")
        summary = evaluate(model=args.model, data=args.data, out_dir=args.out, batch_size=args.batch_size,
                           fast=fast, device=args.device, dtype=args.dtype, resume=args.resume,
                           progress=args.progress, fp8=args.fp8, allow_unknown_shape=args.allow_unknown_shape,
                           batch_tokens=args.batch_tokens, limit=args.limit, fast_options=args.fast_options)
    except (EvalInputError, UsageError) as exc:
        if main:
            print(f"hf-openjev eval: error: {exc}", file=sys.stderr)
        return 2
    close_processes(processes)  # every rank has passed evaluate's last barrier
    if not summary["counts"]["scored"]:
        if main:
            print(f"hf-openjev eval: error: {_nothing_scored(summary, Path(args.out))}", file=sys.stderr)
        return 2
    if not main:
        return 0
    o, c = summary["overall"], summary["counts"]
    print(f"{c['scored']} tasks scored ({c['invalid']} invalid): accuracy {_fmt(o['accuracy'])}, "
          f"Brier {_fmt(o['brier'])}, ECE {_fmt(o['ece'])}, log loss {_fmt(o['log_loss'])}")
    print(f"wrote {Path(args.out) / SUMMARY_NAME}, {Path(args.out) / REPORT_NAME}, {Path(args.out) / DIAGRAM_NAME}")
    return 0

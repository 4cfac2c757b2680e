"""``hf-openjev quantize --model EXPORT_DIR --out DIR [--fp8 all|no-gdn] [--overwrite]``.

Quantizes a merged bf16 export (``hf-openjev export``) into an FP8 export (``open-jev-text-merged-fp8/1``,
:func:`hf_openjev.fp8.quantize.quantize_export`: e4m3 projections with per-channel scales, everything else bit for
bit), streaming one tensor at a time. Refused before anything is written when the source is not a bf16 merged
export or ``--out`` exists (without ``--overwrite``); nothing is left behind on failure or interrupt.
"""

from __future__ import annotations

import sys


def add_arguments(parser) -> None:
    from .cli import add_fp8_argument

    parser.add_argument("--model", required=True, metavar="DIR", help="the merged bf16 export to quantize")
    parser.add_argument("--out", required=True, metavar="DIR", help="where to write the FP8 export")
    add_fp8_argument(parser, "--fp8", const=None,
                     help="all (default: MLP, attention and Gated DeltaNet projections) or no-gdn (the Gated "
                          "DeltaNet's stay bf16)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it already exists and is an export (holds open_jev_export.json) or "
                             "an empty folder; any other folder is refused")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args) -> int:
    from hf_openjev.checkpoint.fp8_scheme import FP8_MODES

    from ..fp8.quantize import quantize_export
    from .cli import log, sigterm_unwinds

    with sigterm_unwinds():
        report = quantize_export(args.model, args.out, targets=FP8_MODES[args.fp8], overwrite=args.overwrite,
                                 progress=args.progress, log=log)
    for line in report.lines():
        print(line)
    sys.stdout.flush()
    return 0

"""``hf-openjev export --base DIR --package DIR --out DIR [--max-length N] [--overwrite] [--allow-base-mismatch]
[--allow-unknown-shape] [--fp8 [all|no-gdn]]``.

Merges the published package's LoRA adapter into the base model and writes a merged export
(``open-jev-text-merged/1``), then prints what it did and the verification figures (merged tensors against
PEFT's ``merge_and_unload()``, and max |Δscore| / |Δp| of the export against the unmerged reference on probe
requests). Bad inputs are refused before anything is written; nothing is left behind on failure or interrupt.
With ``--fp8`` the merge goes to a temporary directory and ``--out`` is its FP8 export
(``open-jev-text-merged-fp8/1``, ``hf_openjev.fp8.quantize``); ``hf-openjev quantize`` (:mod:`.quantize_cli`) makes
one from an existing merged export.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
from contextlib import contextmanager

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3}
MIN_SHARD_BYTES = 1000**2  # 1 MB: a smaller shard limit is surely a mistake (e.g. "5" for 5 bytes, not 5 GB)


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"123456"`` -> bytes (decimal units, as the 5 GB shard limit); ``ValueError`` for
    anything else."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r}")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def check_shard_size(text) -> int:
    """``--max-shard-size`` in bytes, from 1 MB (:data:`MIN_SHARD_BYTES`) to 5 GB; else a one-line ``UsageError``
    (before anything loads) that names the option and asks for a unit."""
    from ..errors import UsageError
    from .merge import MAX_SHARD_BYTES

    try:
        size = parse_size(text)
    except ValueError:
        size = None
    if size is None or not MIN_SHARD_BYTES <= size <= MAX_SHARD_BYTES:
        what = "is not a size" if size is None else f"means {size:,} bytes"
        raise UsageError(f"--max-shard-size {text} {what}; give {MIN_SHARD_BYTES // 1000**2}MB to "
                         f"{MAX_SHARD_BYTES // 1000**3}GB with its unit, e.g. 2GB or 500MB")
    return size


def add_arguments(parser) -> None:
    from ..family import UNKNOWN_SHAPE_HELP
    from .merge import DEFAULT_PROBE_MAX_PARAMS, MAX_SHARD_BYTES, PROBE_MODES

    parser.add_argument("--base", required=True, metavar="DIR",
                        help="the Qwen3.5 base model directory (config.json, safetensors, tokenizer)")
    parser.add_argument("--package", required=True, metavar="DIR",
                        help="the published Open-Jev package (holding checkpoint/)")
    parser.add_argument("--out", required=True, metavar="DIR", help="where to write the merged export")
    parser.add_argument("--max-length", type=int, default=4096, metavar="N",
                        help="longest candidate sequence the export accepts, 1..16384 (default 4096)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it already exists and is an export (holds open_jev_export.json) or "
                             "an empty folder; any other folder is refused")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the verification (PEFT comparison and score probe)")
    parser.add_argument("--probe", choices=PROBE_MODES, default="auto",
                        help="score probe against the unmerged reference on CPU in fp32: auto (only for backbones "
                             f"up to --probe-max-params, default {DEFAULT_PROBE_MAX_PARAMS:,}), on, off")
    parser.add_argument("--probe-max-params", type=int, default=DEFAULT_PROBE_MAX_PARAMS, metavar="N",
                        help="largest backbone (parameters) the automatic score probe runs on")
    parser.add_argument("--max-shard-size", default=f"{MAX_SHARD_BYTES // 1000**3}GB", metavar="SIZE",
                        help="largest output shard with its unit (decimal: 1GB = 10^9 bytes), e.g. 2GB or 500MB; "
                             "1MB to 5GB (default 5GB); a bare number is bytes, so '5' is refused")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.add_argument("--allow-base-mismatch", action="store_true",
                        help="export even when the package names another base model (repo id, revision or weight "
                             "fingerprint) than --base; the report then warns that the answers may mean nothing")
    parser.add_argument("--allow-unknown-shape", action="store_true", help=UNKNOWN_SHAPE_HELP)
    add_fp8_argument(parser, "--fp8", const="all",
                     help="write an FP8 export instead (e4m3 projections, per-channel scales; the merge goes to a "
                          "temporary directory first): all (default) or no-gdn (the Gated DeltaNet's projections "
                          "stay bf16). Opt-in: serving it about halves the weights and is faster than bf16, but it "
                          "does not pass the fidelity gate against the fp32 oracle (figures: recipes/RESULTS.md)")


def add_fp8_argument(parser, flag: str, *, const: str | None, help: str) -> None:
    """The FP8 mode flag: ``all`` or ``no-gdn`` (``hf_openjev.checkpoint.fp8_scheme.FP8_MODES`` other than ``off``)."""
    parser.add_argument(flag, nargs="?" if const else None, const=const, default=None if const else "all",
                        choices=["all", "no-gdn"], metavar="MODE", help=help)


@contextmanager
def sigterm_unwinds():
    """SIGTERM (e.g. a job scheduler) unwinds like Ctrl-C inside the block, so temporary directories are removed."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        def _terminate(signum, frame):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def log(message: str) -> None:
    print(message, flush=True)


def run(args) -> int:
    max_shard_bytes = check_shard_size(args.max_shard_size)  # before any file is read
    from .merge import merge_lora

    options = dict(max_length=args.max_length, overwrite=args.overwrite, verify=args.verify, probe=args.probe,
                   probe_max_params=args.probe_max_params, progress=args.progress,
                   max_shard_bytes=max_shard_bytes, log=log, allow_base_mismatch=args.allow_base_mismatch,
                   allow_unknown_shape=args.allow_unknown_shape)
    with sigterm_unwinds():
        if args.fp8 is None:
            lines = merge_lora(args.base, args.package, args.out, **options).lines()
        else:
            from hf_openjev.checkpoint.fp8_scheme import FP8_MODES

            from .merge_fp8 import merge_and_quantize

            merged, quantized = merge_and_quantize(args.base, args.package, args.out,
                                                   targets=FP8_MODES[args.fp8], **options)
            lines = [*merged.lines(), f"export: the merge above was temporary (removed); the FP8 export "
                     f"(--fp8 {args.fp8}) is {quantized.out_dir}", *quantized.lines()]
    for line in lines:
        print(line)
    sys.stdout.flush()
    return 0

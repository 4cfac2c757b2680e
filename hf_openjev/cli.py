"""``hf-openjev``: a thin command line over keyword-only functions.

Subcommands: ``demo``, ``export``, ``quantize``, ``eval``, ``serve``, ``fidelity``. Each lives in its own module,
which exposes ``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them up.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys

from .errors import CheckpointError, InputFileError, RequestError, UsageError

COMMANDS = {
    "demo": ("hf_openjev.demo.cli", "answer a few requests with a tiny random checkpoint the package builds itself"),
    "export": ("hf_openjev.export.cli", "merge the LoRA adapter into a merged checkpoint"),
    "quantize": ("hf_openjev.export.quantize_cli", "quantize a merged export's projections to FP8 (opt-in)"),
    "eval": ("hf_openjev.eval.cli", "evaluate a merged export on JevBench-style tasks"),
    "serve": ("hf_openjev.serve.cli", "serve a merged export over HTTP (Jev-compatible API)"),
    "fidelity": ("hf_openjev.fidelity_check.cli",
                 "judge fast-path configurations against the fp32 oracle on your own checkpoint and tasks"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (so ``hf-openjev export`` never loads the server)."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="hf-openjev", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hf-openjev {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # only this command's module is imported
    args = build_parser(command if command in COMMANDS else None).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (CheckpointError, InputFileError, RequestError, UsageError) as exc:
        print(f"hf-openjev {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hf-openjev {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        print(f"hf-openjev {args.command}: error: the disk is full{where} ({exc.strerror}); free space or write "
              "elsewhere, then run the command again", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

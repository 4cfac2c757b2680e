"""The benchmark's workload: the 231 JevBench requests' token shapes (a manifest) filled with seeded random ids.

Two manifests live in ``data/bench``: ``jevbench231-shapes.json``, the exact shapes under the real Qwen3.5
tokenizer (the default), and ``jevbench231-shapes-estimated.json``, the earlier estimate at 4 characters a token,
on which the committed fp32 oracles (and so every ``--oracle`` fidelity comparison) were built.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

from benchlib.shapes import VOCAB
from hf_openjev.fidelity_check.workload import build_workload  # noqa: F401  (the bench's random-id workload; re-exported)

DATA = Path(__file__).resolve().parents[2] / "data" / "bench"
MANIFEST = DATA / "jevbench231-shapes.json"  # exact token shapes (real tokenizer): the benchmark's default
ESTIMATED_MANIFEST = DATA / "jevbench231-shapes-estimated.json"  # 4 chars a token: the fp32 oracles' workload


def add_manifest_argument(parser: argparse.ArgumentParser, *, default: Path | None = MANIFEST) -> None:
    """--manifest: the token-shape file the workload is built from."""
    shown = default.name if default is not None else "the oracle's workload, else " + MANIFEST.name
    parser.add_argument("--manifest", type=Path, default=default,
                        help=f"token shapes of the workload's requests (default: data/bench/{shown}; "
                             f"{ESTIMATED_MANIFEST.name} is the fp32 oracles' estimated workload)")


def check_manifest(path: Path) -> str | None:
    """None when ``path`` is a readable manifest, else a one-line reason for the user."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        return f"cannot read {path}: {error.strerror or error}"
    except json.JSONDecodeError as error:
        return f"{path} is not JSON: {error}"
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list) or not data["requests"]:
        return f"{path} has no requests list (see data/bench/{MANIFEST.name} for the format)"
    return None


def manifest_identity(path: Path) -> dict:
    """``{"manifest": file name, "manifest_sha256": ...}`` for a result file."""
    return {"manifest": Path(path).name, "manifest_sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}


def single_candidate_request(tokens: int):
    """One noul question with one candidate of ``tokens`` random ids (seeded by the length)."""
    from hf_openjev.contract import parse_request
    from hf_openjev.scoring import PreparedRequest

    parsed = parse_request({"state": "x", "questions": {"q": {"type": "noul", "instructions": "x"}}})
    rng = random.Random(tokens)
    return PreparedRequest(parsed, [[[rng.randrange(1000, VOCAB) for _ in range(tokens)]]])


def check_manifest_argument(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The parser's usage error, before any work, when ``args.manifest`` (if given) is not a readable manifest."""
    problem = check_manifest(args.manifest) if args.manifest is not None else None
    if problem:
        parser.error(f"--manifest: {problem}")

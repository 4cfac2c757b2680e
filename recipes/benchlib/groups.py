"""The kind x longest-candidate bucket table of a pass, and the same table beside the native server's group means.

The native server's figures live in ``data/bench/native-server-groups.json`` with their source and protocol.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

BUCKETS = [(1, 128), (129, 512), (513, 2048), (2049, 4096), (4097, 16384)]
NATIVE_FILE = Path(__file__).resolve().parents[2] / "data" / "bench" / "native-server-groups.json"


def longest_tokens(item: dict) -> int:
    """A manifest item's longest sequence in tokens: its shared prefix and its longest candidate's own tokens."""
    return item["prefix_tokens"] + max(item["suffix_tokens"])


def bucket_of(n_tokens: int) -> str:
    for lo, hi in BUCKETS:
        if lo <= n_tokens <= hi:
            return f"{lo}-{hi}"
    return ">16384"


def table(work, times_ms) -> dict:
    """``"kind|lo-hi"`` -> {n, mean_ms} of ``times_ms`` (one per work item), by the longest candidate's tokens."""
    groups: dict[tuple[str, str], list[float]] = {}
    for (item, _), t in zip(work, times_ms):
        groups.setdefault((item["kind"], bucket_of(longest_tokens(item))), []).append(t)
    return {f"{k}|{b}": {"n": len(v), "mean_ms": statistics.fmean(v)} for (k, b), v in sorted(groups.items())}


def load_native_groups(path: Path = NATIVE_FILE) -> dict:
    """The native server's published figures: ``groups[kind][bucket]`` ({n, mean_ms}), ``overall``, source."""
    return json.loads(Path(path).read_text())


def native_comparison_lines(arms: dict[str, dict], *, native: dict | None = None) -> list[str]:
    """Markdown: each arm's kind x bucket means (``arms[arm]["table"]``, as ``table`` makes it) and its overall
    mean / p50 / p95 in columns beside the native server's; a group an arm did not run shows ``-``."""
    native = native or load_native_groups()
    names = list(arms)
    lines = ["", "## beside the native server (ms per request; its figures: "
             f"{native['protocol']}; source: data/bench/{NATIVE_FILE.name})", "",
             "| kind | bucket | n | native | " + " | ".join(f"arm {a}" for a in names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for kind, buckets in native["groups"].items():
        for bucket, group in buckets.items():
            cells = [arms[a]["table"].get(f"{kind}|{bucket}") for a in names]
            lines.append(f"| {kind} | {bucket} | {group['n']} | {group['mean_ms']:.2f} | "
                         + " | ".join("-" if c is None else f"{c['mean_ms']:.2f} (n {c['n']})" for c in cells) + " |")
    for key in ("mean_ms", "p50_ms", "p95_ms"):
        label = key.removesuffix("_ms")
        lines.append(f"| all | {label} | {native['overall']['n']} | {native['overall'][key]:.2f} | "
                     + " | ".join(f"{arms[a][key]:.2f} (n {arms[a]['n']})" for a in names) + " |")
    return lines

"""Write the package's GEMM cost table (``hf_openjev/packing/gemm_costs.py``) from ``gemm_sweep.py`` outputs.

    python recipes/gemm_sweep.py --shape 27b --step 16 --repeats 3 --out results/gemm_sweep   # on an H200
    python recipes/gemm_sweep.py --shape 9b --step 16 --repeats 3 --out results/gemm_sweep
    python recipes/gemm_sweep.py --shape 2b --step 16 --repeats 3 --out results/gemm_sweep
    python recipes/bucket_table.py results/gemm_sweep/gemm_sweep_27b.json results/gemm_sweep/gemm_sweep_9b.json \\
        results/gemm_sweep/gemm_sweep_2b.json                   # rewrites hf_openjev/packing/gemm_costs.py
    python recipes/bucket_table.py SWEEP.json --out /tmp/costs.py  # elsewhere (a check)

Each sweep gives one entry: its shape name (``27b``, ``9b``, ``2b``), the Open-Jev shape tuple of that name
(``hf_openjev.family``: what a loaded model's config is matched against), the sweep's row step and the measured
milliseconds of one forward's GEMMs at rows ``step, 2 step, ...`` (its first BLAS library; the sweep must be on
one regular grid from ``step``). The fast path pads a pack's last level to the cheapest measured row count within
a window (``hf_openjev/packing/bucket_policy.py``); a shape with no entry keeps the fixed token steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hf_openjev.family import MEMBERS

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "hf_openjev" / "packing" / "gemm_costs.py"
HEADER = '''"""Measured GEMM cost of one forward by row count, per Open-Jev shape: what graph buckets are chosen from.

Written by ``recipes/bucket_table.py`` from ``recipes/gemm_sweep.py`` outputs (do not edit by hand; run the recipe).
``GEMM_COSTS[name]``: ``(shape, step, ms)``: the model shape tuple (``hf_openjev.family.ModelShape``), the row step,
and the milliseconds at rows ``step, 2 step, ...``.
"""

from __future__ import annotations

# sources (the sweeps' commands):
'''


def read_sweep(path) -> tuple[str, int, list[float], str]:
    """``(shape name, row step, ms per row count, command)`` of one ``gemm_sweep.py`` JSON; ValueError when its rows
    are not one regular grid from its step."""
    data = json.loads(Path(path).read_text())
    first = next(iter(data["libraries"].values()))
    times = {int(rows): float(ms) for rows, ms in first["ms"].items()}
    rows = sorted(times)
    if not rows:
        raise ValueError(f"{path}: the sweep timed no row count; run gemm_sweep.py again")
    step = rows[0]
    if rows != list(range(step, step * len(rows) + 1, step)):
        raise ValueError(f"{path}: rows are not one grid of step {step} from {step}; sweep with one --step")
    return data["shape"], step, [times[r] for r in rows], data.get("command", "")


def shape_of_name(name: str) -> tuple[int, ...]:
    """The shape tuple of the family member ``name`` (``"27b"``) names; ValueError for a shape no member has."""
    for member in MEMBERS:
        if member.size == name:
            return tuple(member.shape)
    raise ValueError(f"shape {name!r} is no Open-Jev model's ({', '.join(m.size for m in MEMBERS)}); sweep one of those")


def render_table(entries: dict[str, tuple[tuple[int, ...], int, list[float]]], sources: list[str]) -> str:
    """The text of ``gemm_costs.py``: ``GEMM_COSTS`` with ms rounded to 0.01, 12 figures a line."""
    lines = [HEADER.rstrip("\n")] + [f"# - {source}" for source in sources] + ["GEMM_COSTS = {"]
    for name, (shape, step, ms) in entries.items():
        lines.append(f"    {name!r}: ({shape!r}, {step}, (")
        for at in range(0, len(ms), 12):
            lines.append("        " + " ".join(f"{value:.2f}," for value in ms[at: at + 12]))
        lines.append("    )),")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", help="gemm_sweep.py JSON files, one per shape")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="the table to write (default: the package's)")
    args = parser.parse_args(argv)
    entries, sources = {}, []
    for path in args.sweeps:
        name, step, ms, command = read_sweep(path)
        if name in entries:
            parser.error(f"two sweeps of shape {name}: pass one per shape")
        entries[name] = (shape_of_name(name), step, ms)
        sources.append(f"{name}: {step}..{step * len(ms)} rows: {command}")
    Path(args.out).write_text(render_table(entries, sources))
    print(f"wrote {args.out}: " + ", ".join(f"{n} ({len(e[2])} rows)" for n, e in entries.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

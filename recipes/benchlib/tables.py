"""A recipe's result as ``<name>.json`` and a one-table ``<name>.md``."""

from __future__ import annotations

import json
from pathlib import Path


def save_table(out: Path, name: str, result: dict, title: str, columns: list[str], rows: list[list]) -> str:
    """Write ``<name>.json`` (the result) and ``<name>.md`` (title, command, versions, one table); return the md."""
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# {title}", "", f"Command: `{result['command']}`", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    (out / f"{name}.md").write_text(text)
    return text

"""Reading the JSON files of exports and packages (a leaf: the manifest and the FP8 scheme both read them)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import CheckpointError


def read_json_object(path: Path, what: str | None = None) -> dict:
    """A JSON file that must hold an object; ``what`` names it in the errors."""
    suffix = f" ({what})" if what else ""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing{suffix}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object{suffix}")
    return data

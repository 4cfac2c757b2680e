"""The merged-export manifest ``open_jev_export.json``: format ``open-jev-text-merged/1`` (bf16), or
``open-jev-text-merged-fp8/1`` (an FP8 export, ``hf_openjev.fp8.quantize``: the same fields plus ``quantization``).

Reading validates every field and raises :class:`CheckpointError` with a message that says what to fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import GET_CHECKPOINT_DOCS, CheckpointError
from ..json_files import read_json_object  # re-exported: callers import it from here

TEST_CHECKPOINT_KEY = "test_checkpoint"  # in model.json and open_jev_export.json: true for test checkpoints

MANIFEST_NAME = "open_jev_export.json"
EXPORT_FORMAT = "open-jev-text-merged/1"
MAX_LENGTH_LIMIT = 16384


@dataclass(frozen=True)
class ExportManifest:
    """The fields of ``open_jev_export.json`` (docs/checkpoints.md "Merged export")."""

    model_id: str
    base_revision: str
    checkpoint_revision: str
    temperature: float
    max_length: int
    chat_prefix: str
    chat_suffix: str
    head_weight: tuple[float, ...]  # [hidden]
    head_bias: float
    format: str = EXPORT_FORMAT
    # ``sha256-sampled-v1:<hex>``: a fingerprint of the base weights the export was merged from (written by
    # ``hf-openjev export``, see ``hf_openjev.export.identity.base_fingerprint``); "" for exports made before it.
    base_fingerprint: str = ""
    # an FP8 export's ``quantization`` entry (hf_openjev.checkpoint.fp8_scheme.manifest_block: scheme, layout, modules, ...);
    # None for a bf16 export
    quantization: dict | None = field(default=None, hash=False)
    # true for a checkpoint built for tests (hf_openjev.checkpoint.tiny): its shape is not checked against the family
    # (hf_openjev.family); written only when true
    test_checkpoint: bool = False

    def to_json(self) -> dict:
        data = asdict(self)
        data["head_weight"] = list(self.head_weight)
        order = ["format", "model_id", "base_revision", "base_fingerprint", "checkpoint_revision", "temperature",
                 "max_length", "chat_prefix", "chat_suffix", "head_weight", "head_bias", "quantization",
                 "test_checkpoint"]
        if not self.base_fingerprint:  # an older export reads and hashes as it always did
            order.remove("base_fingerprint")
        if self.quantization is None:  # a bf16 export too
            order.remove("quantization")
        if not self.test_checkpoint:
            order.remove("test_checkpoint")
        return {key: data[key] for key in order}


def check_max_length(max_length) -> int:
    """``max_length`` must be an integer in 1..16384 (docs/checkpoints.md)."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or not 1 <= max_length <= MAX_LENGTH_LIMIT:
        raise CheckpointError(f"max_length must be an integer in 1..{MAX_LENGTH_LIMIT}, got {max_length!r}")
    return max_length


def check_temperature(temperature) -> float:
    """The calibration temperature must be a finite positive number."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise CheckpointError(f"temperature must be a number, got {temperature!r}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise CheckpointError(f"temperature must be finite and positive, got {temperature!r}")
    return float(temperature)


def check_head(weight, bias, hidden_size: int | None = None) -> tuple[tuple[float, ...], float]:
    """The scalar head: ``hidden`` finite floats and one finite bias."""
    if not isinstance(weight, (list, tuple)) or not weight:
        raise CheckpointError("head_weight must be a non-empty list of floats")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in weight):
        raise CheckpointError("head_weight must contain only numbers")
    if hidden_size is not None and len(weight) != hidden_size:
        raise CheckpointError(
            f"the head has {len(weight)} inputs but the backbone's hidden size is {hidden_size}; "
            "the head and the backbone come from different models"
        )
    if not all(math.isfinite(v) for v in weight):
        raise CheckpointError("head_weight contains non-finite values (NaN or infinity); the head is corrupt")
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
        raise CheckpointError(f"head_bias must be a finite number, got {bias!r}")
    return tuple(float(v) for v in weight), float(bias)


def _not_an_export(export_dir: Path) -> str:
    """Why ``export_dir`` (no manifest in it) is not an export, what it looks like instead, and what to do."""
    head = f"{export_dir} is not a complete merged Open-Jev export"
    if (export_dir / "checkpoint" / "model.json").is_file() or (
            (export_dir / "model.json").is_file() and (export_dir / "adapter").is_dir()):
        return (f"{head}: it is a published Open-Jev package; export it first with `hf-openjev export --base "
                f"BASE_DIR --package {export_dir} --out EXPORT_DIR` and pass EXPORT_DIR")
    make = "make one with `hf-openjev export --base DIR --package DIR --out DIR`"
    try:
        model_type = json.loads((export_dir / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    if model_type == "qwen3_5":  # an export always holds a qwen3_5_text config
        return f"{head}: it looks like a Qwen3.5 base model (config.json model_type 'qwen3_5'); {make}"
    return f"{head} ({make})"


def check_export_dir(export_dir: str | Path) -> Path:
    """The one check that a path is a merged export directory, shared by the loaders, the pipeline, ``eval`` and
    ``serve``: a missing path, a file, a published package or a base model directory each get a message saying
    what to pass instead. Returns the manifest's path (not yet validated)."""
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        what = "it does not exist" if not export_dir.exists() else "it is a file"
        raise CheckpointError(f"{export_dir} is not a directory ({what}); pass the directory of a merged export "
                              "made by `hf-openjev export` (a local directory, not a Hub repo id: download the package and its "
                              f"base, then export them; {GET_CHECKPOINT_DOCS} says how)")
    path = export_dir / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {_not_an_export(export_dir)}")
    return path


def read_manifest(export_dir: str | Path) -> ExportManifest:
    """Read and validate ``<export_dir>/open_jev_export.json`` (after :func:`check_export_dir`); an FP8 export's
    ``quantization`` entry is checked against its ``config.json`` and kept in ``.quantization``."""
    from .fp8_scheme import FP8_EXPORT_FORMAT, read_fp8_quantization

    path = check_export_dir(export_dir)
    data = read_json_object(path)
    fmt = data.get("format")
    if fmt not in (EXPORT_FORMAT, FP8_EXPORT_FORMAT):
        raise CheckpointError(f"{path}: unknown format {fmt!r}; this version reads {EXPORT_FORMAT!r} and "
                              f"{FP8_EXPORT_FORMAT!r}")
    quantization = None
    if fmt == FP8_EXPORT_FORMAT:
        read_fp8_quantization(export_dir)  # the manifest's entry and config.json's quantization_config agree
        quantization = dict(data["quantization"])
    required = ["model_id", "temperature", "max_length", "chat_prefix", "chat_suffix", "head_weight", "head_bias"]
    missing = [key for key in required if key not in data]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}; re-run the export")
    for key in ("model_id", "chat_prefix", "chat_suffix"):
        if not isinstance(data[key], str):
            raise CheckpointError(f"{path}: {key} must be a string")
    weight, bias = check_head(data["head_weight"], data["head_bias"])
    test_checkpoint = data.get("test_checkpoint", False)
    if not isinstance(test_checkpoint, bool):
        raise CheckpointError(f"{path}: test_checkpoint must be true or false, got {test_checkpoint!r}")
    return ExportManifest(
        model_id=data["model_id"],
        base_revision=str(data.get("base_revision", "")),
        base_fingerprint=str(data.get("base_fingerprint", "")),
        checkpoint_revision=str(data.get("checkpoint_revision", "")),
        temperature=check_temperature(data["temperature"]),
        max_length=check_max_length(data["max_length"]),
        chat_prefix=data["chat_prefix"],
        chat_suffix=data["chat_suffix"],
        head_weight=weight,
        head_bias=bias,
        format=fmt,
        quantization=quantization,
        test_checkpoint=test_checkpoint,
    )


def write_manifest(export_dir: str | Path, manifest: ExportManifest) -> Path:
    """Write the manifest (the last file of an export)."""
    path = Path(export_dir) / MANIFEST_NAME
    path.write_text(json.dumps(manifest.to_json(), ensure_ascii=False, indent=1), encoding="utf-8")
    return path

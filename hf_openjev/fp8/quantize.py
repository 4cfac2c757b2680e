"""Quantize a merged bf16 export into an FP8 export (``open-jev-text-merged-fp8/1``), streaming.

What :func:`quantize_export` writes (the scheme: :mod:`hf_openjev.checkpoint.fp8_scheme`):

- for every targeted projection ``<m>.weight`` [N, K]: ``<m>.weight`` as F8_E4M3 and ``<m>.weight_scale`` F32
  [N, 1], computed by :func:`hf_openjev.ops.fp8_linear.quantize_weight_per_channel` (the same rounding the op uses);
- every other tensor bit for bit, same name, dtype and shape; the same shard files (names kept; an index when the
  source has one, listing the scales too);
- ``config.json`` with a compressed-tensors ``quantization_config`` added (nothing else changed), the other files
  of the source (tokenizer, chat template) byte for byte, and ``open_jev_export.json`` last: the source manifest
  with ``format`` = ``open-jev-text-merged-fp8/1`` and a ``quantization`` entry.

Streaming: one source shard at a time, one tensor at a time, and a quantized weight in blocks of rows (per-channel
scales make rows independent), so the peak memory is about ``_CHUNK_BYTES`` of fp32 work, whatever the model.
Each weight's dequantization error (relative, Frobenius) is measured on the way; above 2^-4 (what e4m3 rounding
can cause) the export fails. The export is built in a temporary directory beside the target and renamed at the
end; on any failure nothing is left behind.

``hf-openjev export --fp8`` merges into a temporary bf16 export first, then quantizes it into the target
(:func:`hf_openjev.export.merge_fp8.merge_and_quantize`).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.files import base_weight_files
from ..checkpoint.fp8_scheme import (
    ALL_TARGETS,
    FP8_EXPORT_FORMAT,
    SOURCE_FORMAT,
    manifest_block,
    manifest_format,
    quantization_config,
    resolve_targets,
    target_of,
)
from ..checkpoint.manifest import MANIFEST_NAME, read_json_object, read_manifest
from ..checkpoint.out_dir import check_free_space, check_replaceable, missing_parents, remove_empty
from ..checkpoint.publish import claim_export_temp, put_back_interrupted_swap, put_in_place
from ..checkpoint.safetensors_stream import TORCH_DTYPE, TensorFileReader, TensorFileWriter, tensor_nbytes
from ..errors import CheckpointError

_CHUNK_BYTES = 64 * 1024**2  # fp32 work per block of rows; bytes per piece of a copied tensor
_INDEX_NAME = "model.safetensors.index.json"
_MAX_WEIGHT_ERROR = 2.0**-4  # e4m3 rounds each element by at most 2^-4 of itself (subnormals: far less in norm)


@dataclass(frozen=True)
class _Tensor:
    name: str  # in the source and the output
    dtype: str  # safetensors dtype of the source
    shape: tuple[int, ...]
    module: str | None  # the target suffix when quantized, else None

    @property
    def scale_name(self) -> str:
        return self.name[: -len("weight")] + "weight_scale"

    def outputs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        if self.module is None:
            return [(self.name, self.dtype, self.shape)]
        return [(self.name, "F8_E4M3", self.shape), (self.scale_name, "F32", (self.shape[0], 1))]


@dataclass(frozen=True)
class _Shard:
    filename: str
    tensors: tuple[_Tensor, ...]

    def outputs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        return [out for t in self.tensors for out in t.outputs()]


@dataclass
class _Plan:
    src_dir: Path
    out_dir: Path
    modules: tuple[str, ...]
    shards: list[_Shard]
    manifest: dict  # the source manifest, as read
    config: dict  # the source config.json, as read
    other_files: list[Path]
    indexed: bool  # the source has model.safetensors.index.json


@dataclass
class Fp8ExportReport:
    """What :func:`quantize_export` did. ``os.fspath(report)`` is the FP8 export directory."""

    out_dir: Path
    modules: tuple[str, ...]  # quantized module suffixes
    shards: list[tuple[str, int]]  # (file name, bytes on disk)
    quantized: list[str]  # tensor names stored as e4m3 (+ a weight_scale each)
    copied: int  # tensors copied bit for bit
    source_bytes: int  # the source shards' size on disk
    max_weight_error: float = 0.0  # largest ||dequantized - original|| / ||original|| over the quantized weights
    worst_weight: str = ""
    seconds: float = 0.0

    def __fspath__(self) -> str:
        return str(self.out_dir)

    def lines(self) -> list[str]:
        size = sum(s for _, s in self.shards)
        return [
            f"fp8: {self.out_dir} ({len(self.shards)} shard{'s' if len(self.shards) != 1 else ''}, {size / 1e9:.3f} GB "
            f"from {self.source_bytes / 1e9:.3f} GB, {self.seconds:.1f} s)",
            f"fp8: {len(self.quantized)} weights in e4m3 with per-channel scales ({', '.join(self.modules)}); "
            f"{self.copied} tensors copied bit for bit",
            f"fp8: largest weight error {self.max_weight_error:.3e} (relative, Frobenius) in {self.worst_weight}",
        ]


# --------------------------------------------------------------------------------------------------------------
# The plan: every check before anything is written


def _check_source(src_dir: Path) -> tuple[dict, dict]:
    """(manifest, config) of a merged bf16 export; refuses anything else, an FP8 export first of all."""
    fmt = manifest_format(src_dir)
    if fmt == FP8_EXPORT_FORMAT:
        raise CheckpointError(f"{src_dir} is already an FP8 export ({FP8_EXPORT_FORMAT}); quantize the bf16 merged "
                              "export it was made from")
    read_manifest(src_dir)  # a merged export (format open-jev-text-merged/1), every field valid
    manifest = read_json_object(src_dir / MANIFEST_NAME)
    config = read_json_object(src_dir / "config.json", "the model config")
    if config.get("model_type") != "qwen3_5_text":
        raise CheckpointError(f"{src_dir / 'config.json'}: model_type {config.get('model_type')!r} is not "
                              "'qwen3_5_text'; the export is damaged")
    if "quantization_config" in config:
        raise CheckpointError(f"{src_dir / 'config.json'} already has a quantization_config; FP8 export reads a bf16 "
                              f"merged export ({SOURCE_FORMAT}) only")
    return manifest, config


def _check_out_dir(out_dir: Path, src_dir: Path, overwrite: bool) -> None:
    out, src = out_dir.resolve(), src_dir.resolve()
    if out == src or src in out.parents or out in src.parents:
        raise CheckpointError(f"--out {out_dir} would overlap the source export {src_dir}; choose another directory")
    check_replaceable(out_dir, overwrite)  # an export or an empty directory only


def _plan_shards(src_dir: Path, modules: tuple[str, ...]) -> list[_Shard]:
    shards, seen, matched = [], {}, set()
    for path in base_weight_files(src_dir):
        with TensorFileReader(path) as reader:
            entries = reader.entries
        tensors = []
        for name, (dtype, shape, _, _) in entries.items():
            if dtype.startswith("F8") or name.endswith(("_scale", "weight_packed", "_zero_point")):
                raise CheckpointError(f"{path}: tensor {name} ({dtype}) is already quantized; FP8 export reads a "
                                      f"bf16 merged export ({SOURCE_FORMAT}) only")
            if name in seen:
                raise CheckpointError(f"{src_dir}: tensor {name} is in both {seen[name]} and {path.name}")
            seen[name] = path.name
            module = target_of(name, modules)
            if module is not None and (len(shape) != 2 or dtype not in TORCH_DTYPE or 0 in shape):
                raise CheckpointError(f"{path}: {name} is {dtype} {list(shape)}, not a 2-D float weight; "
                                      "it cannot be quantized per channel")
            matched.add(module)
            tensors.append(_Tensor(name, dtype, shape, module))
        shards.append(_Shard(path.name, tuple(tensors)))
    missing = [m for m in modules if m not in matched]
    if missing:
        raise CheckpointError(f"{src_dir}: no weight matches the FP8 targets {missing}; is this a Qwen3.5 export?")
    return shards


def plan_quantize_export(src_dir, out_dir, *, targets: Iterable[str] | str = ALL_TARGETS,
                         overwrite: bool = False) -> _Plan:
    """Every check of :func:`quantize_export` without writing anything (raises :class:`CheckpointError`)."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    modules = resolve_targets(targets)
    manifest, config = _check_source(src_dir)
    _check_out_dir(out_dir, src_dir, overwrite)
    shards = _plan_shards(src_dir, modules)
    skip = {MANIFEST_NAME, "config.json", _INDEX_NAME}
    other = sorted(p for p in src_dir.iterdir() if p.is_file() and p.name not in skip
                   and not p.name.endswith(".safetensors"))
    need = sum(tensor_nbytes(d, s) for shard in shards for _, d, s in shard.outputs())
    check_free_space(out_dir, need, "the FP8 export")
    return _Plan(src_dir, out_dir, modules, shards, manifest, config, other, (src_dir / _INDEX_NAME).is_file())


# --------------------------------------------------------------------------------------------------------------
# Writing


def _quantize_tensor(reader: TensorFileReader, writer: TensorFileWriter, t: _Tensor) -> float:
    """Quantize one [N, K] weight in blocks of rows into the writer; returns its relative (Frobenius) error."""
    from hf_openjev.ops.fp8_linear import dequantize_weight, quantize_weight_per_channel

    n, k = t.shape
    step = max(1, _CHUNK_BYTES // (4 * k))
    err_sq = ref_sq = 0.0
    for start in range(0, n, step):
        w = reader.rows(t.name, start, min(n, start + step))  # [rows, K] as stored
        if not torch.isfinite(w).all():
            raise CheckpointError(f"{reader.path}: {t.name} holds NaN or infinite values; the export is corrupt")
        w_fp8, scale = quantize_weight_per_channel(w)  # [rows, K] e4m3, [rows, 1] fp32
        writer.write(t.name, w_fp8)
        writer.write(t.scale_name, scale)
        w32 = w.float()
        err_sq += (dequantize_weight(w_fp8, scale) - w32).double().pow(2).sum().item()
        ref_sq += w32.double().pow(2).sum().item()
    return (err_sq / ref_sq) ** 0.5 if ref_sq > 0 else 0.0


def _copy_tensor(reader: TensorFileReader, writer: TensorFileWriter, t: _Tensor) -> None:
    for piece in reader.pieces(t.name, _CHUNK_BYTES):
        writer.write(t.name, piece)


def _write_shard(plan: _Plan, shard: _Shard, tmp: Path, report: Fp8ExportReport) -> None:
    writer = TensorFileWriter(tmp / shard.filename, shard.outputs())
    try:
        with TensorFileReader(plan.src_dir / shard.filename) as reader:
            for t in shard.tensors:
                if t.module is None:
                    _copy_tensor(reader, writer, t)
                    report.copied += 1
                    continue
                error = _quantize_tensor(reader, writer, t)
                report.quantized.append(t.name)
                if error > report.max_weight_error or not report.worst_weight:
                    report.max_weight_error, report.worst_weight = error, t.name
                if not error <= _MAX_WEIGHT_ERROR:
                    raise CheckpointError(f"quantizing {t.name} moved it by {error:.3e} (relative), more than e4m3 "
                                          f"rounding can ({_MAX_WEIGHT_ERROR}); not writing a broken FP8 export")
        report.shards.append((shard.filename, writer.finish()))
    except BaseException:
        writer.abort()
        raise


def _write_text_files(plan: _Plan, tmp: Path, quantized: int) -> None:
    if plan.indexed or len(plan.shards) > 1:
        weight_map = {name: s.filename for s in plan.shards for name, _, _ in s.outputs()}
        total = sum(tensor_nbytes(d, sh) for s in plan.shards for _, d, sh in s.outputs())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / _INDEX_NAME).write_text(json.dumps(index, indent=1), encoding="utf-8")
    for path in plan.other_files:
        shutil.copyfile(path, tmp / path.name)
    config = dict(plan.config, quantization_config=quantization_config(plan.modules))
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    manifest = {"format": FP8_EXPORT_FORMAT, **{k: v for k, v in plan.manifest.items() if k != "format"},
                "quantization": manifest_block(plan.modules, quantized)}
    (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, ensure_ascii=False, indent=1), encoding="utf-8")  # last


def _check_written(plan: _Plan, tmp: Path) -> None:
    """Re-read every written header with safetensors itself: names, dtypes and shapes as planned."""
    from ..checkpoint.files import read_safetensors_headers

    for shard in plan.shards:
        want = {name: (tuple(shape), dtype) for name, dtype, shape in shard.outputs()}
        if read_safetensors_headers(tmp / shard.filename) != want:
            raise RuntimeError(f"{shard.filename}: the written header does not match the plan")


def quantize_export(src_dir, out_dir, *, targets: Iterable[str] | str = ALL_TARGETS, overwrite: bool = False,
                    progress: bool = True, log: Callable[[str], None] | None = None) -> Fp8ExportReport:
    """Quantize the merged bf16 export ``src_dir`` into an FP8 export at ``out_dir`` (see the module docstring).

    ``targets``: group names ``mlp``, ``attention``, ``gdn`` and/or module suffixes (``mlp.down_proj``); the
    default quantizes every projection the scheme allows, ``hf_openjev.checkpoint.fp8_scheme.GDN_IN_BF16`` keeps the Gated
    DeltaNet's in bf16. Raises :class:`CheckpointError` before writing anything on a source that is not a bf16
    merged export (an FP8 export included), an existing ``out_dir`` without ``overwrite``, or unknown targets."""
    say = log or (lambda _message: None)
    start = time.perf_counter()
    put_back_interrupted_swap(Path(out_dir), say=say, what="fp8")  # a killed --overwrite's old export, first
    plan = plan_quantize_export(src_dir, out_dir, targets=targets, overwrite=overwrite)
    out_dir = plan.out_dir
    report = Fp8ExportReport(out_dir=out_dir, modules=plan.modules, shards=[], quantized=[], copied=0,
                             source_bytes=sum((plan.src_dir / s.filename).stat().st_size for s in plan.shards))
    created = missing_parents(out_dir)
    claim = None
    try:
        claim = claim_export_temp(out_dir, say=say, what="fp8")
        tmp = claim.path
        from tqdm import tqdm

        say(f"fp8: quantizing {', '.join(plan.modules)} in {len(plan.shards)} shard(s) into {tmp}")
        for shard in tqdm(plan.shards, desc="fp8: quantizing shards", unit="shard", disable=not progress,
                          file=sys.stderr):
            _write_shard(plan, shard, tmp, report)
        _check_written(plan, tmp)
        _write_text_files(plan, tmp, len(report.quantized))
        put_in_place(claim, out_dir, overwrite=overwrite, refuse=lambda: CheckpointError(
            f"{out_dir} appeared while exporting; pass overwrite=True to replace it"))
        claim = None
    except BaseException:
        if claim is not None:
            claim.discard()
        remove_empty(created)
        raise
    report.seconds = time.perf_counter() - start
    return report

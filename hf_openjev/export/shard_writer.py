"""The merged export's safetensors shards: how the tensors are cut into shards, the writer that streams each planned
tensor straight into its shard, and the re-read of the written headers (docs/checkpoints.md "Merged export").

Every tensor is bf16, so a shard's header is known before its first byte: :func:`plan_shards` cuts the ordered
tensors into shards of at most ``max_shard_bytes`` (one ``model.safetensors``, or ``model-0000i-of-0000n``),
:class:`ShardWriter` writes them in that order (a tensor whole, or as flat bf16 pieces; through the package's one
safetensors writer, ``checkpoint.safetensors_stream.TensorFileWriter``) and the index
``model.safetensors.index.json`` when there are several, and :func:`check_written_shards` reads the headers back.
A planned tensor is anything with ``name``, ``shape`` and ``nbytes`` (:class:`PlannedTensor`); the export's plan
(:mod:`hf_openjev.export.merge`) supplies them.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..checkpoint.files import read_safetensors_headers
from ..checkpoint.safetensors_stream import TensorFileWriter
from ..errors import CheckpointError

_HEADER_SLACK = 256  # bytes reserved per shard for the header's fixed part


class PlannedTensor(Protocol):
    """One output tensor: its name in the shard, its shape, its size in bytes as bf16."""

    name: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class Shard:
    """One output file and the tensors it holds, in write order."""

    filename: str
    items: tuple[PlannedTensor, ...]

    @property
    def data_bytes(self) -> int:
        return sum(item.nbytes for item in self.items)


def plan_shards(items: list[PlannedTensor], max_shard_bytes: int) -> list[Shard]:
    """Cut ``items`` (in order) into shards whose files stay within ``max_shard_bytes``, header included (a tensor
    larger than the limit gets a shard of its own)."""
    groups: list[list[PlannedTensor]] = []
    current: list[PlannedTensor] = []
    used = _HEADER_SLACK
    for item in items:
        cost = item.nbytes + len(item.name) + 96  # data + this tensor's header entry (upper bound)
        if current and used + cost > max_shard_bytes:
            groups.append(current)
            current, used = [], _HEADER_SLACK
        current.append(item)
        used += cost
    if current:
        groups.append(current)
    n = len(groups)
    if n == 1:
        return [Shard("model.safetensors", tuple(groups[0]))]
    return [Shard(f"model-{i:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups, start=1)]


class ShardWriter:
    """Writes the planned shards in order, one tensor at a time, straight to disk: each shard through
    :class:`~hf_openjev.checkpoint.safetensors_stream.TensorFileWriter` (the one safetensors writer), checked here
    against the plan's order, shapes and bf16."""

    def __init__(self, out_dir: Path, shards: list[Shard]):
        if sys.byteorder != "little":
            raise CheckpointError("export needs a little-endian host (safetensors stores little-endian data)")
        self.out_dir = out_dir
        self.shards = shards
        self.index = -1
        self.file: TensorFileWriter | None = None
        self.pending: list[PlannedTensor] = []
        self.sizes: list[tuple[str, int]] = []

    def _open_next(self) -> None:
        self._close()
        self.index += 1
        shard = self.shards[self.index]
        self.file = TensorFileWriter(self.out_dir / shard.filename,
                                     [(item.name, "BF16", tuple(item.shape)) for item in shard.items])
        self.pending = list(shard.items)

    def write(self, name: str, data) -> None:
        """Write the next planned tensor: a bf16 tensor of the planned shape, or an iterable of flat bf16 chunks."""
        if not self.pending:
            self._open_next()
        item = self.pending.pop(0)
        if isinstance(data, torch.Tensor):
            if item.name != name or tuple(data.shape) != item.shape or data.dtype != torch.bfloat16:
                raise RuntimeError(f"export writer out of order: expected {item.name} {item.shape} bf16, "
                                   f"got {name} {tuple(data.shape)} {data.dtype}")
            data = [data.reshape(-1)]
        elif item.name != name:
            raise RuntimeError(f"export writer out of order: expected {item.name}, got {name}")
        written = 0
        for chunk in data:
            if chunk.dtype != torch.bfloat16:
                raise RuntimeError(f"export writer: {name} chunk is {chunk.dtype}, not bf16")
            self.file.write(name, chunk)
            written += chunk.numel() * 2
        if written != item.nbytes:
            raise RuntimeError(f"export writer: {name} got {written} bytes, planned {item.nbytes}")

    def _close(self) -> None:
        if self.file is not None:
            if self.pending:
                raise RuntimeError(f"export writer: {len(self.pending)} tensors of {self.file.path.name} not written")
            self.sizes.append((self.file.path.name, self.file.finish()))
            self.file = None

    def finish(self) -> list[tuple[str, int]]:
        self._close()
        if self.index != len(self.shards) - 1:
            raise RuntimeError("export writer: not every planned shard was written")
        if len(self.shards) > 1:
            weight_map = {item.name: shard.filename for shard in self.shards for item in shard.items}
            index = {"metadata": {"total_size": sum(s.data_bytes for s in self.shards)},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        return self.sizes

    def abort(self) -> None:
        if self.file is not None:
            self.file.abort()
            self.file = None


def check_written_shards(shards: list[Shard], out_dir: Path, max_shard_bytes: int) -> None:
    """Re-read the written headers: every planned tensor present, bf16, right shape; shard sizes within limit."""
    for shard in shards:
        path = out_dir / shard.filename
        size = path.stat().st_size
        if size > max_shard_bytes and len(shard.items) > 1:
            raise RuntimeError(f"{shard.filename} is {size} bytes, over the {max_shard_bytes}-byte shard limit")
        headers = read_safetensors_headers(path)
        want = {item.name: (item.shape, "BF16") for item in shard.items}
        if headers != want:
            raise RuntimeError(f"{shard.filename}: written header does not match the plan")


def sync_directory(path: Path) -> None:
    """fsync a directory, so that the names written in it survive a crash (a no-op where that is unsupported)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

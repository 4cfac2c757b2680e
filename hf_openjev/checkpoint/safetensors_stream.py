"""Reading and writing safetensors files piece by piece, in any dtype (the FP8 export's I/O).

:class:`TensorFileReader` reads byte ranges of one tensor with plain reads (no memory map, whose touched pages
would stay resident until the file closes). :class:`TensorFileWriter` writes a header planned up front and then
each tensor's bytes at its planned offset, in any order across tensors and in order within a tensor, so a
tensor and a value derived from it (an fp8 weight and its scales) can be written as they are computed while the
file keeps the data aligned: tensors are laid out by element size, largest first, so every tensor starts at a
multiple of its element size.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path

import torch

from ..errors import CheckpointError

ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
TORCH_DTYPE = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F16": torch.float16,
               "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def tensor_nbytes(dtype: str, shape) -> int:
    return math.prod(int(d) for d in shape) * ITEMSIZE[dtype]


class TensorFileReader:
    """One safetensors file, read a byte range at a time. ``entries[name] = (dtype, shape, begin, end)``."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.file = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        try:
            (length,) = struct.unpack("<Q", self.file.read(8))
            header = json.loads(self.file.read(length))
        except Exception as exc:
            self.file.close()
            raise CheckpointError(f"{self.path} is not a readable safetensors file: {exc}") from exc
        self.data_start = 8 + length
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
            if dtype not in ITEMSIZE or end - begin != tensor_nbytes(dtype, shape):
                self.file.close()
                raise CheckpointError(f"{self.path}: tensor {name} ({dtype} {list(shape)}) has {end - begin} bytes "
                                      "of data; the file is corrupt")
            self.entries[name] = (dtype, shape, begin, end)

    def read(self, name: str, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """``nbytes`` bytes of tensor ``name`` from byte ``offset`` within it (default: to its end), as uint8."""
        _, _, begin, end = self.entries[name]
        nbytes = end - begin - offset if nbytes is None else nbytes
        if offset < 0 or nbytes < 0 or begin + offset + nbytes > end:
            raise ValueError(f"{self.path}: bytes {offset}..{offset + nbytes} are outside tensor {name}")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        self.file.seek(self.data_start + begin + offset)
        done = 0
        while done < nbytes:
            n = self.file.readinto(view[done:])
            if not n:
                raise CheckpointError(f"{self.path} ends inside tensor {name}; the file is truncated")
            done += n
        return buffer

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, in its stored dtype and shape (a float8/16/32/64 or bf16 one)."""
        dtype, shape, _, _ = self.entries[name]
        return self.read(name).view(TORCH_DTYPE[dtype]).reshape(shape)

    def pieces(self, name: str, chunk_bytes: int):
        """The tensor's bytes as uint8 pieces of at most ``chunk_bytes`` (whole elements, at least one), read one
        at a time: a copy's peak memory is one piece, not the tensor."""
        dtype, _, begin, end = self.entries[name]
        step = max(1, chunk_bytes // ITEMSIZE[dtype]) * ITEMSIZE[dtype]
        for offset in range(0, end - begin, step):
            yield self.read(name, offset, min(step, end - begin - offset))

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a 2-D float tensor, in its stored dtype: [stop - start, K]."""
        dtype, shape, _, _ = self.entries[name]
        row_bytes = shape[1] * ITEMSIZE[dtype]
        data = self.read(name, start * row_bytes, (stop - start) * row_bytes)
        return data.view(TORCH_DTYPE[dtype]).reshape(stop - start, shape[1])

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TensorFileWriter:
    """Writes one safetensors file whose tensors ``[(name, dtype, shape), ...]`` are known up front.

    :meth:`write` appends bytes to one tensor (each tensor's pieces in order); :meth:`finish` checks that every
    tensor got exactly its bytes, then flushes, fsyncs and closes."""

    def __init__(self, path: Path, tensors: list[tuple[str, str, tuple[int, ...]]]):
        if sys.byteorder != "little":
            raise CheckpointError("writing safetensors needs a little-endian host")
        self.path = Path(path)
        order = sorted(range(len(tensors)), key=lambda i: (-ITEMSIZE[tensors[i][1]], i))  # aligned by element size
        header: dict = {"__metadata__": {"format": "pt"}}
        self.offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for i in order:
            name, dtype, shape = tensors[i]
            nbytes = tensor_nbytes(dtype, shape)
            self.offsets[name] = (offset, offset + nbytes)
            offset += nbytes
        for name, dtype, shape in tensors:  # the header lists tensors in the caller's order
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": list(self.offsets[name])}
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)
        self.data_start = 8 + len(blob)
        self.data_bytes = offset
        self.written = {name: 0 for name in self.offsets}
        self.file = open(self.path, "wb")  # noqa: SIM115 - closed in finish()/abort()
        self.file.write(struct.pack("<Q", len(blob)))
        self.file.write(blob)

    def write(self, name: str, data: torch.Tensor) -> None:
        """Append ``data`` (any dtype; its raw bytes) to tensor ``name``."""
        begin, end = self.offsets[name]
        raw = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        at = begin + self.written[name]
        if at + raw.numel() > end:
            raise RuntimeError(f"{self.path.name}: {name} got more than its {end - begin} planned bytes")
        if raw.numel():
            self.file.seek(self.data_start + at)
            self.file.write(memoryview(raw.numpy()))
        self.written[name] += raw.numel()

    def finish(self) -> int:
        """Check, flush, fsync, close; returns the file's size in bytes."""
        short = [n for n, (b, e) in self.offsets.items() if self.written[n] != e - b]
        if short:
            self.abort()
            raise RuntimeError(f"{self.path.name}: tensors not completely written: {short[:3]}")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return self.path.stat().st_size

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()

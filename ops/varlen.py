"""Host-side metadata for a packed (varlen) batch.

The CUDA ops never synchronise with the host, so everything whose *shape* depends on the sequence lengths
(fla's chunk indices) or that is a Python int (max lengths) is built here, once per batch, from the lengths
the planner already knows on the host; so are fla's chunk offsets, which its kernels would otherwise derive on
the device at every call (every layer). Pass the results to the ops; under CUDA-graph replay, copy them into
the captured static buffers (same N, same number of chunks C, same total T).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

CHUNK_SIZE = 64  # fla's GDN chunk size; the conv kernel uses the same chunking


@dataclass(frozen=True)
class VarlenMetadata:
    cu_seqlens: torch.Tensor  # [N+1] int32 on `device`: sequence i is tokens cu[i]:cu[i+1]
    chunk_indices: torch.Tensor  # [C, 2] int32 on `device`: rows (sequence i, chunk j within i)
    chunk_offsets: torch.Tensor  # [N+1] int64 on `device`: the first chunk of sequence i (C at the end)
    max_seqlen: int  # longest sequence (host int, for flash attention)
    lengths: tuple[int, ...]  # per-sequence lengths (host)

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_indices.shape[0])


def chunk_indices_from_lengths(lengths: Sequence[int], chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """[C, 2] int32 (CPU): for every chunk of every sequence, (sequence index, chunk index within it).

    Same content as fla's ``prepare_chunk_indices`` (C = sum of ceil(len / chunk_size); a zero-length sequence
    has no chunk).
    """
    rows = [(i, j) for i, n in enumerate(lengths) for j in range((int(n) + chunk_size - 1) // chunk_size)]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)


def chunk_offsets_from_lengths(lengths: Sequence[int], chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """[N+1] int64 (CPU): the index of each sequence's first chunk in ``chunk_indices_from_lengths`` order, then C.

    Same content and dtype as fla's ``prepare_chunk_offsets`` (a cumulative sum of ceil(len / chunk_size) from 0).
    """
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + (int(n) + chunk_size - 1) // chunk_size)
    return torch.tensor(offsets, dtype=torch.long)


def prepare_varlen_metadata(
    cu_seqlens_cpu: Sequence[int] | torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
    device: torch.device | str | None = None,
) -> VarlenMetadata:
    """Build the per-batch metadata on the host (run before the forward; this is where the host work is)."""
    cu = [int(c) for c in (cu_seqlens_cpu.tolist() if isinstance(cu_seqlens_cpu, torch.Tensor) else cu_seqlens_cpu)]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing with N+1 >= 2 entries, got {cu}")
    lengths = tuple(b - a for a, b in zip(cu, cu[1:]))
    device = torch.device(device) if device is not None else torch.device("cpu")
    return VarlenMetadata(
        cu_seqlens=torch.tensor(cu, dtype=torch.int32).to(device),
        chunk_indices=chunk_indices_from_lengths(lengths, chunk_size).to(device),
        chunk_offsets=chunk_offsets_from_lengths(lengths, chunk_size).to(device),
        max_seqlen=max(lengths),
        lengths=lengths,
    )

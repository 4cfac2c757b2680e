"""ops.varlen metadata (what the CUDA kernels need precomputed) and the no-fla/no-triton import rule."""

import subprocess
import sys

import pytest
import torch

from hf_openjev.ops.varlen import chunk_indices_from_lengths, chunk_offsets_from_lengths, prepare_varlen_metadata


def test_metadata_from_cu_seqlens():
    meta = prepare_varlen_metadata([0, 1, 65, 65, 193], chunk_size=64)
    assert meta.lengths == (1, 64, 0, 128) and meta.max_seqlen == 128
    assert meta.cu_seqlens.dtype == torch.int32 and meta.cu_seqlens.tolist() == [0, 1, 65, 65, 193]
    assert meta.chunk_indices.dtype == torch.int32
    assert meta.chunk_indices.tolist() == [[0, 0], [1, 0], [3, 0], [3, 1]]  # the empty sequence has no chunk
    assert meta.num_chunks == 4


def test_chunk_count_is_sum_of_ceil():
    lengths = [1, 63, 64, 65, 300, 7]
    rows = chunk_indices_from_lengths(lengths)
    assert rows.shape == (sum((n + 63) // 64 for n in lengths), 2)
    assert rows[:, 0].bincount().tolist() == [(n + 63) // 64 for n in lengths]


def test_accepts_a_tensor_and_rejects_bad_input():
    assert prepare_varlen_metadata(torch.tensor([0, 3, 5])).lengths == (3, 2)
    for bad in ([1, 3], [0, 5, 3], [0]):
        with pytest.raises(ValueError):
            prepare_varlen_metadata(bad)


def test_importing_the_ops_imports_neither_fla_nor_triton():
    code = (
        "import sys, torch; had_triton = 'triton' in sys.modules; import hf_openjev.ops; "
        "assert hasattr(torch.ops.hf_openjev, 'gdn_prefill'); "
        "assert 'fla' not in sys.modules; assert ('triton' in sys.modules) == had_triton; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_chunk_offsets_start_each_sequences_chunks():
    meta = prepare_varlen_metadata([0, 1, 65, 65, 193], chunk_size=64)
    assert meta.chunk_offsets.dtype == torch.int64 and meta.chunk_offsets.tolist() == [0, 1, 2, 2, 4]
    rows = meta.chunk_indices.tolist()
    for i, first in enumerate(meta.chunk_offsets[:-1].tolist()):  # each sequence's chunks start at its offset
        own = [r for r in rows if r[0] == i]
        assert own == rows[first: first + len(own)]
    assert chunk_offsets_from_lengths([]).tolist() == [0]

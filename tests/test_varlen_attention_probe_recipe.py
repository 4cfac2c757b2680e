"""recipes/varlen_attention_probe.py on the CPU (a smoke run: the references of the two ops, no CUDA kernel) and its
stand-in for stock's padded batch against the per-sequence reference."""

import json

import torch
from repo_data import load_recipe


def test_the_probe_compares_each_kernel_with_the_dense_call_and_writes_its_table(tmp_path):
    recipe = load_recipe("varlen_attention_probe")
    assert recipe.main(["--shape", "tiny", "--levels", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "varlen_attention_tiny.json").read_text())
    assert [row["lengths"] for row in result["levels"]] == [[107], [40] * 5]
    for row in result["levels"]:
        assert set(row["kernels"]) == {"dense", "fa2_varlen"}  # the CUDA-only kernels are not tried on a CPU
        assert row["kernels"]["dense"]["equal_to_dense"] == 1.0 and row["kernels"]["dense"]["max_diff_dense"] == 0
        assert 0 <= row["kernels"]["fa2_varlen"]["max_diff_fp32"] < 0.05  # bf16 outputs of unit-scale values
    assert "| 5 x 40 | fa2_varlen |" in (tmp_path / "varlen_attention_tiny.md").read_text()


def test_stocks_padded_batch_and_the_varlen_stand_ins_give_each_sequences_causal_attention():
    """In fp32 on a CPU (SDPA's math kernel), B's padded batch, the head repeat for GQA and the packed reference
    agree with one causal call per sequence: the probe compares kernels, not layouts."""
    recipe = load_recipe("varlen_attention_probe")
    lengths = (5, 9, 3)
    q, k, v, cu = recipe.level_inputs(lengths, 4, 2, 8, torch.device("cpu"), seed=0)
    q, k, v = q.float(), k.float(), v.float()
    want = recipe.dense(q, k, v, cu, lengths, 0.3)
    assert torch.allclose(recipe.stock(q, k, v, cu, lengths, 0.3), want, atol=1e-5)
    assert torch.allclose(recipe.fa2_varlen(q, k, v, cu, lengths, 0.3), want, atol=1e-5)
    assert recipe.repeat_heads(k, 4).shape == (17, 4, 8) and torch.equal(recipe.repeat_heads(k, 4)[:, 1], k[:, 0])


def test_the_dense_call_and_stocks_batch_take_their_bounds_from_the_host():
    """``dense`` and ``stock`` read no device tensor to find the sequences (a device read or a pageable copy fails a
    CUDA-graph capture, as both did on an H100 in s22), so they answer without the cumulative lengths at all."""
    recipe = load_recipe("varlen_attention_probe")
    lengths = (4, 1, 6)
    q, k, v, cu = recipe.level_inputs(lengths, 4, 2, 8, torch.device("cpu"), seed=1)
    q, k, v = q.float(), k.float(), v.float()
    assert recipe.bounds(lengths) == [(0, 4), (4, 5), (5, 11)]
    for kernel in (recipe.dense, recipe.stock):
        torch.testing.assert_close(kernel(q, k, v, None, lengths, 0.3), kernel(q, k, v, cu, lengths, 0.3))
    assert "cudnn_varlen" not in recipe.KERNELS  # cuDNN's ragged path cannot be captured (RESULTS.md s22)

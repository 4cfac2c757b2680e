"""recipes/gemm_sweep.py (row-count inversions of the forward's GEMM time) and recipes/attention_backends.py."""

from __future__ import annotations

import json

import pytest
import torch
from repo_data import load_recipe


def test_an_inversion_is_a_faster_larger_bucket_within_the_window():
    recipe = load_recipe("gemm_sweep")
    times = {32: 10.0, 64: 12.0, 96: 11.0, 128: 13.0, 160: 9.0}
    found = recipe.find_inversions(times, window=64, margin=0.02)
    # 32 -> nothing faster within 64 rows (64: 12, 96: 11); 64 -> 96 (-8.3%); 96 -> 160 (-18%); 128 -> 160 (-31%)
    assert [(x["rows"], x["faster_rows"]) for x in found] == [(64, 96), (96, 160), (128, 160)]
    assert found[0]["saving"] == pytest.approx(1 - 11 / 12, abs=1e-4)
    assert recipe.find_inversions(times, window=64, margin=0.2) == [
        {"rows": 128, "ms": 13.0, "faster_rows": 160, "faster_ms": 9.0, "saving": pytest.approx(0.3077, abs=1e-4)}]
    assert recipe.find_inversions({32: 1.0, 64: 2.0, 96: 3.0}, window=128, margin=0.0) == []  # monotone


def test_the_27b_shapes_count_the_backbone_weights():
    recipe = load_recipe("gemm_sweep")
    flop_per_row, weight_bytes = recipe.flops_and_bytes(recipe.SHAPES_27B, recipe.LAYERS_27B)
    # 48 GDN + 16 attention layers and 64 MLPs: ~24.3 B weights in these GEMMs (embeddings and norms excluded)
    assert 24.0e9 < weight_bytes / 2 < 24.6e9 and flop_per_row == weight_bytes
    assert recipe.LAYERS_27B.count("attn") == 16 and len(recipe.LAYERS_27B) == 64


def test_every_shape_counts_its_own_gemms():
    recipe = load_recipe("gemm_sweep")
    from benchlib.shapes import gemm_shapes, layer_kinds

    assert recipe.SHAPES_27B == gemm_shapes("27b") and recipe.LAYERS_27B == layer_kinds("27b")
    nine, two = layer_kinds("9b"), layer_kinds("2b")
    assert (len(nine), nine.count("attn"), len(two), two.count("attn")) == (32, 8, 24, 6)
    assert nine[3] == "attn" and nine[:3] == ["gdn"] * 3  # every 4th layer full attention
    _, nine_bytes = recipe.flops_and_bytes(gemm_shapes("9b"), nine)
    (gdn_in, _, _), (gdn_out, _, _) = [(n, k, name) for name, n, k in gemm_shapes("9b")["gdn"]]
    assert gdn_in == 2 * 16 * 128 + 2 * 32 * 128 + 2 * 32 and gdn_out == 4096
    assert 6.0e9 < nine_bytes / 2 < 8.5e9  # the 9B's projections: well below 9 B with embeddings left out


def test_a_smoke_sweep_on_the_cpu_writes_its_table(tmp_path):
    recipe = load_recipe("gemm_sweep")
    torch.set_num_threads(1)
    assert recipe.main(["--smoke", "--max-rows", "64", "--step", "16", "--repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gemm_sweep.json").read_text())
    assert sorted(int(r) for r in result["libraries"]["cublas"]["ms"]) == [16, 32, 48, 64]
    markdown = (tmp_path / "gemm_sweep.md").read_text()
    assert "| 48 |" in markdown and "## Inversions" in markdown


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_without_cuda_the_recipes_refuse_before_any_work(tmp_path):
    with pytest.raises(SystemExit):
        load_recipe("gemm_sweep").main(["--out", str(tmp_path / "g")])
    with pytest.raises(SystemExit):
        load_recipe("attention_backends").main(["--out", str(tmp_path / "a")])
    assert not (tmp_path / "g").exists() and not (tmp_path / "a").exists()

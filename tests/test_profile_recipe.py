"""recipes/profile_forward.py on the tiny shape (CPU ops), so a broken profiler never costs GPU time."""

from __future__ import annotations

import json

import pytest
import torch
from repo_data import load_recipe


def test_kernel_categories():
    recipe = load_recipe("profile_forward")
    assert recipe.category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert recipe.category("aten::mm") == "gemm"
    assert recipe.category("flash_fwd_kernel") == "attention (flash, cuDNN)"
    fa2 = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256, 64, 64, 4, false, false, cutlass::bfloat16_t"
    assert recipe.category(fa2) == "attention (flash, cuDNN)"  # not a GEMM, though its name mentions cutlass
    # cuDNN's fused attention (through SDPA): its kernel names carry cudnn or sdpa
    assert recipe.category("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0") == \
        "attention (flash, cuDNN)"
    assert recipe.category("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "gdn / conv (fla)"
    assert recipe.category("triton_per_fused_add_mean_mul_pow_rsqrt_0") == "elementwise / reductions"
    assert recipe.category("void at::native::index_elementwise_kernel") == "copies / indexing"
    assert recipe.category("something_else") == "other"


def test_the_profiler_runs_on_the_tiny_shape(tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("profile_forward")
    assert recipe.main(["--shape", "tiny", "--tokens", "37", "--out", str(tmp_path),
                        "--patch-options", "{}", '{"compile_elementwise": true}']) == 0
    result = json.loads((tmp_path / "profile_tiny.json").read_text())
    plain, compiled = result["variants"]
    assert plain["patch_options"] == {} and compiled["patch_options"] == {"compile_elementwise": True}
    (request,) = plain["requests"]
    assert request["tokens"] == 37 and request["wall_graphs_ms"] > 0 and request["kernel_sum_ms"] > 0
    assert abs(sum(request["by_category_ms"].values()) - request["kernel_sum_ms"]) < 1e-6
    assert "gemm" in request["by_category_ms"]  # the projections' matmuls are found
    assert request["graph_by_category_ms"] == {}  # no CUDA, no replayed graph to profile
    assert "one 37-token candidate" in (tmp_path / "profile_tiny.md").read_text()


def test_kernels_sum_by_category():
    recipe = load_recipe("profile_forward")
    totals = recipe.sum_by_category({"nvjet_sm90_tst_128x112": 2.0, "ampere_bf16_gemm": 1.0, "_silu_qkv_kernel": 0.5})
    assert totals == {"gemm": 3.0, "elementwise / reductions": 0.5}


def test_the_profiler_takes_jevbench_requests_and_fast_options(tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("profile_forward")
    assert recipe.main(["--shape", "tiny", "--tokens", "", "--requests", "0", "--fast-options", "{}",
                        '{"share_tails": true, "min_shared_tokens": 16}', "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "profile_tiny.json").read_text())
    assert result["fast_options"] == [{}, {"share_tails": True, "min_shared_tokens": 16}]
    default, tails = result["variants"]
    assert default["fast_options"] == {} and tails["fast_options"] == {"share_tails": True, "min_shared_tokens": 16}
    (request,) = tails["requests"]
    top = request["top_kernels_ms"]
    assert top and all(k["launches"] >= 1 for k in top)  # CPU: aten ops and their call counts
    shapes = json.loads((recipe.SHAPES_FILE).read_text())["requests"][0]  # easy-intent-00: prefix 36 (exact shapes), 5 candidates
    assert request["tokens"] == sum(shapes["prefix_tokens"] + s for s in shapes["suffix_tokens"])
    assert request["label"].startswith("JevBench request 0 (easy-intent-00, choice: prefix 36")
    markdown = (tmp_path / "profile_tiny.md").read_text()
    assert "JevBench request 0" in markdown and '"share_tails": true' in markdown


@pytest.mark.parametrize("args", [["--tokens", ""], ["--tokens", "", "--requests", "231"]])
def test_the_profiler_refuses_nothing_or_an_unknown_request_before_building_a_model(tmp_path, args):
    recipe = load_recipe("profile_forward")
    with pytest.raises(SystemExit):
        recipe.main(["--shape", "tiny", *args, "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()

"""recipes/layer_divergence.py on the tiny shape: in bf16 the Gated DeltaNet layers before the first attention
layer round exactly like stock Transformers (same values bit for bit); in fp32 every layer agrees closely."""

from __future__ import annotations

import json

import pytest
import torch
from repo_data import load_recipe


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fast_path_layers_against_stock(tmp_path, dtype):
    torch.set_num_threads(1)
    recipe = load_recipe("layer_divergence")
    assert recipe.main(["--shape", "tiny", "--dtype", dtype, "--tokens", "90", "--out", str(tmp_path)]) == 0
    layers = json.loads((tmp_path / f"divergence_tiny_{dtype}.json").read_text())["layers"]
    assert len(layers) == 4 and layers[0]["type"] == "linear_attention" and "full_attention" in [r["type"] for r in layers]
    if dtype == "bfloat16":
        before_attention = layers[: [r["type"] for r in layers].index("full_attention")]
        assert before_attention and all(r["mismatch_fraction"] == 0.0 for r in before_attention)
    else:
        assert all(r["max_rel"] < 1e-4 for r in layers)

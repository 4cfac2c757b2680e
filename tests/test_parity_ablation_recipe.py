"""recipes/parity_ablation.py on the tiny shape in fp32: every variant within 1e-4 of stock, no flips."""

from __future__ import annotations

import json

import torch
from repo_data import load_recipe


def test_every_variant_matches_stock_in_fp32(tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("parity_ablation")
    assert recipe.main(["--shape", "tiny", "--dtype", "float32", "--limit", "12", "--max-length", "600",
                        "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "ablation_tiny_float32.json").read_text())
    rows = result["rows"]
    assert len(rows) == 1 + len(recipe.VARIANTS) and result["requests"] > 0
    assert all(r["max_abs_dp"] < 1e-4 and r["decision_flips"] == 0 for r in rows)
    assert "| C: no shared prefixes |" in (tmp_path / "ablation_tiny_float32.md").read_text()

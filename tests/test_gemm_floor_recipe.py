"""recipes/gemm_floor.py: the GEMM-only floor of the workload under each sharing policy (pure Python)."""

from __future__ import annotations

from pathlib import Path

import pytest
from repo_data import load_recipe


def test_pack_floor_is_weight_streaming_then_linear_in_tokens():
    recipe = load_recipe("gemm_floor")
    assert recipe.pack_floor_ms(1) == recipe.pack_floor_ms(107) == 13.3
    assert recipe.pack_floor_ms(4096) == pytest.approx(293.0)
    assert recipe.pack_floor_ms(2048) == pytest.approx(146.5)


def test_one_request_by_hand():
    recipe = load_recipe("gemm_floor")
    prefix = list(range(1000, 1200))
    request = [[prefix + [5000 + c] * 30 for c in range(3)]]  # one question: a 200-token prefix, 3 x 30 own tokens
    # no sharing: 3 x 230 tokens in one pack; multiples of 64: 192 shared + 3 x 38; exact: 200 + 3 x 30
    for options, tokens in [(dict(shared_prefix=False), 690), (dict(share_tails=False, min_shared_tokens=64), 192 + 3 * 38),
                            (dict(share_tails=True, min_shared_tokens=32), 200 + 90)]:
        result = recipe.workload_floor([request], **options)
        assert result["computed_tokens"] == tokens
        assert result["mean_ms"] == pytest.approx(max(13.3, tokens * 293 / 4096))
        assert result["max_decisions_per_s"] == pytest.approx(1 / (tokens * 293 / 4096 / 1000))  # one question


def test_the_workload_table(tmp_path, capsys):
    recipe = load_recipe("gemm_floor")
    estimated = Path(__file__).resolve().parents[1] / "data/bench/jevbench231-shapes-estimated.json"
    assert recipe.main(["--manifest", str(estimated), "--out", str(tmp_path)]) == 0  # the figures below are its
    import json

    results = json.loads((tmp_path / "gemm_floor.json").read_text())
    none, aligned, exact = (results[name] for name in recipe.POLICIES)
    assert none["n"] == aligned["n"] == exact["n"] == 231
    assert none["computed_tokens"] > aligned["computed_tokens"] > exact["computed_tokens"]
    assert none["mean_ms"] > aligned["mean_ms"] > exact["mean_ms"]
    assert aligned["p50_ms"] > 25 and exact["p50_ms"] < 22  # p50 <= 20 ms needs more than 64-aligned sharing
    assert "| no sharing |" in capsys.readouterr().out


def test_a_measured_curve_costs_packs_at_their_bucket(tmp_path):
    recipe = load_recipe("gemm_floor")
    curve = {32: 10.0, 64: 11.0, 96: 30.0, 128: 20.0}
    assert recipe.curve_pack_ms(curve, 1) == 10.0 and recipe.curve_pack_ms(curve, 64) == 11.0
    assert recipe.curve_pack_ms(curve, 65) == 30.0  # the bucket's own time, even where a larger one is faster
    assert recipe.curve_pack_ms(curve, 256) == 40.0  # past the end: linear from the last point
    import json

    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"libraries": {"cublas": {"ms": {str(k): v for k, v in curve.items()}}}}))
    assert recipe.load_curve(path) == curve
    assert recipe.main(["--curve", str(path), "--out", str(tmp_path / "o")]) == 0
    results = json.loads((tmp_path / "o" / "gemm_floor.json").read_text())
    assert "exact sharing (share_tails, threshold 16)" in results
    assert "the measured curve" in (tmp_path / "o" / "gemm_floor.md").read_text()


def test_the_default_workload_is_the_exact_manifest_and_other_shapes_scale_the_floor(tmp_path):
    recipe = load_recipe("gemm_floor")
    assert recipe.main(["--out", str(tmp_path / "27b")]) == 0
    assert recipe.main(["--shape", "9b", "--out", str(tmp_path / "9b")]) == 0
    import json

    exact = json.loads((tmp_path / "27b" / "gemm_floor.json").read_text())
    nine = json.loads((tmp_path / "9b" / "gemm_floor_9b.json").read_text())
    assert recipe.shape_scale("27b") == 1.0 and 0.2 < recipe.shape_scale("9b") < 0.5
    for name, r in exact.items():  # the same plans, each pack's floor scaled by the 9B's GEMM weights
        assert nine[name]["computed_tokens"] == r["computed_tokens"]
        assert nine[name]["mean_ms"] == pytest.approx(r["mean_ms"] * recipe.shape_scale("9b"))
    estimated = Path(__file__).resolve().parents[1] / "data/bench/jevbench231-shapes-estimated.json"
    assert recipe.main(["--manifest", str(estimated), "--out", str(tmp_path / "e")]) == 0
    other = json.loads((tmp_path / "e" / "gemm_floor.json").read_text())
    assert other["no sharing"]["computed_tokens"] != exact["no sharing"]["computed_tokens"]
    assert "9b shape" in (tmp_path / "9b" / "gemm_floor_9b.md").read_text()

"""recipes/gdn_short_check.py without triton: variant names, the default variants' limits, the report."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from hf_openjev.ops.gdn_prefill_short import check_short_shapes

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.fixture
def recipe(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what the recipe sets on a machine without CUDA
    monkeypatch.syspath_prepend(str(RECIPES))
    module = importlib.import_module("gdn_short_check")
    yield module
    sys.modules.pop("gdn_short_check", None)


def test_variant_names_parse_and_the_defaults_are_within_the_kernel_limits(recipe):
    assert recipe.parse_variant("bv64-c32-w8-tf32x3") == dict(block_v=64, chunk=32, num_warps=8, precision="tf32x3")
    with pytest.raises(ValueError, match="bv<block_v>"):
        recipe.parse_variant("32-c16-w4-ieee")
    for names, (dk, dv) in ((recipe.VARIANTS, (128, 128)), (recipe.INTERPRET_VARIANTS, (32, 32))):
        for name in names.split(","):
            options = recipe.parse_variant(name)
            check_short_shapes(torch.empty(1, 1, dk), torch.empty(1, 1, dv), options["block_v"], options["chunk"],
                               options["precision"])


def test_two_launch_variant_names_parse(recipe):
    assert recipe.parse_variant("wy-bv64-w8-p4-s3-tf32x3") == dict(
        design="wy", block_v=64, chunk=64, num_warps=8, prep_warps=4, num_stages=3, precision="tf32x3")
    for bad in ("wy-bv32-w4-p4-ieee", "wy-32-w4-p4-s1-ieee", "wy-bv32-p4-w4-s1-ieee", "wy-bv32-w4-p4-1-ieee"):
        with pytest.raises(ValueError, match="wy-bv<block_v>-w<num_warps>-p<prep_warps>-s<num_stages>"):
            recipe.parse_variant(bad)
    defaults = recipe.VARIANTS.split(",")
    assert "bv32-c16-w4-ieee" in defaults and "bv32-c16-w4-tf32" in defaults  # the v1 references stay
    assert any(name.startswith("wy-") for name in recipe.INTERPRET_VARIANTS.split(","))


def test_solve_systems_are_strictly_lower_and_the_close_one_has_entries_near_one(recipe):
    easy, close = recipe.solve_system("random", 32, 0), recipe.solve_system("close", 32, 0)
    for a in (easy, close):
        assert a.shape == (64, 64) and torch.equal(a, a.tril(-1)) and a.abs().max() <= 1.0
    assert easy.abs().max() < 0.5 < 0.9 < close.abs().max()


def test_report_has_a_solve_section(recipe):
    solve = [dict(case="close", seed=0, precision="ieee", rel=2.7e-7, ok=True)]
    text = recipe.markdown(dict(device="cpu", versions={}, accuracy=[], timing=[], solve=solve))
    assert "## Blocked 64 x 64 solve" in text and "| close | 0 | ieee | 2.70e-07 | True |" in text


def test_a_kernel_that_raises_is_reported_and_the_check_goes_on(recipe, monkeypatch):
    def broken(variant):
        def run(**args):
            raise RuntimeError("PTX does not compile")
        return run

    monkeypatch.setattr(recipe, "kernel_of", broken)
    row = recipe.check_variant("wy-bv32-w4-p4-s1-bf16x3", {}, (None, None), None, 1e-2)
    assert row["ok"] is False and row["error"] == "RuntimeError: PTX does not compile"
    accuracy = [dict(kernel="wy-bv32-w4-p4-s1-bf16x3", lengths=[1], dtype="bfloat16", state=True, **row)]
    text = recipe.markdown(dict(device="H200", versions={}, accuracy=accuracy, timing=[]))
    assert "- wy-bv32-w4-p4-s1-bf16x3: `RuntimeError: PTX does not compile`" in text


def test_report_has_a_row_per_check_and_a_column_per_kernel(recipe):
    row = dict(kernel="op", lengths=[1, 2], dtype="bfloat16", state=True, o_rel=1e-3, s_rel=2e-6, ok=True)
    timing = dict(batch="1x107", chunked_us=42.0, op_us=10.5, op_replay_ok=True)
    text = recipe.markdown(dict(device="H200", versions={}, accuracy=[row, {**row, "state": False}], timing=[timing]))
    assert text.count("| op | [1, 2] | bfloat16 |") == 2
    assert "| batch | chunked | op |" in text and "| 1x107 | 42.0 | 10.5 |" in text

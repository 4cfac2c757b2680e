"""recipes/gdn_short_check.py without triton: variant names, the default variants' limits, the report."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest
import torch

from hf_openjev.ops.gdn_short_limits import check_short_shapes

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
                               options["precision"], options["num_warps"])


def test_two_launch_variant_names_parse(recipe):
    assert recipe.parse_variant("wy-bv64-w8-p4-s3-tf32x3") == dict(
        design="wy", block_v=64, chunk=64, num_warps=8, prep_warps=4, num_stages=3, precision="tf32x3")
    for bad in ("wy-bv32-w4-p4-ieee", "wy-32-w4-p4-s1-ieee", "wy-bv32-p4-w4-s1-ieee", "wy-bv32-w4-p4-1-ieee"):
        with pytest.raises(ValueError, match="wy-bv<block_v>-w<num_warps>-p<prep_warps>-s<num_stages>"):
            recipe.parse_variant(bad)
    defaults = recipe.VARIANTS.split(",")
    assert "bv32-c16-w4-tf32" in defaults  # the v1 reference stays
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


def test_defaults_are_short_and_skip_builds_over_shared_memory(recipe):
    """s3 needed 246 KB of shared memory on an H200 (232 KB): out of the defaults; one call stays short."""
    defaults = recipe.VARIANTS.split(",")
    assert len(defaults) <= 3 and not any(recipe.parse_variant(n).get("num_stages", 1) > 1 for n in defaults)
    assert {"wy-bv32-w8-p8-s1-ieee", "wy-bv32-w8-p8-s1-bf16x3", "bv32-c16-w4-tf32"} == set(defaults)


def _options(**kw):
    return argparse.Namespace(**{**dict(batches="1x107", reps=2, no_timing=True, part_timeout=60.0), **kw})


def test_a_part_whose_process_dies_is_a_failed_row_and_the_next_part_runs(recipe, monkeypatch, tmp_path):
    crash = ("import sys; print('CUDA error: an illegal memory access', file=sys.stderr); "
             "print('torch.AcceleratorError: CUDA error: an illegal memory access was encountered', file=sys.stderr); "
             "sys.exit(1)")
    healthy = "import json, sys; open(sys.argv[1], 'w').write(json.dumps({'accuracy': [{'kernel': 'ok'}], 'timing': []}))"
    scripts = {"wy-bv16-w8-p8-s1-tf32x3": [sys.executable, "-c", crash],
               "wy-bv32-w8-p8-s1-ieee": [sys.executable, "-c", healthy, str(tmp_path / "b" / "part.json")],
               "solve": [sys.executable, "-c", "import os; os.abort()"]}  # SIGABRT: -6
    monkeypatch.setattr(recipe, "part_command", lambda part, opts, out: scripts[part])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    dead = recipe.isolated_part("wy-bv16-w8-p8-s1-tf32x3", _options(), tmp_path / "a")
    row = dead["accuracy"][0]
    assert row["kernel"] == "wy-bv16-w8-p8-s1-tf32x3" and row["ok"] is False and dead["timing"] == []
    assert row["error"] == ("child process exit 1: torch.AcceleratorError: CUDA error: an illegal memory access "
                            "was encountered")
    assert recipe.isolated_part("wy-bv32-w8-p8-s1-ieee", _options(), tmp_path / "b") == dict(
        accuracy=[{"kernel": "ok"}], timing=[])
    solve = recipe.isolated_part("solve", _options(), tmp_path / "c")["solve"][0]
    assert solve["ok"] is False and solve["error"].startswith("child process exit -6")
    text = recipe.markdown(dict(device="H200", versions={}, accuracy=dead["accuracy"], timing=[], solve=[solve]))
    assert "- wy-bv16-w8-p8-s1-tf32x3: `child process exit 1: torch.AcceleratorError" in text


def test_a_part_over_its_time_is_a_failed_row(recipe, monkeypatch, tmp_path):
    monkeypatch.setattr(recipe, "part_command", lambda part, opts, out: [sys.executable, "-c", "import time; time.sleep(30)"])
    row = recipe.isolated_part("op", _options(part_timeout=0.5), tmp_path)["accuracy"][0]
    assert row["ok"] is False and "ran over --part-timeout 0.5 s" in row["error"]


def test_timing_of_parts_joins_per_batch(recipe):
    op = [dict(batch="1x107", sequences=1, length=107, chunked_us=42.0, op_us=10.0)]
    variant = [dict(batch="1x107", sequences=1, length=107, **{"v_us": 12.0})]
    merged = recipe.merge_timing(recipe.merge_timing([], op), variant)
    assert merged == [dict(batch="1x107", sequences=1, length=107, chunked_us=42.0, op_us=10.0, v_us=12.0)]
    text = recipe.markdown(dict(device="H200", versions={}, accuracy=[], timing=merged + [dict(batch="5x40", op_us=9.0)]))
    assert "| batch | chunked | op | v |" in text and "| 5x40 | nan | 9.0 | nan |" in text


def test_the_child_command_runs_one_part_of_this_script(recipe, tmp_path):
    cmd = recipe.part_command("op", _options(), tmp_path)
    assert cmd[0] == sys.executable and cmd[1].endswith("gdn_short_check.py")
    assert cmd[cmd.index("--part") + 1] == "op" and cmd[cmd.index("--out") + 1] == str(tmp_path)
    assert "--no-timing" in cmd

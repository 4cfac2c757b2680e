"""recipes/skinny_gemm_check.py on the CPU: the smoke run's files (the op's CPU path), row lists, the suggested
overrides, the report; the test file's 27B/9B/2B shapes are the recipes' own."""

from __future__ import annotations

import json

import pytest
import torch
from repo_data import load_recipe


@pytest.fixture(scope="module")
def recipe():
    return load_recipe("skinny_gemm_check")


def test_a_smoke_run_on_the_cpu_writes_its_tables(recipe, tmp_path):
    torch.set_num_threads(1)
    assert recipe.main(["--smoke", "--rows", "16,33", "--reps", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "skinny_gemm_smoke.json").read_text())
    assert [row["rows"] for row in result["forward"]] == [16, 33] and result["ok"] is True
    shapes = recipe.distinct_shapes(recipe.SMOKE_SHAPES)
    assert len(result["per_shape"]) == 2 * len(shapes) == 12
    assert {(row["n"], row["k"]) for row in result["per_shape"]} == set(shapes)
    assert all(row["op_rel"] == 0.0 for row in result["per_shape"])  # the CPU op is the reference
    assert all(row["cublas_us"] > 0 and row["op_us"] > 0 for row in result["per_shape"])
    text = (tmp_path / "skinny_gemm_smoke.md").read_text()
    assert "## One forward's GEMMs" in text and "| 33 | 256 | 64 | bn128-bk64-s1-w4-p3 |" in text
    assert "all within the bound" in text


def test_an_error_over_the_bound_fails_the_run(recipe, tmp_path):
    assert recipe.main(["--smoke", "--rows", "16", "--reps", "1", "--tol", "-1", "--out", str(tmp_path)]) == 1
    assert "SOME OVER" in (tmp_path / "skinny_gemm_smoke.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_without_cuda_a_full_run_is_refused_before_any_work(recipe, tmp_path):
    with pytest.raises(SystemExit):
        recipe.main(["--out", str(tmp_path / "s")])
    assert not (tmp_path / "s").exists()


def test_rows_parse_as_ranges_and_lists(recipe):
    assert recipe.parse_rows("16:256:16") == list(range(16, 257, 16)) and len(recipe.parse_rows("16:256:16")) == 16
    assert recipe.parse_rows("1,16,107") == [1, 16, 107]


def test_overrides_name_the_fastest_config_per_bucket_beyond_the_margin(recipe):
    rows = [dict(rows=16, n=5120, k=6144, config="bn128-bk128-s2-w4-p4", op_us=20.0, cublas_us=22.0,
                 configs_us={"bn64-bk128-s1-w4-p4": 18.0, "bn128-bk64-s4-w4-p3": 19.0, "bn32-bk16-s1-w4-p1": "no",
                             "bn16-bk16-s1-w4-p1": "wrong: max err / max ref 1.00e+00"}),
            dict(rows=16, n=16480, k=5120, config="bn128-bk128-s1-w4-p4", op_us=30.0, cublas_us=31.0,
                 configs_us={"bn64-bk128-s1-w4-p4": 29.9}),  # within 2%: the table's choice stays
            dict(rows=32, n=5120, k=6144, config="bn128-bk128-s2-w4-p4", op_us=20.0, cublas_us=22.0,
                 configs_us={"bn64-bk128-s1-w4-p4": 10.0})]  # bucket 32: its own line
    lines = recipe.best_overrides(rows)
    assert len(lines) == 2
    assert lines[0].startswith('    (16, 5120, 6144): parse_config("bn64-bk128-s1-w4-p4"),  # 18.0 us vs 20.0')
    assert lines[1].startswith('    (32, 5120, 6144): parse_config("bn64-bk128-s1-w4-p4")')
    result = dict(shape="27b", device="H200", command="c", versions={}, weight_bytes=1e9, forward=[],
                  per_shape=rows, ok=True, tol=2**-7, overrides=lines)
    for row in rows:
        row.update(op_rel=1e-3, cublas_rel=2e-3)
    text = recipe.markdown(result)
    assert "| cuBLAS err | bn128-bk64-s4-w4-p3 | bn16-bk16-s1-w4-p1 | bn32-bk16-s1-w4-p1 | bn64-bk128-s1-w4-p4 |" in text
    assert ("| 16 | 5120 | 6144 | bn128-bk128-s2-w4-p4 | 22.0 | 20.0 | 1.00e-03 | 2.00e-03 | 19.0 | wrong | refused | "
            "18.0 |") in text
    assert "| 16 | 16480 | 5120 | bn128-bk128-s1-w4-p4 | 31.0 | 30.0 | 1.00e-03 | 2.00e-03 |  |  |  | 29.9 |" in text
    assert "## Faster configurations" in text


def test_the_op_tests_shapes_are_the_models_gemms(recipe):
    from benchlib.shapes import gemm_shapes
    from test_op_skinny_linear import SHAPES_2B, SHAPES_9B, SHAPES_27B

    for name, listed in (("27b", SHAPES_27B.values()), ("9b", SHAPES_9B), ("2b", SHAPES_2B)):
        assert set(recipe.distinct_shapes(gemm_shapes(name))) == set(listed), name

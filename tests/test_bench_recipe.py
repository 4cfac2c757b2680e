"""recipes/bench_jevbench.py end to end on the tiny shape (CPU), so a broken driver never costs GPU time."""

from __future__ import annotations

import json

import pytest
import torch
from repo_data import load_recipe


def test_the_benchmark_driver_runs_every_section_on_the_tiny_shape(tmp_path):
    torch.set_num_threads(1)
    bench = load_recipe("bench_jevbench")
    rc = bench.main(["--shape", "tiny", "--limit", "6", "--arms", "C,E,A,A1,B,B1", "--passes", "1", "--b-passes", "1",
                     "--long-candidate", "40", "--fast-options", '{"share_tails": true, "min_shared_tokens": 16}',
                     "--single", "7,30", "--cuda-graphs", "--concurrency", "1,3", "--sweep", '[{"min_shared_tokens": 64}, {"share_tails": false}]',
                     "--patch-options", '{"gdn_fp32": true}', "--dtype", "float32", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "bench_tiny_float32.json").read_text())
    assert set(results["arms"]) == {"C", "E", "A", "A1", "B", "B1"}  # on the CPU --cuda-graphs changes nothing
    assert results["parity_A1_vs_A"]["max_abs_dp"] < 1e-5  # the stock model alone vs batched, fp32
    assert results["parity_B1_vs_B"]["max_abs_dp"] < 1e-5
    assert results["fast_options"] == {"share_tails": True, "min_shared_tokens": 16}
    assert results["patch_options"] == {"gdn_fp32": True}  # handed to apply_patches for C and E
    assert results["effective_patch_options"]["C"]["gdn_fp32"] is True
    assert "compile_elementwise" in results["effective_patch_options"]["E"]  # the defaults are recorded too
    assert "patch options: {'gdn_fp32': True}" in (tmp_path / "bench_tiny_float32.md").read_text()
    assert results["parity_C_vs_E"]["max_abs_dp"] == 0.0
    assert results["arms"]["C"]["n"] == 6 and results["arms"]["A"]["n"] == 6
    assert len(results["request_ids"]) == len(set(results["request_ids"])) == 6  # per_request_ms's order, by id
    assert results["arms"]["B"]["cold"] is False and results["arms"]["B"]["warmup_requests"] == 6  # every shape
    assert "speedup_C_over_B" in results
    parity = results["parity_C_vs_A"]
    assert parity["n"] == 6 and parity["max_abs_dp"] < 1e-4 and parity["decision_flips"] == 0  # fp32 on the CPU
    assert set(results["closed_loop"]) == {"1", "3"}
    assert all(v["decisions_per_s"] > 0 for v in results["closed_loop"].values())
    assert set(results["sweep"]) == {'{"min_shared_tokens": 64}', '{"share_tails": false}'}
    assert results["sweep"]['{"share_tails": false}']["fast_options"] == {"share_tails": False, "min_shared_tokens": 16}
    for entry in results["sweep"].values():  # each entry's answers against the reference arms of the run
        assert entry["parity_vs_A"]["n"] == entry["parity_vs_B"]["n"] == 6
        assert entry["parity_vs_A"]["max_abs_dp"] < 1e-4 and entry["parity_vs_A"]["decision_flips"] == 0
        assert set(entry["single_candidate"]) == {"7", "30"}  # the singles again on the entry's options
    assert results["long_candidate"]["tokens"] == 40
    assert set(results["single_candidate"]) == {"7", "30"}
    assert all(v["median_ms"] > 0 for v in results["single_candidate"].values())
    markdown = (tmp_path / "bench_tiny_float32.md").read_text()
    assert "| C |" in markdown and "closed-loop" in markdown and "sweep of score_fast options" in markdown
    assert " 0 flips |" in markdown.split("sweep of score_fast options")[1]  # the sweep's parity columns
    assert " 7: " in markdown.split("sweep of score_fast options")[1]  # and its singles


def test_the_length_filter_keeps_the_same_token_ids():
    bench = load_recipe("bench_jevbench")
    every = bench.build_workload(bench.SHAPES_FILE, vocab=248320, seed=0)
    short = bench.build_workload(bench.SHAPES_FILE, vocab=248320, seed=0, max_length=128)
    assert len(every) == 231 and 0 < len(short) < 231
    assert all(item["prefix_tokens"] + max(item["suffix_tokens"]) <= 128 for item, _ in short)
    kept = [(i, p) for i, p in every if i["prefix_tokens"] + max(i["suffix_tokens"]) <= 128]
    assert [p.tokens for _, p in kept] == [p.tokens for _, p in short]


def test_a_parity_only_arm_skips_its_warm_up_and_reports_no_speed(tmp_path, capsys):
    torch.set_num_threads(1)
    bench = load_recipe("bench_jevbench")
    rc = bench.main(["--shape", "tiny", "--limit", "4", "--arms", "C,B", "--passes", "1", "--b-passes", "1",
                     "--parity-only", "B", "--long-candidate", "0", "--single", "9", "--concurrency", "",
                     "--dtype", "float32", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "bench_tiny_float32.json").read_text())
    assert results["arms"]["B"]["parity_only"] and not results["arms"]["C"]["parity_only"]
    assert results["arms"]["B"]["warmup_s"] == 0 or results["arms"]["B"]["warmup_s"] < 1e-3
    assert "speedup_C_over_B" not in results and results["parity_C_vs_B"]["n"] == 4
    markdown = (tmp_path / "bench_tiny_float32.md").read_text()
    assert "| B | 4 | parity only" in markdown and "## arm B:" not in markdown
    assert "closed-loop" not in markdown  # no levels asked for, no empty table
    printed = capsys.readouterr().out
    assert printed.index("single 9-token candidate") < printed.index("arm B")  # singles run before later arms


def test_a_b_warmed_on_fewer_shapes_than_it_is_timed_on_is_cold_and_takes_no_ratio(tmp_path, capsys):
    torch.set_num_threads(1)
    bench = load_recipe("bench_jevbench")
    rc = bench.main(["--shape", "tiny", "--limit", "3", "--arms", "C,B", "--passes", "1", "--b-passes", "1",
                     "--b-warmup-requests", "1", "--long-candidate", "0", "--single", "", "--concurrency", "",
                     "--dtype", "float32", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "bench_tiny_float32.json").read_text())
    b = results["arms"]["B"]
    assert b["cold"] is True and b["warmup_requests"] == 1 and not b["parity_only"]
    assert results["arms"]["C"]["cold"] is False
    assert "speedup_C_over_B" not in results and "speedup_C_over_B" not in (tmp_path / "bench_tiny_float32.md").read_text()
    assert "| B (cold: warmed on 1 of 3 requests" in (tmp_path / "bench_tiny_float32.md").read_text()
    assert "arm B (cold: warmed on 1 of 3 requests" in capsys.readouterr().out


def test_warm_means_every_timed_shape_was_seen():
    from benchlib.warmth import covers_every_shape

    a, b = {"prefix_tokens": 3, "suffix_tokens": [4, 5]}, {"prefix_tokens": 3, "suffix_tokens": [5, 4]}
    assert covers_every_shape([a, b], [b, a, b]) and covers_every_shape([dict(a)], [a])
    assert not covers_every_shape([a], [a, b]) and not covers_every_shape([], [a])


@pytest.mark.parametrize("parity_only", ["C", "B"])
def test_parity_only_names_arms_other_than_c(tmp_path, parity_only):
    bench = load_recipe("bench_jevbench")
    with pytest.raises(SystemExit):
        bench.main(["--shape", "tiny", "--arms", "C,A", "--parity-only", parity_only, "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()  # refused before any work


def test_unknown_arms_are_refused_before_any_work(tmp_path, capsys):
    bench = load_recipe("bench_jevbench")
    with pytest.raises(SystemExit):
        bench.main(["--shape", "tiny", "--arms", "C,B2", "--out", str(tmp_path / "o")])
    assert "choose among A, B, C, E, A1, B1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("sweep", ['{"min_shared_tokens": 64}', "[64]", "[{min_shared_tokens: 64}]"])
def test_a_malformed_sweep_is_refused_before_any_work(tmp_path, sweep):
    bench = load_recipe("bench_jevbench")
    with pytest.raises(SystemExit):
        bench.main(["--shape", "tiny", "--arms", "C", "--sweep", sweep, "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


UNKNOWN = "unknown fast-path option"


@pytest.mark.parametrize("flag, value, message", [
    ("--fast-options", '{"min_shared": 64}', UNKNOWN), ("--patch-options", '{"graphs": false}', UNKNOWN),
    ("--sweep", '[{"share_tail": true}]', UNKNOWN),
    ("--fast-options", '{"max_tokens": 0}', "max_tokens must be a positive integer"),
    ("--sweep", '[{"dense_attention_tokens": -1}]',
     "dense_attention_tokens must be a non-negative integer (0: never), got -1")])
def test_unknown_or_bad_fast_path_options_are_refused_before_any_work(tmp_path, capsys, flag, value, message):
    bench = load_recipe("bench_jevbench")
    with pytest.raises(SystemExit):
        bench.main(["--shape", "tiny", "--arms", "C", flag, value, "--out", str(tmp_path / "o")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_c_warms_up_unanswered_and_is_then_timed_answering(tmp_path, monkeypatch):
    """C's warm-up pass runs inside patches.warming_up (captures without answering replays, as the server's
    warm-up), through patches.run_warm_up with --compile-threads; its measured pass and B's passes run outside it."""
    import contextlib

    import hf_openjev.patches as patches
    from hf_openjev.patches import record

    torch.set_num_threads(1)
    bench = load_recipe("bench_jevbench")
    inside, passes = [], []

    @contextlib.contextmanager
    def warming_up(model):
        inside.append(True)
        yield
        inside.pop()

    real_pass = bench.run_pass

    def run_pass(model, work, *, fast, **kwargs):
        passes.append(("C" if fast else "B", bool(inside)))
        return real_pass(model, work, fast=fast, **kwargs)

    threads = []
    real_warm_up = patches.run_warm_up

    def run_warm_up(model, one_pass, *, compile_threads=0):  # as a GPU's: a compile-ahead report (a CPU has none)
        threads.append(compile_threads)
        result = real_warm_up(model, one_pass, compile_threads=compile_threads)
        return {**result, "compile_ahead": {
            "threads": compile_threads, "compiles": 36, "loads": 36, "untuned": 0, "failures": [],
            "compile_wait_s": 0.2, "load_s": 0.1, "seconds": 0.5}}

    monkeypatch.setattr(record, "warming_up", warming_up)
    monkeypatch.setattr(patches, "run_warm_up", run_warm_up)
    monkeypatch.setattr(bench, "run_pass", run_pass)
    rc = bench.main(["--shape", "tiny", "--limit", "2", "--arms", "B,C", "--passes", "1", "--b-passes", "1",
                     "--long-candidate", "0", "--single", "", "--concurrency", "", "--dtype", "float32",
                     "--compile-threads", "3", "--out", str(tmp_path)])
    assert rc == 0
    assert passes == [("B", False), ("B", False), ("C", True), ("C", False)]  # warm-up, measured, per arm
    assert threads == [3]  # C's warm-up only
    report = json.loads(next(tmp_path.glob("bench_*.json")).read_text())
    assert report["arms"]["C"]["compile_ahead"]["seconds"] == 0.5 and "compile_ahead" not in report["arms"]["B"]
    assert "arm C warm-up's compile-ahead pass: 0.5 s of its" in next(tmp_path.glob("bench_*.md")).read_text()


def test_negative_compile_threads_are_refused_before_any_work(tmp_path, capsys):
    bench = load_recipe("bench_jevbench")
    with pytest.raises(SystemExit):
        bench.main(["--shape", "tiny", "--arms", "C", "--compile-threads", "-2", "--out", str(tmp_path / "o")])
    assert "--compile-threads -2" in capsys.readouterr().err and not (tmp_path / "o").exists()

"""recipes/benchlib: the family's shapes and temperatures, the workload manifests and --manifest, the native table."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from repo_data import REPO, load_recipe, read_committed_oracle

KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "linear_num_key_heads", "linear_num_value_heads")


def test_the_family_shapes_and_their_temperatures():
    load_recipe("bench_jevbench")  # recipes/ on the path
    from benchlib.shapes import SHAPES, T27, TEMPERATURES, layer_kinds

    assert tuple(SHAPES["9b"][k] for k in KEYS) == (4096, 12288, 32, 16, 4, 16, 32)  # the native server's check
    assert tuple(SHAPES["2b"][k] for k in KEYS) == (2048, 6144, 24, 8, 2, 16, 16)
    for shape in ("9b", "2b"):
        assert (SHAPES[shape]["head_dim"], SHAPES[shape]["linear_key_head_dim"],
                SHAPES[shape]["linear_value_head_dim"]) == (256, 128, 128)
    assert SHAPES["2b"]["tie_word_embeddings"] is True and "tie_word_embeddings" not in SHAPES["9b"]
    assert TEMPERATURES == {"27b": T27, "mid": T27, "tiny": T27, "9b": 1.8969118766347646, "2b": 1.518796342858676}
    assert layer_kinds("2b").count("attn") == 6 and layer_kinds("9b").count("gdn") == 24
    assert set(SHAPES) == set(TEMPERATURES)


def test_a_shape_s_random_model_carries_its_temperature_and_tied_flag(monkeypatch):
    """The 9B/2B builds at tiny widths (their own temperature and flags; the real widths need a GPU)."""
    torch.set_num_threads(1)
    load_recipe("bench_jevbench")
    from benchlib import random_model
    from benchlib.shapes import SHAPES, T2, T9

    monkeypatch.setitem(SHAPES, "9b", dict(SHAPES["tiny"]))
    monkeypatch.setitem(SHAPES, "2b", {**SHAPES["tiny"], "tie_word_embeddings": True})
    nine, two = (random_model.build_model(s, seed=0, device="cpu") for s in ("9b", "2b"))
    assert (nine.temperature, two.temperature) == (T9, T2) and nine.model_id == "random-9b"
    assert two.config.tie_word_embeddings and not nine.config.tie_word_embeddings
    tiny = random_model.build_model("tiny", seed=0, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(tiny.state_dict().values(), nine.state_dict().values()))


def test_the_exact_manifest_is_the_default_and_the_estimated_one_stays():
    bench = load_recipe("bench_jevbench")
    from benchlib.workload import ESTIMATED_MANIFEST, MANIFEST

    exact, estimated = (json.loads(p.read_text()) for p in (MANIFEST, ESTIMATED_MANIFEST))
    assert [r["id"] for r in exact["requests"]] == [r["id"] for r in estimated["requests"]]
    assert len(exact["requests"]) == 231
    assert exact["chat_suffix_tokens"] == 9 and estimated["chars_per_token"] == 4.0
    oracle = read_committed_oracle("mid")
    assert hashlib.sha256(ESTIMATED_MANIFEST.read_bytes()).hexdigest() == oracle["workload_sha256"]
    assert bench.SHAPES_FILE == ESTIMATED_MANIFEST  # what the oracle tests rebuild requests from


def test_the_bench_runs_on_the_manifest_it_is_given_and_prints_the_native_table(tmp_path):
    torch.set_num_threads(1)
    bench = load_recipe("bench_jevbench")
    from benchlib.workload import ESTIMATED_MANIFEST, MANIFEST

    common = ["--shape", "tiny", "--limit", "2", "--arms", "C", "--passes", "1", "--concurrency", "", "--single", "",
              "--long-candidate", "0", "--dtype", "float32"]
    assert bench.main([*common, "--out", str(tmp_path / "exact")]) == 0
    assert bench.main([*common, "--manifest", str(ESTIMATED_MANIFEST), "--out", str(tmp_path / "estimated")]) == 0
    exact, estimated = (json.loads((tmp_path / d / "bench_tiny_float32.json").read_text())
                        for d in ("exact", "estimated"))
    assert (exact["manifest"], estimated["manifest"]) == (MANIFEST.name, ESTIMATED_MANIFEST.name)
    assert exact["manifest_sha256"] == hashlib.sha256(MANIFEST.read_bytes()).hexdigest()
    markdown = (tmp_path / "exact" / "bench_tiny_float32.md").read_text()
    assert "## beside the native server" in markdown and "| noul | 2049-4096 | 6 | 245.36 | - |" in markdown
    assert "| all | mean | 231 | 123.02 |" in markdown


def test_a_bad_manifest_or_another_workload_than_the_oracle_s_is_refused(tmp_path, capsys):
    bench = load_recipe("bench_jevbench")
    oracle = load_recipe("oracle")
    from benchlib.workload import MANIFEST

    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    with pytest.raises(SystemExit):
        bench.main(["--shape", "tiny", "--manifest", str(broken), "--out", str(tmp_path / "o")])
    assert "no requests list" in capsys.readouterr().err
    torch.set_num_threads(1)
    assert oracle.main(["--shape", "tiny", "--limit", "1", "--out", str(tmp_path / "oracle")]) == 0
    built = json.loads((tmp_path / "oracle" / "oracle_tiny.json").read_text())
    assert built["workload"] == "jevbench231-shapes-estimated.json"  # the oracle's default workload
    with pytest.raises(SystemExit):
        bench.main(["--shape", "tiny", "--arms", "C", "--oracle", str(tmp_path / "oracle" / "oracle_tiny.json"),
                    "--manifest", str(MANIFEST), "--out", str(tmp_path / "o")])
    assert "built on another workload" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_scripts_import_the_library_not_each_other_through_sys_path():
    from pathlib import Path

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    for script in recipes.glob("*.py"):
        text = script.read_text()
        assert "sys.path.insert(0, str(Path(__file__)" not in text, script.name
        assert "from bench_jevbench import" not in text, script.name


def test_a_phase_timer_adds_each_call_s_ms_even_when_it_raises():
    import time

    load_recipe("bench_jevbench")  # recipes/ on the path
    from benchlib.timing import add_ms_to

    times = {"plan": 5.0}

    def step(x, *, fail=False):
        time.sleep(0.002)
        if fail:
            raise RuntimeError("step failed")
        return x + 1

    timed = add_ms_to(times, "plan", step)
    assert timed(1) == 2 and times["plan"] >= 5.0 + 2.0
    after_one = times["plan"]
    with pytest.raises(RuntimeError):
        timed(1, fail=True)
    assert times["plan"] >= after_one + 2.0 and set(times) == {"plan"}
    add_ms_to(times, "launch", step)(0)
    assert times["launch"] >= 2.0


def test_local_server_gives_a_free_port_and_stops_waiting_when_the_server_exits():
    import socket
    import subprocess
    import sys

    load_recipe("bench_jevbench")  # recipes/ on the path
    from benchlib.local_server import free_port, wait_healthy

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # nothing held it
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(RuntimeError, match="exited with status 3 before it was ready"):
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=30)


def test_profiler_lines_name_packages_not_machine_paths():
    package_relative = load_recipe("warmup_breakdown").package_relative  # benchlib.provenance's, as recipes use it
    line = f"3 0.1 /srv/py/lib/python3.12/site-packages/fla/ops/utils/cache.py:374(run) {REPO}/ops/_fla.py:1(x)"
    assert package_relative(line) == "3 0.1 fla/ops/utils/cache.py:374(run) ops/_fla.py:1(x)"

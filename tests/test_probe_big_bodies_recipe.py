"""recipes/probe_big_bodies.py: its options, its summary and its results files (the probe itself runs a server and
a flood for a minute: ``tests/test_server_abuse.py`` runs its flood against an in-process server)."""

import json

import pytest
from repo_data import load_recipe

probe = load_recipe("probe_big_bodies")


def test_summary_takes_the_median_p90_max_and_the_count_over_a_second():
    summary = probe._summary([float(ms) for ms in range(1, 10)] + [1000.5])  # 1 .. 9 ms and one over a second
    assert summary == {"requests": 10, "p50_ms": 5.5, "p90_ms": 9.0, "max_ms": 1000.5, "over_1_s": 1}


def test_results_files_name_the_figures_and_the_provenance(tmp_path):
    split = {"queue_ms": 1.0, "inference_ms": 40.0, "rest_ms": 159.0}
    result = {"quiet": probe._summary([10.0, 12.0]), "flooded": probe._summary([200.0, 500.0]),
              "flooded_split": probe._split_summary([split, {}]),
              "flood": {"clients": 8, "body_bytes": probe.FLOOD_BODY_BYTES, "requests": 96, "statuses": [422]},
              "command": "python3 recipes/probe_big_bodies.py --out x", "commit": "abc", "cpus": 2,
              "tokenizer": "qwen3.5", "versions": {"torch": "2.13.0"}}
    probe.write_results(result, tmp_path)
    assert json.loads((tmp_path / "big_bodies.json").read_text()) == result
    text = (tmp_path / "big_bodies.md").read_text()
    assert "| beside the flood | 2 | 350.0 | 500.0 | 500.0 | 0 |" in text
    assert "96 bodies of 4,194,304 bytes, all answered [422]" in text and "at abc, 2 CPUs" in text
    assert "median queue 1.0, inference 40.0, rest 159.0; the five slowest: queue 1.0, inference 40.0" in text


def test_a_small_count_below_one_is_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        probe.main(["--out", str(tmp_path), "--small", "0", "--tokenizer", "toy"])
    assert info.value.code == 2 and "--small must be at least 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []

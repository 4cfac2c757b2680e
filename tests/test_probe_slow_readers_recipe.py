"""recipes/probe_slow_readers.py: its readers and their watch against an in-process server (a handful of readers, a
small write timeout), its summary, its results files and its bounds (the probe itself starts ``hf-openjev serve`` and
200 readers for a minute or more: recipes/RESULTS.md)."""

import json

import pytest
from live_server import listening_socket, serving
from repo_data import load_recipe

from hf_openjev.serve.app import create_app
from hf_openjev.serve.lifecycle import begin_drain, build_server, finish_drain
from hf_openjev.serve.startup import _uvicorn_config

probe = load_recipe("probe_slow_readers")


@pytest.mark.usefixtures("one_torch_thread")
def test_the_watch_sees_readers_closed_by_the_write_timeout(tiny_model):
    app = create_app(tiny_model, max_wait_ms=0)
    config = _uvicorn_config(app, host="127.0.0.1", port=0, log_level="warning", drain_timeout_s=10,
                             limit_concurrency=None, header_timeout_s=10, write_timeout_s=0.5)
    server = build_server(config, on_exit=lambda: begin_drain(app), drain=lambda: finish_drain(app))
    with serving(server, sockets=[listening_socket(16384)]) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        readers = probe.open_readers("127.0.0.1", port, 4, probe.slow_reader_request(1_000_000))
        try:
            watch = probe.ClosedWatch(readers)
            for _ in range(400):  # 20 s at most
                if watch.check() == 0:
                    break
                probe.time.sleep(0.05)
        finally:
            for sock in readers:
                sock.close()
    assert watch.still_open == 0 and len(watch.closed_after) == 4


def test_summary_counts_the_closed_readers_and_the_memory_before_peak_and_end():
    samples = [{"s": 0.0, "open": 3, "rss_mib": 400.0, "kernel_tcp_mib": 10.0},
               {"s": 0.5, "open": 1, "rss_mib": 450.0, "kernel_tcp_mib": 30.0},
               {"s": 1.0, "open": 0, "rss_mib": 420.0, "kernel_tcp_mib": 2.0}]
    summary = probe.summarize(samples, [0.4, 0.9, 0.5], readers=3, baseline_rss_mib=390.0)
    assert summary == {"readers": 3, "closed": 3, "closed_p50_s": 0.5, "closed_max_s": 0.9, "watched_s": 1.0,
                       "rss_mib": {"before": 390.0, "peak": 450.0, "end": 420.0},
                       "kernel_tcp_mib": {"peak": 30.0, "end": 2.0}}
    assert probe.summarize(samples[:1], [], readers=3, baseline_rss_mib=1.0)["closed_p50_s"] is None


def test_results_files_name_the_figures_and_the_provenance(tmp_path):
    samples = [{"s": 0.0, "open": 2, "rss_mib": 400.0, "kernel_tcp_mib": 10.0},
               {"s": 31.0, "open": 0, "rss_mib": 410.0, "kernel_tcp_mib": 1.0}]
    result = probe.summarize(samples, [30.5, 31.0], readers=2, baseline_rss_mib=380.0)
    result.update(answer_bytes=3_000_000, write_timeout_s=30.0, readers_answered_200=2, small_request_after=200,
                  samples=samples, command="python3 recipes/probe_slow_readers.py --out x", commit="abc", cpus=2,
                  versions={"torch": "2.13.0"})
    probe.write_results(result, tmp_path)
    assert json.loads((tmp_path / "slow_readers.json").read_text()) == result
    text = (tmp_path / "slow_readers.md").read_text()
    assert "# 2 clients that never read their 3,000,000-byte answer" in text and "`--write-timeout 30`" in text
    assert "closed by the server: 2 of 2 within 31.0 s, after 30.8 s (median) and 31.0 s (last)" in text
    assert "380.0 MiB before, 410.0 MiB at the peak, 410.0 MiB at the end" in text and "at abc, 2 CPUs" in text


@pytest.mark.parametrize("option, value, message", [("--readers", "1001", "--readers must be 1..1000"),
                                                    ("--readers", "0", "--readers must be 1..1000"),
                                                    ("--seconds", "601", "--seconds must be in"),
                                                    ("--answer-bytes", "5000000", "--answer-bytes must be"),
                                                    ("--write-timeout", "0", "--write-timeout must be")])
def test_unbounded_or_bad_options_are_refused_before_anything_starts(tmp_path, capsys, option, value, message):
    with pytest.raises(SystemExit) as info:
        probe.main(["--out", str(tmp_path / "out"), option, value])
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

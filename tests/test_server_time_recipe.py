"""recipes/server_time.py on a few requests: the real app, tokenizer and client, a stand-in scorer; every request's
phases add up to its time in the app, and the phase timer's wrappers are removed afterwards."""

import json
import urllib.request

import pytest
from live_server import HTTP_STACKS
from repo_data import load_recipe

PARTS = ("routing", "body read", "json parse", "validation", "tokenization", "tokenizer proofs", "queueing",
         "hand-off", "scoring", "answer", "serialization", "response")  # "in app" is their sum, less scoring


def _wrapped_functions():
    from hf_openjev import contract, scoring
    from hf_openjev.serve import app
    from hf_openjev.serve.batcher import Batcher

    state = app._ServerState
    return (app.read_body_in_time, app.loads_strict, contract.parse_request, scoring._clean_cut_for,
            scoring._token_floor_for, scoring.build_answer, state.parse, state.tokenize, state.finish, Batcher.submit)


@pytest.mark.parametrize("stack", HTTP_STACKS)
def test_the_phases_of_short_and_long_requests_add_up_and_the_timer_is_removed(tmp_path, stack):
    recipe = load_recipe("server_time")
    originals = _wrapped_functions()
    assert recipe.main(["--out", str(tmp_path), "--limit", "3", "--repeats", "2", "--latency-ms", "2",
                        "--per-request", "--http", stack["http"], "--loop", stack["loop"]]) == 0
    assert _wrapped_functions() == originals
    result = json.loads((tmp_path / "server_time.json").read_text())
    assert result["http"] == {"httptools": "HttpToolsProtocol, uvloop", "h11": "H11Protocol, asyncio"}[stack["http"]]
    long_ids = {"hard-opus-c-long_policy-02", "hard-opus-c-long_policy-03", "hard-opus-c-long_policy-04",
                "hard-opus-c-long_policy-11"}  # the manifest's requests of 3,300 to 3,500 tokens
    assert result["n"] == 3 + len(long_ids) and len(result["requests"]) == 2 * result["n"]
    assert {r["id"] for r in result["requests"]} >= long_ids
    for request in result["requests"]:
        assert set(request) == {"id", *recipe.PHASES}
        assert request["scoring"] >= 2.0  # the stand-in's measured sleep
        assert sum(request[part] for part in PARTS) - request["scoring"] == pytest.approx(request["in app"], abs=1e-3)
        assert request["server"] >= request["in app"] > 0  # the client's wall holds the app's call
        assert request["tokenization"] > 0 and request["queueing"] > 0 and request["hand-off"] > 0
        assert request["HTTP floor"] > 0  # the bare app's pass, this request's wall less the app's measured wait
    for group in result["groups"].values():  # no server code at all: under the server's time, group by group
        assert group["HTTP floor"]["median_ms"] < group["server"]["median_ms"]
    assert result["groups"]["3,300-3,500"]["n"] == 2 * len(long_ids)
    markdown = (tmp_path / "server_time.md").read_text()
    assert "| tokenization |" in markdown and "3,300-3,500" in markdown and "stand-in scorer of 2 ms" in markdown
    assert "| HTTP floor |" in markdown


def test_the_floors_bare_app_answers_the_size_asked_after_the_wait(tmp_path):
    """The floor's app: lifespan accepted, the body read, a JSON answer of the real answers' size after the wait."""
    recipe = load_recipe("server_time")
    waits = []
    server, thread, port = recipe.serve(recipe.bare_app(0.002, 500, waits))
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/systemone", data=b'{"state": "s"}' * 100,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            payload = response.read()
    finally:
        server.should_exit = True
        thread.join(10)
    assert len(payload) == 500 and json.loads(payload)["pad"] == "x" * 489
    assert len(waits) == 1 and waits[0] >= 0.002


def test_a_shape_without_a_gpu_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys):
    recipe = load_recipe("server_time")
    monkeypatch.setattr(recipe.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(recipe, "load_requests", lambda *a, **k: pytest.fail("requests loaded before the check"))
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(["--out", str(tmp_path), "--shape", "2b"])
    assert exit_info.value.code == 2 and "--shape 2b: the real forward needs a CUDA GPU" in capsys.readouterr().err

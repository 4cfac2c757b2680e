"""recipes/oracle.py on the bench's tiny shape (CPU): fp32 scores of the bf16 weights, one candidate per forward;
the file written after every request, resumed, refused when it is another model's; the time budget. Then the
bench's --oracle mode: every arm and sweep entry judged against the oracle, a sabotaged entry failing the gate,
and a run on other weights refused."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch
from repo_data import load_recipe

from hf_openjev.fidelity_check.gate import hash_weights

KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
           "causal_conv1d_update")


def run_oracle(argv: list[str]) -> int:
    """oracle.main in this process, leaving Transformers' kernel bindings and torch's fp32 settings as found."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    oracle = load_recipe("oracle")
    precision = torch.get_float32_matmul_precision()
    with pytest.MonkeyPatch.context() as mp:
        for name in KERNELS:
            if hasattr(qwen, name):
                mp.setattr(qwen, name, getattr(qwen, name))
        try:
            return oracle.main(argv)
        finally:
            torch.set_float32_matmul_precision(precision)


@pytest.fixture(scope="module")
def oracle_run(tmp_path_factory):
    """The tiny shape's oracle over the workload's first 2 requests."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("oracle")
    assert run_oracle(["--shape", "tiny", "--limit", "2", "--out", str(out)]) == 0
    path = out / "oracle_tiny.json"
    return path, json.loads(path.read_text())


def test_the_recipe_puts_only_recipes_on_the_path():
    before = list(sys.path)
    load_recipe("oracle")
    added = {p for p in sys.path if p not in before} | {sys.path[0]}
    root = Path(__file__).resolve().parents[1]
    assert str(root) not in added and str(root / "recipes") in sys.path  # the package is the installed one


def test_the_oracle_is_fp32_arithmetic_on_the_bf16_weights(oracle_run, spec):
    _, oracle = oracle_run
    bench = load_recipe("bench_jevbench")
    stored = bench.build_model("tiny", seed=0, device="cpu")
    assert oracle["weights_sha256"] == hash_weights(stored)  # the bf16 weights, hashed before the upcast
    assert (oracle["format"], oracle["shape"], oracle["seed"], oracle["n_total"]) == ("hf-openjev-oracle/1", "tiny",
                                                                                        0, 231)
    assert oracle["n_done"] == 2 and not oracle["complete"]
    numerics = oracle["numerics"]
    assert not numerics["allow_tf32_matmul"] and not numerics["allow_tf32_cudnn"]
    assert numerics["float32_matmul_precision"] == "highest" and numerics["candidates_per_forward"] == 1
    assert set(oracle["kernels"]) == set(KERNELS)
    assert all(k.startswith("transformers.models.qwen3_5.") for k in oracle["kernels"].values())
    upcast = bench.build_model("tiny", seed=0, device="cpu").float()
    (item, prepared), = bench.build_workload(bench.SHAPES_FILE, vocab=bench.VOCAB, seed=0, limit=1)
    first = oracle["requests"][0]
    assert (first["id"], first["kind"]) == (item["id"], item["kind"])
    sequences = prepared.tokens[0]
    exact = [spec.score(upcast, ids) for ids in sequences]  # each candidate alone, float64 head
    assert first["scores"]["q"] == pytest.approx(exact, abs=1e-5)
    assert first["probabilities"]["q"] == pytest.approx(spec.softmax(exact, upcast.temperature), abs=1e-6)
    in_bf16 = [spec.score(stored, ids) for ids in sequences]
    assert max(abs(a - b) for a, b in zip(in_bf16, first["scores"]["q"])) > 1e-3  # not the bf16 arithmetic


def test_a_later_run_resumes_without_recomputing(oracle_run, tmp_path, capsys):
    path, first = oracle_run
    assert run_oracle(["--shape", "tiny", "--limit", "3", "--resume", str(path), "--out", str(tmp_path)]) == 0
    resumed = json.loads((tmp_path / "oracle_tiny.json").read_text())
    assert resumed["n_done"] == 3 and resumed["requests"][:2] == first["requests"]  # kept as they were
    assert len(resumed["runs"]) == 2 and resumed["seconds"] > first["seconds"]
    assert "2 done, 1 to score" in capsys.readouterr().out
    # its own output folder is resumed too: nothing left to do
    assert run_oracle(["--shape", "tiny", "--limit", "3", "--out", str(tmp_path)]) == 0
    assert "3 done, 0 to score" in capsys.readouterr().out
    assert json.loads((tmp_path / "oracle_tiny.json").read_text())["requests"] == resumed["requests"]


def test_a_gzipped_file_is_resumed_as_its_plain_one_and_a_corrupt_one_refused(oracle_run, tmp_path, capsys):
    """--resume X.json.gz (as committed in data/bench/): the same entries as X.json, nothing scored again, the
    output written as plain JSON; a cut .gz is refused in one line naming it, before any model is built."""
    path, first = oracle_run
    packed = tmp_path / "oracle_tiny.json.gz"
    packed.write_bytes(gzip.compress(path.read_bytes(), compresslevel=9, mtime=0))
    assert run_oracle(["--shape", "tiny", "--limit", "2", "--resume", str(packed), "--out", str(tmp_path / "a")]) == 0
    assert "2 done, 0 to score" in capsys.readouterr().out
    resumed = json.loads((tmp_path / "a" / "oracle_tiny.json").read_text())
    assert resumed["requests"] == first["requests"] and len(resumed["runs"]) == 2
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(packed.read_bytes()[:100])
    oracle = load_recipe("oracle")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(oracle, "build_model", lambda *a, **k: pytest.fail("a model was built for a corrupt --resume"))
        assert oracle.main(["--shape", "tiny", "--resume", str(broken), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert f"refusing to resume: {broken} is not a valid gzip file" in err and len(err.strip().splitlines()) == 1


def test_shards_score_their_share_and_a_last_run_merges_them(oracle_run, tmp_path, capsys):
    path, first = oracle_run
    assert run_oracle(["--shape", "tiny", "--limit", "3", "--shard", "0/2", "--out", str(tmp_path / "s0")]) == 0
    shard = json.loads((tmp_path / "s0" / "oracle_tiny.json").read_text())
    assert [e["id"] for e in shard["requests"]] == [first["requests"][0]["id"], "easy-intent-02"]  # indices 0, 2
    assert shard["requests"][0]["probabilities"] == first["requests"][0]["probabilities"]
    assert shard["shard"] == "0/2"
    capsys.readouterr()
    assert run_oracle(["--shape", "tiny", "--limit", "3", "--resume", str(path), "--resume",
                       str(tmp_path / "s0" / "oracle_tiny.json"), "--out", str(tmp_path / "merged")]) == 0
    assert "3 done, 0 to score" in capsys.readouterr().out
    merged = json.loads((tmp_path / "merged" / "oracle_tiny.json").read_text())
    assert [e["id"] for e in merged["requests"]] == ["easy-intent-00", "easy-intent-01", "easy-intent-02"]
    assert len(merged["runs"]) == 3  # the first run, the shard's, the merge
    with pytest.raises(SystemExit):
        run_oracle(["--shape", "tiny", "--shard", "2/2", "--out", str(tmp_path / "bad")])


def test_merge_only_joins_shards_without_a_model_and_refuses_another_models(oracle_run, tmp_path, monkeypatch,
                                                                             capsys):
    path, first = oracle_run
    oracle = load_recipe("oracle")
    monkeypatch.setattr(oracle, "build_model", lambda *a, **k: pytest.fail("--merge-only built a model"))
    shards = []
    for k in range(2):
        shard = dict(first, shard=f"{k}/2", requests=first["requests"][k::2], n_done=len(first["requests"][k::2]))
        shards.append(tmp_path / f"s{k}.json")
        shards[-1].write_text(json.dumps(shard))
    argv = ["--shape", "tiny", "--merge-only", "--out", str(tmp_path / "m")]
    assert oracle.main(argv + ["--resume", str(shards[0]), "--resume", str(shards[1])]) == 0
    merged = json.loads((tmp_path / "m" / "oracle_tiny.json").read_text())
    assert [e["id"] for e in merged["requests"]] == [e["id"] for e in first["requests"]]
    assert merged["shard"] is None and merged["n_done"] == first["n_done"]
    other = dict(json.loads(shards[1].read_text()), weights_sha256="0" * 64, stored_weights_sha256="0" * 64)
    shards[1].write_text(json.dumps(other))
    assert oracle.main(argv[:-1] + [str(tmp_path / "m2"), "--resume", str(shards[0]), "--resume", str(shards[1])]) == 2
    assert "refusing to resume" in capsys.readouterr().err


def test_the_time_budget_stops_cleanly_before_a_request(tmp_path, capsys):
    assert run_oracle(["--shape", "tiny", "--limit", "2", "--max-seconds", "0", "--out", str(tmp_path)]) == 0
    stopped = json.loads((tmp_path / "oracle_tiny.json").read_text())
    assert stopped["n_done"] == 0 and not stopped["complete"] and stopped["requests"] == []
    assert "stopped: --max-seconds 0" in capsys.readouterr().out


def test_the_estimate_leaves_out_the_warm_up_request():
    oracle = load_recipe("oracle")
    assert oracle.estimate_seconds([], 1000) == 0.0
    assert oracle.estimate_seconds([(100, 9.0)], 1000) == pytest.approx(1.5 * 1000 * 0.09)
    assert oracle.estimate_seconds([(100, 9.0), (100, 0.5), (300, 1.5)], 1000) == pytest.approx(1.5 * 1000 * 2 / 400)


@pytest.mark.parametrize("tamper, extra", [
    (lambda o: o.update(weights_sha256="0" * 64, stored_weights_sha256="0" * 64), []),  # another model's file
    (lambda o: o["requests"][1].update(tokens_sha256="0" * 64), []),
    (lambda o: None, ["--seed", "1"]),
])
def test_a_file_of_another_model_or_workload_is_not_resumed(oracle_run, tmp_path, tamper, extra, capsys):
    path, _ = oracle_run
    other = json.loads(path.read_text())
    tamper(other)
    resume = tmp_path / "resume.json"
    resume.write_text(json.dumps(other))
    out = tmp_path / "out"
    assert run_oracle(["--shape", "tiny", "--limit", "3", "--resume", str(resume), "--out", str(out), *extra]) == 2
    assert "refusing to resume" in capsys.readouterr().err
    assert not (out / "oracle_tiny.json").exists() and json.loads(resume.read_text()) == other


# --- bench_jevbench.py --oracle ----------------------------------------------------------------------------------

def test_the_bench_judges_every_configuration_and_a_wrong_prefix_fails(oracle_run, tmp_path, monkeypatch):
    import hf_openjev.fast_path as fast_path

    torch.set_num_threads(1)
    path, _ = oracle_run
    real = fast_path.score_fast
    sabotage = {"max_tokens": 4095}  # a real option (the bench refuses unknown ones) that marks the wrong-prefix entry
    wrong_label = json.dumps(sabotage)

    def score_fast(model, requests_tokens, options=None):
        chosen = options or fast_path.require_patches(model).options
        if chosen.max_tokens == sabotage["max_tokens"]:  # each question's candidates read their prefix mirrored
            requests_tokens = [[mirror_prefix(q) for q in r] for r in requests_tokens]
        return real(model, requests_tokens, options)

    monkeypatch.setattr(fast_path, "score_fast", score_fast)
    bench = load_recipe("bench_jevbench")
    rc = bench.main(["--shape", "tiny", "--limit", "2", "--arms", "C,B", "--parity-only", "B", "--passes", "1",
                     "--b-passes", "1", "--concurrency", "", "--single", "", "--long-candidate", "0",
                     "--sweep", f'[{{"min_shared_tokens": 16}}, {wrong_label}]', "--oracle", str(path),
                     "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "fidelity_tiny.json").read_text())
    configs = report["configurations"]
    assert list(configs) == ["C", "B", '{"min_shared_tokens": 16}', wrong_label]
    assert report["oracle_sha256_check"]["match"] and report["requests_compared"] == 2
    assert report["oracle_sha256_check"]["run"] == json.loads((tmp_path / "bench_tiny_bfloat16.json").read_text())[
        "weights_sha256"]
    assert configs["B"]["passes"] is True and configs["B"]["max_abs_dp"] > 0  # bf16 against fp32
    for name in ("C", '{"min_shared_tokens": 16}'):  # measured; bf16 rounding, not another model
        assert configs[name]["passes"] in (True, False) and configs[name]["max_abs_dp"] < 0.05
    wrong = configs[wrong_label]
    assert wrong["passes"] is False and any("max" in r for r in wrong["gate_reasons"])
    assert wrong["max_abs_dp"] > 2 * configs["B"]["max_abs_dp"]
    assert (tmp_path / "fidelity_tiny.png").read_bytes()[:4] == b"\x89PNG"
    assert "| `B` | 2 |" in (tmp_path / "fidelity_tiny.md").read_text()


def mirror_prefix(candidates: list[list[int]]) -> list[list[int]]:
    n = min(len(c) for c in candidates)
    common = next((i for i in range(n) if len({c[i] for c in candidates}) > 1), n)
    common = min(common, n - 1)  # the last token stays each candidate's own
    return [list(reversed(c[:common])) + c[common:] for c in candidates]


def test_the_bench_refuses_an_oracle_of_other_weights(oracle_run, tmp_path, capsys):
    path, _ = oracle_run
    bench = load_recipe("bench_jevbench")
    rc = bench.main(["--shape", "tiny", "--limit", "2", "--arms", "B", "--dtype", "float32", "--oracle", str(path),
                     "--concurrency", "", "--single", "", "--long-candidate", "0", "--out", str(tmp_path)])
    assert rc == 2 and "refusing to compare" in capsys.readouterr().err
    assert not (tmp_path / "fidelity_tiny.json").exists() and not (tmp_path / "bench_tiny_float32.json").exists()


@pytest.mark.parametrize("args", [["--seed", "1"], ["--shape", "mid"]])
def test_the_bench_refuses_an_oracle_of_another_seed_or_shape_before_any_work(oracle_run, tmp_path, args):
    path, _ = oracle_run
    bench = load_recipe("bench_jevbench")
    with pytest.raises(SystemExit):
        bench.main(["--shape", "tiny", "--arms", "C", "--oracle", str(path), *args, "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_an_oracle_with_the_whole_fingerprint_only_gains_the_stored_one_when_run_again(oracle_run, tmp_path):
    """The committed oracles carry ``weights_sha256`` alone: running the recipe again on the same seeded model
    scores nothing and writes ``stored_weights_sha256`` beside it (what an export of the weights matches)."""
    path, data = oracle_run
    legacy = {k: v for k, v in data.items() if k != "stored_weights_sha256"}
    out = tmp_path / "upgrade"
    out.mkdir()
    (out / "oracle_tiny.json").write_text(json.dumps(legacy))
    assert run_oracle(["--shape", "tiny", "--limit", "2", "--out", str(out)]) == 0
    upgraded = json.loads((out / "oracle_tiny.json").read_text())
    assert upgraded["weights_sha256"] == data["weights_sha256"]
    assert upgraded["stored_weights_sha256"] == data["stored_weights_sha256"]
    assert upgraded["requests"] == data["requests"]  # per-request seconds included: nothing was scored again

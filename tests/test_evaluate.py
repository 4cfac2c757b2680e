"""Tests for hf_openjev.eval.evaluate (``hf-openjev eval``) on the JevBench sample with a tiny CPU fp32 checkpoint."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import pytest
from repo_data import JEVBENCH_EASY as EASY

from hf_openjev.eval import cli as eval_cli
from hf_openjev.eval import evaluate as ev
from hf_openjev.eval.evaluate import EvalInputError, evaluate
from hf_openjev.eval.tasks import task_from_row

TOL = 1e-12
CPU = {"device": "cpu", "dtype": "float32", "progress": False}

pytestmark = [pytest.mark.skipif(not EASY.is_file(), reason="the JevBench sample is not available"),
              pytest.mark.usefixtures("one_torch_thread")]


def easy_rows() -> list[dict]:
    return [json.loads(line) for line in EASY.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_jsonl(path: Path, rows) -> Path:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text(encoding="utf-8").splitlines()]




@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> Path:
    from hf_openjev.export.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-eval")).export


@pytest.fixture(scope="module")
def easy_run(tiny_export, tmp_path_factory):
    out = tmp_path_factory.mktemp("easy-run")
    summary = evaluate(model=tiny_export, data=[EASY], out_dir=out, batch_size=16, **CPU)
    return out, summary


# -- a full run ---------------------------------------------------------------------------------------------------------

def test_easy_run_writes_the_three_outputs(easy_run):
    out, summary = easy_run
    assert (out / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text(encoding="utf-8")
    for heading in ("## Overall", "## By tier", "## By family", "## By kind", "reliability.png"):
        assert heading in report
    on_disk = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert on_disk["overall"] == summary["overall"]
    assert summary["counts"] == {"tasks": 48, "scored": 48, "invalid": 0, "scored_this_run": 48, "resumed": 0}
    assert list(summary["by_tier"]) == ["easy"]
    assert {k: v["n"] for k, v in summary["by_family"].items()} == {
        "extraction": 12, "fact": 12, "intent": 12, "tool_selection": 12}
    assert {k: v["n"] for k, v in summary["by_kind"].items()} == {"choice": 36, "noul": 12}
    o = summary["overall"]
    assert 0 < o["latency_p50"] <= o["latency_p95"]
    assert sum(b["n"] for b in summary["reliability"]) == 48


def test_results_follow_labels_and_the_metrics_match_them(easy_run):
    out, summary = easy_run
    records = read_results(out)
    rows = {r["id"]: r for r in easy_rows()}
    assert [r["id"] for r in records] == list(rows)
    for r in records:
        task = rows[r["id"]]
        assert r["labels"] == task["labels"] and list(r["probabilities"]) == task["labels"]
        assert math.isclose(sum(r["probabilities"].values()), 1.0, abs_tol=1e-9)
        top = max(r["probabilities"].values())
        assert r["prediction"] == min(k for k, p in r["probabilities"].items() if p == top)
        assert r["correct"] == (r["prediction"] == task["expected"])
    n = len(records)
    assert summary["overall"]["accuracy"] == pytest.approx(sum(r["correct"] for r in records) / n, abs=TOL)
    brier = sum(sum((p - (k == r["expected"])) ** 2 for k, p in r["probabilities"].items()) for r in records) / n
    assert summary["overall"]["brier"] == pytest.approx(brier, abs=TOL)


def test_probabilities_equal_the_pipeline_answers(easy_run, tiny_export):
    from hf_openjev.model import load_export
    from hf_openjev.scoring import answer_requests

    out, _ = easy_run
    records = {r["id"]: r for r in read_results(out)}
    model = load_export(tiny_export, dtype="float32", device="cpu")
    rows = [easy_rows()[i] for i in (0, 13, 30)]  # intent choice, fact noul, tool_selection choice
    responses = answer_requests(model, [{"state": r["state"], "questions": {r["id"]: r["question"]}} for r in rows])
    for row, response in zip(rows, responses):
        answer = response["answers"][row["id"]]
        got = records[row["id"]]["probabilities"]
        if answer["type"] == "noul":
            assert got["yes"] == pytest.approx(answer["noul"], abs=1e-6)
            assert got["no"] == pytest.approx(1 - answer["noul"], abs=1e-6)
        else:
            for label, p in answer["probabilities"].items():
                assert got[label] == pytest.approx(p, abs=1e-6)


def test_task_request_orders_criteria_by_labels():
    row = easy_rows()[0]
    task = task_from_row(row, tier="easy", file="easy.jsonl", line=1)
    question = task.request["questions"][row["id"]]
    assert list(question["criteria"]) == row["labels"] != sorted(row["labels"])
    assert task.request["state"] == row["state"] and question["type"] == "choice"
    score = {"id": "s", "state": {"a": 1}, "labels": ["0", "1", "2"], "expected": 2,
             "question": {"type": "score", "instructions": "How bad?", "criteria": ["low", "mid", "high"]}}
    task = task_from_row(score, tier="t", file="f", line=2)
    assert task.expected == "2" and task.request["questions"]["s"]["criteria"] == ["low", "mid", "high"]
    noul = {"state": "s", "labels": ["no", "yes"], "expected": "yes",
            "question": {"type": "noul", "instructions": "Is it?"}}
    task = task_from_row(noul, tier="t", file="f", line=7)
    assert task.id == "t:7" and "criteria" not in task.request["questions"]["q"]


# -- resume -------------------------------------------------------------------------------------------------------------

def test_rerun_skips_every_finished_task(easy_run, tiny_export, monkeypatch):
    out, first = easy_run

    def no_model(*args, **kwargs):
        raise AssertionError("nothing is pending: the model must not be loaded")

    monkeypatch.setattr(ev, "load_export", no_model)
    summary = evaluate(model=tiny_export, data=[EASY], out_dir=out, **CPU)
    assert summary["counts"]["scored_this_run"] == 0 and summary["counts"]["resumed"] == 48
    assert summary["overall"] == {**first["overall"]}
    assert len(read_results(out)) == 48


def test_interrupt_keeps_scored_tasks_and_rerun_completes(tiny_export, easy_run, tmp_path, monkeypatch):
    real = ev.score_prepared
    calls = {"n": 0}

    def flaky(model, prepared, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(model, prepared, **kwargs)

    monkeypatch.setattr(ev, "score_prepared", flaky)
    data = write_jsonl(tmp_path / "part.jsonl", easy_rows()[::2])  # 24 tasks over every family
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        evaluate(model=tiny_export, data=[data], out_dir=out, batch_size=5, **CPU)
    kept = read_results(out)
    assert len(kept) == 10  # two batches of 5 were scored before the interrupt
    monkeypatch.setattr(ev, "score_prepared", real)
    summary = evaluate(model=tiny_export, data=[data], out_dir=out, batch_size=16, **CPU)
    assert summary["counts"]["scored_this_run"] == 14 and summary["counts"]["resumed"] == 10
    assert summary["counts"]["scored"] == 24
    records = read_results(out)
    assert sorted(r["id"] for r in records) == sorted(r["id"] for r in easy_rows()[::2])
    full = {r["id"]: r for r in read_results(easy_run[0])}
    for r in records:  # the same answers as the uninterrupted run (up to fp32 batch-shape rounding)
        assert r["prediction"] == full[r["id"]]["prediction"]
        for label, p in r["probabilities"].items():
            assert p == pytest.approx(full[r["id"]]["probabilities"][label], abs=1e-6)


def test_no_resume_starts_afresh(tiny_export, tmp_path):
    data = write_jsonl(tmp_path / "few.jsonl", easy_rows()[:3])
    out = tmp_path / "out"
    evaluate(model=tiny_export, data=[data], out_dir=out, **CPU)
    summary = evaluate(model=tiny_export, data=[data], out_dir=out, resume=False, **CPU)
    assert summary["counts"]["scored_this_run"] == 3 and len(read_results(out)) == 3


# -- bad input ----------------------------------------------------------------------------------------------------------

def test_malformed_lines_are_reported_and_the_run_goes_on(tiny_export, tmp_path, capsys):
    rows = easy_rows()
    no_labels = dict(rows[2])
    del no_labels["labels"]
    bad_labels = dict(rows[3], labels=["report_damage", "nonexistent"])
    rejected = dict(rows[4], id="rejected", state=42)  # the contract rejects a numeric state (RequestError)
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        rows[0],                          # 1 ok
        '{"id": "broken", "state": ',     # 2 malformed JSON
        rows[1],                          # 3 ok
        no_labels,                        # 4 missing field
        "",                               # 5 blank: skipped
        bad_labels,                       # 6 labels do not match the criteria
        rows[0],                          # 7 duplicate id
        rejected,                         # 8 request rejected
        "[1, 2]",                         # 9 not an object
        rows[13],                         # 10 ok (noul)
    ])
    summary = evaluate(model=tiny_export, data=[path], out_dir=tmp_path / "out", **CPU)
    by_line = {e["line"]: e for e in summary["invalid"]}
    assert sorted(by_line) == [2, 4, 6, 7, 8, 9]
    assert all(e["file"] == str(path) for e in summary["invalid"])
    assert "malformed JSON" in by_line[2]["error"]
    assert "labels" in by_line[4]["error"]
    assert "criteria" in by_line[6]["error"]
    assert "duplicate" in by_line[7]["error"] and f"{path}:1" in by_line[7]["error"]
    assert "state must be text" in by_line[8]["error"] and by_line[8]["id"] == "rejected"
    assert summary["counts"] == {"tasks": 9, "scored": 3, "invalid": 6, "scored_this_run": 3, "resumed": 0}
    err = capsys.readouterr().err
    for line in (2, 4, 6, 7, 8, 9):
        assert f"{path}:{line}:" in err
    report = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "## Invalid tasks" in report and "malformed JSON" in report


def test_missing_file_fails_before_the_model_is_loaded(tiny_export, tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(ev, "load_export", no_model)
    monkeypatch.setattr("hf_openjev.checkpoint.manifest.read_manifest", no_model)
    missing = tmp_path / "nope" / "hard.jsonl"
    with pytest.raises(EvalInputError, match="hard.jsonl: no such file"):
        evaluate(model=tiny_export, data=[EASY, missing], out_dir=tmp_path / "out", **CPU)
    assert not (tmp_path / "out").exists()
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(EvalInputError, match="unsupported input"):
        evaluate(model=tiny_export, data=[tmp_path / "notes.txt"], out_dir=tmp_path / "out", **CPU)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(EASY, other / "easy.jsonl")
    with pytest.raises(EvalInputError, match="tier name 'easy'"):
        evaluate(model=tiny_export, data=[EASY, other / "easy.jsonl"], out_dir=tmp_path / "out", **CPU)
    with pytest.raises(EvalInputError, match="no evaluation data"):
        evaluate(model=tiny_export, data=[], out_dir=tmp_path / "out", **CPU)
    assert isinstance(EvalInputError("x"), ValueError)


def test_cli_run(tiny_export, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    eval_cli.add_arguments(parser)
    data = write_jsonl(tmp_path / "few.jsonl", easy_rows()[:2])
    args = parser.parse_args(["--model", str(tiny_export), "--data", str(data), "--out", str(tmp_path / "o"),
                              "--device", "cpu", "--dtype", "float32", "--no-progress", "--batch-size", "2"])
    assert eval_cli.run(args) == 0
    assert "2 tasks scored" in capsys.readouterr().out
    assert (tmp_path / "o" / "summary.json").is_file()
    args = parser.parse_args(["--model", str(tiny_export), "--data", str(tmp_path / "missing.jsonl")])
    assert eval_cli.run(args) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err


# -- datasets inputs ----------------------------------------------------------------------------------------------------

def test_parquet_directory_via_datasets_matches_jsonl(tiny_export, easy_run, tmp_path):
    import datasets

    rows = easy_rows()[::4]  # 12 tasks over every family
    directory = tmp_path / "easy_parquet"
    directory.mkdir()
    # Arrow unifies the criteria structs of all rows (missing keys become null): the loader must undo that
    datasets.Dataset.from_list(rows).to_parquet(str(directory / "part-0.parquet"))
    summary = evaluate(model=tiny_export, data=[directory], out_dir=tmp_path / "out", **CPU)
    assert summary["counts"]["invalid"] == 0 and summary["counts"]["scored"] == 12
    assert list(summary["by_tier"]) == ["easy_parquet"]
    full = {r["id"]: r for r in read_results(easy_run[0])}
    for r in read_results(tmp_path / "out"):
        assert r["tier"] == "easy_parquet" and r["labels"] == full[r["id"]]["labels"]
        for label, p in r["probabilities"].items():
            assert p == pytest.approx(full[r["id"]]["probabilities"][label], abs=1e-6)


def test_json_file_via_datasets_with_question_as_string(tiny_export, tmp_path):
    rows = [dict(r, question=json.dumps(r["question"])) for r in easy_rows()[:2]]
    path = tmp_path / "strings.json"
    path.write_text(json.dumps(rows), encoding="utf-8")
    summary = evaluate(model=tiny_export, data=[path], out_dir=tmp_path / "out", **CPU)
    assert summary["counts"]["scored"] == 2 and list(summary["by_tier"]) == ["strings"]


# -- acceptance: a uniform head, where the tie rule decides everything ----------------------------------------------

def heldout_tiers(tmp_path: Path) -> list[Path]:
    """Held-out-style tiers: JSON-object states, score tasks, null descriptions, paraphrase groups."""
    def choice(i, labels, expected, group=None, desc=True):
        criteria = {k: (f"means {k}" if desc else None) for k in sorted(labels)}
        return {"id": f"std-choice-{i}", "family": "routing", "group": group, "split": "public",
                "state": {"ticket": i, "text": f"message number {i}"}, "labels": labels, "expected": expected,
                "question": {"type": "choice", "instructions": {"task": "route", "n": i}, "criteria": criteria}}

    def score(i, levels, expected, group=None):
        return {"id": f"std-score-{i}", "family": "severity", "group": group, "split": "public",
                "state": f"incident {i}", "labels": [str(k) for k in range(len(levels))], "expected": expected,
                "question": {"type": "score", "instructions": "How severe?", "criteria": levels}}

    def noul(i, expected, group=None, criteria=True):
        q = {"type": "noul", "instructions": f"Is claim {i} supported?"}
        if criteria:
            q["criteria"] = {"false": "no support", "true": "supported"}
        return {"id": f"hard-noul-{i}", "family": "fact", "group": group, "split": "public",
                "state": [f"doc {i}", {"k": i}], "labels": ["no", "yes"], "expected": expected, "question": q}

    standard = [
        choice(0, ["track", "cancel", "billing"], "billing", group="p1"),   # tie -> "billing": correct
        choice(1, ["track", "cancel", "billing"], "track", group="p1"),     # first in order, but wrong
        choice(2, ["zeta", "alpha"], "alpha", desc=False, group="p2"),
        choice(3, ["zeta", "alpha"], "alpha", group="p2"),
        choice(4, ["e", "d", "c", "b", "a", "f", "g"], "a"),
        choice(5, ["only"], "only"),
        score(0, ["none", "minor", "major"], 0),
        score(1, ["none", "minor", "major", "critical"], 3),
        score(2, ["l0", "l1", "l2", "l3", "l4", "l5", "l6", "l7", "l8", "l9"], 4),
        score(3, ["low", "high"], 1, group="p3"),
        score(4, ["low", "high"], 0, group="p3"),
    ]
    hard = [noul(0, "no"), noul(1, "yes"), noul(2, "no", criteria=False, group="p4"),
            noul(3, "no", group="p4"), noul(4, "yes")]
    return [write_jsonl(tmp_path / "standard.jsonl", standard), write_jsonl(tmp_path / "hard.jsonl", hard)]


def independent_metrics(tasks: list[dict]) -> dict:
    """Accuracy, Brier, ECE, log loss and ordinal MAE for uniform distributions, computed from scratch."""
    import numpy as np

    n = np.array([len(t["labels"]) for t in tasks], dtype=np.float64)
    correct = np.array([min(t["labels"]) == str(t["expected"]) for t in tasks], dtype=np.float64)
    conf = 1.0 / n
    edges = np.linspace(0.0, 1.0, 11)
    bins = np.clip(np.digitize(conf, edges[1:-1], right=False), 0, 9)
    ece = 0.0
    for b in range(10):
        mask = bins == b
        if mask.any():
            ece += abs(correct[mask].mean() - conf[mask].mean()) * mask.sum() / len(tasks)
    scores = [t for t in tasks if t["question"]["type"] == "score"]
    mae = np.mean([abs((len(t["labels"]) - 1) / 2 - t["expected"]) for t in scores]) if scores else None
    return {"accuracy": correct.mean(), "brier": np.mean((1 - 1 / n) ** 2 + (n - 1) / n ** 2),
            "ece": ece, "log_loss": np.mean(np.log(n)), "ordinal_mae": mae}


@pytest.fixture(scope="module")
def uniform_export(tiny_export, tmp_path_factory) -> Path:
    from hf_openjev.checkpoint.manifest import MANIFEST_NAME

    export = tmp_path_factory.mktemp("uniform") / "export"
    shutil.copytree(tiny_export, export)
    manifest = json.loads((export / MANIFEST_NAME).read_text(encoding="utf-8"))
    manifest["head_weight"] = [0.0] * len(manifest["head_weight"])
    manifest["head_bias"] = 0.0  # noul: p = softmax([0, 0])[1] = 0.5
    (export / MANIFEST_NAME).write_text(json.dumps(manifest), encoding="utf-8")
    return export


def test_acceptance_uniform_head_metrics_equal_an_independent_computation(uniform_export, tmp_path):
    data = heldout_tiers(tmp_path)
    summary = evaluate(model=uniform_export, data=data, out_dir=tmp_path / "out", batch_size=8, **CPU)
    assert summary["counts"]["invalid"] == 0
    tasks = {p.stem: [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines()] for p in data}
    everything = [t for ts in tasks.values() for t in ts]
    for r in read_results(tmp_path / "out"):  # every distribution is exactly uniform
        assert all(p == pytest.approx(1 / len(r["labels"]), abs=TOL) for p in r["probabilities"].values())
    for name, block in [("overall", summary["overall"])] + [(t, summary["by_tier"][t]) for t in tasks]:
        expected = independent_metrics(everything if name == "overall" else tasks[name])
        for key in ("accuracy", "brier", "ece", "log_loss"):
            assert block[key] == pytest.approx(expected[key], abs=TOL), (name, key)
    std = summary["by_tier"]["standard"]
    assert std["ordinal_mae"] == pytest.approx(independent_metrics(tasks["standard"])["ordinal_mae"], abs=TOL)
    # the tie rule, not "first in option order": std-choice-0 right, std-choice-1 wrong
    results = {r["id"]: r for r in read_results(tmp_path / "out")}
    assert results["std-choice-0"]["prediction"] == "billing" and results["std-choice-0"]["correct"]
    assert results["std-choice-1"]["prediction"] == "billing" and not results["std-choice-1"]["correct"]
    assert results["hard-noul-1"]["prediction"] == "no"
    assert results["std-score-2"]["prediction"] == "0"
    # groups p1 (mixed), p2 (all right), p3 (mixed: "0" predicted), p4 (all right)
    assert summary["overall"]["n_groups"] == 4
    assert summary["overall"]["consistency"] == pytest.approx(0.5, abs=TOL)


def test_resuming_with_another_model_is_refused(uniform_export, tiny_export, tmp_path):
    data = write_jsonl(tmp_path / "few.jsonl", easy_rows()[:2])
    evaluate(model=uniform_export, data=[data], out_dir=tmp_path / "out", **CPU)
    with pytest.raises(EvalInputError, match="another model"):
        evaluate(model=tiny_export, data=[data], out_dir=tmp_path / "out", **CPU)
    summary = evaluate(model=tiny_export, data=[data], out_dir=tmp_path / "out", resume=False, **CPU)
    assert summary["counts"]["scored_this_run"] == 2


# -- batches bounded by tokens, --limit ------------------------------------------------------------------------------

def test_a_batch_is_bounded_by_tokens_and_scores_as_before(tiny_export, easy_run, tmp_path, monkeypatch):
    from hf_openjev.work_tokens import task_cost

    calls = []
    real = ev.score_prepared

    def recording(model, prepared, **kwargs):
        calls.append(([task_cost(p, "reference") for p in prepared], kwargs.get("batch_tokens")))
        return real(model, prepared, **kwargs)

    monkeypatch.setattr(ev, "score_prepared", recording)
    bound = 1500
    evaluate(model=tiny_export, data=[EASY], out_dir=tmp_path / "o", batch_size=16, batch_tokens=bound, **CPU)
    assert len(calls) > 3  # 16 tasks a batch by count alone
    assert all(sum(costs) <= bound or len(costs) == 1 for costs, _ in calls), calls
    assert all(passed == bound for _, passed in calls)  # the reference forwards get the same bound
    bounded = {r["id"]: r["probabilities"] for r in read_results(tmp_path / "o")}
    unbounded = {r["id"]: r["probabilities"] for r in read_results(easy_run[0])}
    assert bounded.keys() == unbounded.keys()
    for key, probs in bounded.items():
        assert all(abs(p - q) < 1e-5 for p, q in zip(probs.values(), unbounded[key].values())), key


def test_limit_scores_the_first_tasks_only(tiny_export, tmp_path):
    summary = evaluate(model=tiny_export, data=[EASY], out_dir=tmp_path / "o", limit=3, **CPU)
    assert summary["counts"]["scored"] == 3
    assert [r["id"] for r in read_results(tmp_path / "o")] == [str(row["id"]) for row in easy_rows()[:3]]


@pytest.mark.parametrize("option, value, message", [("limit", 0, "limit (--limit) must be a positive integer"),
                                                     ("batch_tokens", 0, "batch_tokens (--batch-tokens) must be")])
def test_limit_and_batch_tokens_are_checked_before_anything_is_read(tmp_path, option, value, message):
    from hf_openjev.errors import UsageError

    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        evaluate(model=tmp_path / "missing", data=[tmp_path / "missing.jsonl"], out_dir=tmp_path / "o",
                 **{option: value}, **CPU)

"""hf_openjev.contract's table of question kinds (KINDS): every reader of an answer agrees with it, one decision rule
(noul: exactly 0.5 is "no"), one near-tie rule, the kinds' names written once, the committed fidelity verdicts kept."""

from __future__ import annotations

import json
import re

import pytest
from repo_data import REPO, load_recipe, read_committed_oracle, repo_path

from hf_openjev.contract import (
    DIFFERING_READINGS,
    KIND_NAMES,
    KINDS,
    NEAR_TIE_MARGIN,
    answers_from_scores,
    first_argmax,
    parse_request,
)
from hf_openjev.eval import metrics
from hf_openjev.export.verify import _flat_probabilities
from hf_openjev.fidelity_check.gate import find_flip, probabilities_from_response
from hf_openjev.fidelity_check.report import task_distribution

load_recipe("bench_jevbench")  # puts recipes/ on sys.path, as the recipes run
from benchlib.parity import parity  # noqa: E402 - importable only once recipes/ is on sys.path

QUESTIONS = {
    "choice": {"type": "choice", "instructions": "Which queue?", "criteria": {"tech": None, "billing": "money"}},
    "score": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]},
    "noul": {"type": "noul", "instructions": "Is it late?"},
}
SCORE_ROWS = {  # per kind: candidate scores, exact ties included (noul s = 0 gives p = 0.5 exactly)
    "choice": [[0.0, 0.0], [1.0, -0.5], [-2.0, 0.3]],
    "score": [[0.0, 0.0, 0.0], [0.3, 2.0, -1.0], [1.0, 1.0, -3.0]],
    "noul": [[0.0], [0.02], [-0.02], [3.0], [-3.0]],
}


def _response(kind: str, scores: list[float]) -> dict:
    parsed = parse_request({"state": "s", "questions": {"q": QUESTIONS[kind]}})
    return {"answers": answers_from_scores(parsed, [scores], 1.0)}


def _noul(p: float) -> dict:
    return {"answers": {"q": {"type": "noul", "noul": p}}}


def test_the_names_of_the_kinds_are_the_tables():
    assert KIND_NAMES == tuple(KINDS) == ("choice", "score", "noul")
    assert all(KINDS[name].name == name for name in KINDS)


def test_the_kinds_tuple_is_written_once():
    """No file of the package, the recipes, ops or patches lists the three names itself: they read KIND_NAMES."""
    names = r"""\s*["'](?:choice|score|noul)["']\s*"""
    literal = re.compile(rf"[(\[]{names},{names},{names}[)\]]")
    found = [str(path.relative_to(REPO)) for folder in ("hf_openjev", "recipes", "ops", "patches")
             for path in sorted((REPO / folder).rglob("*.py")) if literal.search(path.read_text())]
    assert found == []


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_every_reader_of_an_answer_agrees_with_the_table(kind):
    question = KINDS[kind]
    for scores in SCORE_ROWS[kind]:
        response = _response(kind, scores)
        answer = response["answers"]["q"]
        p = question.probabilities(answer)
        labels = question.labels(answer)
        table = dict(zip(labels, question.distribution(p)))
        decided = question.decision(answer)
        assert probabilities_from_response(response) == {"q": p}
        assert _flat_probabilities(response) == (p, [f"q:{decided}"])
        assert metrics.distribution(kind, answer, list(labels)) == table
        assert task_distribution(kind, p, list(labels)) == table
        assert question.decide(p) == first_argmax(question.distribution(p))
        assert decided == {"choice": lambda: answer.get("choice"), "score": lambda: str(first_argmax(p)),
                           "noul": lambda: "yes" if p[0] > 0.5 else "no"}[kind]()
        if metrics.predict(table) != decided:  # only the reading the table names as different
            assert kind == "choice" and "hf_openjev.eval.metrics.predict" in DIFFERING_READINGS
            assert sorted(labels)[0] != labels[0] and len(set(table.values())) < len(table)
        for other in SCORE_ROWS[kind]:  # the recipes' parity counts the gate's flips and near-ties
            p_other = question.probabilities(_response(kind, other)["answers"]["q"])
            flip = find_flip(kind, p, p_other)
            counted = parity([response], [_response(kind, other)])
            assert (counted["decision_flips"], counted["near_tie_flips"]) == (
                (0, 0) if flip is None else (0, 1) if flip["near_tie"] else (1, 0))


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_index_criteria_make_a_question_of_n_candidates(kind):
    question = {"type": kind, "instructions": "x"}
    criteria = KINDS[kind].index_criteria(3)
    if criteria is not None:
        question["criteria"] = criteria
    parsed = parse_request({"state": "x", "questions": {"q": question}}).questions[0]
    assert parsed.labels == (KINDS[kind].fixed_candidates or parsed.labels)
    assert len(parsed.prompts) == len(KINDS[kind].fixed_candidates or range(3))


def test_a_noul_at_exactly_half_is_no_everywhere():
    """The fidelity gate, export verification, eval and the recipes' parity all read p_yes = 0.5 as "no"."""
    assert find_flip("noul", [0.5], [0.4]) is None
    assert find_flip("noul", [0.4], [0.5]) is None
    assert _flat_probabilities(_noul(0.5))[1] == _flat_probabilities(_noul(0.4))[1]
    assert metrics.predict(metrics.distribution("noul", _noul(0.5)["answers"]["q"], ["no", "yes"])) == "no"
    assert parity([_noul(0.5)], [_noul(0.4)])["decision_flips"] + parity([_noul(0.5)], [_noul(0.4)])[
        "near_tie_flips"] == 0
    flip = find_flip("noul", [0.5], [0.6])
    assert (flip["oracle"], flip["config"], flip["near_tie"]) == ("no", "yes", True)
    assert _flat_probabilities(_noul(0.5))[1] != _flat_probabilities(_noul(0.6))[1]
    assert parity([_noul(0.5)], [_noul(0.6)])["near_tie_flips"] == 1


@pytest.mark.parametrize("kind, oracle_p, config_p", [
    ("choice", [0.5075, 0.4925], [0.49, 0.51]),  # margin 0.015: a near-tie by the gate's 0.02
    ("noul", [0.508], [0.49]),  # |p - 0.5| = 0.008 < 0.01, margin p_yes - p_no = 0.016
    ("choice", [0.52, 0.48], [0.49, 0.51]),  # margin 0.04: a flip
])
def test_the_fidelity_gate_and_the_recipes_parity_share_one_near_tie_rule(kind, oracle_p, config_p):
    def response(p):
        if kind == "noul":
            return _noul(p[0])
        return {"answers": {"q": {"type": kind, "probabilities": dict(zip("ab", p))}}}

    flip = find_flip(kind, oracle_p, config_p)
    counted = parity([response(oracle_p)], [response(config_p)])
    assert (counted["decision_flips"], counted["near_tie_flips"]) == ((0, 1) if flip["near_tie"] else (1, 0))
    assert flip["near_tie"] == (flip["oracle_margin"] < NEAR_TIE_MARGIN)


def test_the_noul_near_tie_is_half_the_margin_on_p():
    """docs/design.md "Numerics": noul is a near-tie when |p - 0.5| < 0.01, the top-two margin < 0.02 on [1-p, p]."""
    for k in range(-300, 301):
        p = 0.5 + k * 1e-4
        for q in (p, p + 1e-17, 0.49, 0.51, 0.5 - NEAR_TIE_MARGIN / 2, 0.5 + NEAR_TIE_MARGIN / 2):
            assert KINDS["noul"].near_tie([q]) == (abs(q - 0.5) < NEAR_TIE_MARGIN / 2), q


@pytest.mark.parametrize("shape", ["2b", "9b", "27b", "mid"])
def test_the_committed_fidelity_reports_keep_their_verdicts(shape):
    """Every committed flip re-read by the table from the committed oracle: the same oracle side, the same near-tie
    verdict, the same counts; and no noul probability (the oracle's, or a configuration's p_oracle +- |dp|) sits at
    exactly 0.5, where the rule changed (fidelity counted 0.5 as "yes" before)."""
    report = json.loads(repo_path(f"recipes/results/fidelity_{shape}.json").read_text())
    oracle = read_committed_oracle(shape)
    entries = {e["id"]: e for e in oracle["requests"]}
    assert report["gate"]["near_tie_margin"] == NEAR_TIE_MARGIN
    for name, config in report["configurations"].items():
        for flip in config["flipped_requests"]:
            question = KINDS[flip["kind"]]
            p = entries[flip["id"]]["probabilities"][flip["question"]]
            side = question.decide(p)
            assert (question.decisions[side] if question.decisions else side) == flip["oracle"], (name, flip)
            assert question.near_tie(p) == flip["near_tie"], (name, flip)
        near = sum(f["near_tie"] for f in config["flipped_requests"])
        assert (config["flips"], config["near_tie_flips"]) == (len(config["flipped_requests"]) - near, near)
        for entry, dp in zip(oracle["requests"], config["per_request_max_abs_dp"], strict=True):
            if entry["kind"] == "noul":
                (p,) = entry["probabilities"]["q"]
                assert p != 0.5 and dp != abs(p - 0.5), (name, entry["id"])

"""Tests for hf_openjev.eval.metrics: hand-computed small examples with exact numbers."""

from __future__ import annotations

import math

import pytest

from hf_openjev.eval import metrics as M

TOL = 1e-12


def rec(probs, expected, *, kind="choice", group=None, latency=None, family="f", tier="t"):
    labels = list(probs)
    prediction = M.predict(probs)
    return {"id": f"x{id(probs)}", "tier": tier, "family": family, "kind": kind, "group": group, "labels": labels,
            "expected": expected, "probabilities": dict(probs), "prediction": prediction,
            "correct": prediction == expected, "latency": latency}


# -- prediction and the tie rule ---------------------------------------------------------------------------------------

def test_predict_argmax_without_ties():
    assert M.predict({"track": 0.2, "cancel": 0.3, "billing": 0.5}) == "billing"
    assert M.predict({"b": 0.6, "a": 0.4}) == "b"


def test_predict_ties_go_to_lexicographically_smallest_label():
    # not the first in option order (the contract's rule): "billing" < "cancel" < "track"
    assert M.predict({"track": 0.4, "cancel": 0.4, "billing": 0.2}) == "cancel"
    assert M.predict({"track": 1 / 3, "cancel": 1 / 3, "billing": 1 / 3}) == "billing"
    assert M.predict({"yes": 0.5, "no": 0.5}) == "no"
    assert M.predict({"0": 0.25, "1": 0.25, "2": 0.25, "3": 0.25}) == "0"
    assert M.predict({"b": 0.5, "B": 0.5}) == "B"  # plain str ordering


def test_predict_empty_raises():
    with pytest.raises(ValueError):
        M.predict({})


def test_noul_distribution_and_tie():
    probs = M.distribution("noul", {"type": "noul", "noul": 0.7}, ["no", "yes"])
    assert list(probs) == ["no", "yes"]
    assert probs["yes"] == 0.7 and probs["no"] == pytest.approx(0.3, abs=TOL)
    assert M.predict(M.distribution("noul", {"noul": 0.5}, ["no", "yes"])) == "no"
    assert M.predict(M.distribution("noul", {"noul": 0.5000001}, ["no", "yes"])) == "yes"


def test_choice_and_score_distribution_follow_labels_order():
    answer = {"type": "choice", "probabilities": {"a": 0.1, "b": 0.2, "c": 0.7}}
    assert list(M.distribution("choice", answer, ["c", "a", "b"])) == ["c", "a", "b"]
    score = {"type": "score", "probabilities": {"0": 0.5, "1": 0.5}}
    assert M.distribution("score", score, ["0", "1"]) == {"0": 0.5, "1": 0.5}


# -- per-task metrics -----------------------------------------------------------------------------------------------------

def test_brier_multiclass_hand_computed():
    probs = {"a": 0.7, "b": 0.2, "c": 0.1}
    assert M.brier(probs, "a") == pytest.approx(0.09 + 0.04 + 0.01, abs=TOL)  # 0.14
    assert M.brier(probs, "b") == pytest.approx(0.49 + 0.64 + 0.01, abs=TOL)  # 1.14
    # noul: both labels count: 2 * (1 - p_expected)^2
    assert M.brier({"no": 0.25, "yes": 0.75}, "yes") == pytest.approx(0.125, abs=TOL)


def test_log_loss_and_floor():
    assert M.log_loss({"a": 0.7, "b": 0.3}, "a") == pytest.approx(-math.log(0.7), abs=TOL)
    assert M.log_loss({"a": 1.0, "b": 0.0}, "b") == pytest.approx(34.538776394910684, abs=1e-9)


def test_expected_level():
    assert M.expected_level({"0": 0.2, "1": 0.5, "2": 0.3}) == pytest.approx(1.1, abs=TOL)


# -- ECE --------------------------------------------------------------------------------------------------------------------

def test_bin_edges():
    assert M.bin_index(0.0) == 0
    assert M.bin_index(0.0999) == 0
    assert M.bin_index(0.1) == 1
    assert M.bin_index(0.25) == 2
    assert M.bin_index(0.3) == 3
    assert M.bin_index(0.5) == 5
    assert M.bin_index(0.9) == 9
    assert M.bin_index(0.95) == 9
    assert M.bin_index(1.0) == 9  # last bin closed


def test_ece_hand_computed():
    confs = [0.95, 0.85, 0.85, 0.55, 0.15]
    corrects = [True, True, False, True, False]
    # bin 9: |1 - .95| * 1/5 = .01; bin 8: |.5 - .85| * 2/5 = .14; bin 5: |1 - .55| / 5 = .09; bin 1: .15 / 5 = .03
    assert M.ece(confs, corrects) == pytest.approx(0.27, abs=TOL)
    bins = M.reliability_bins(confs, corrects)
    assert [b["n"] for b in bins] == [0, 1, 0, 0, 0, 1, 0, 0, 2, 1]
    assert bins[8]["accuracy"] == 0.5 and bins[8]["confidence"] == pytest.approx(0.85, abs=TOL)
    assert bins[0]["accuracy"] is None


def test_ece_perfectly_calibrated_is_zero():
    assert M.ece([0.5, 0.5], [True, False]) == 0.0


# -- aggregates -----------------------------------------------------------------------------------------------------------

def test_ordinal_mae_uses_expected_level_and_reports_argmax_too():
    records = [rec({"0": 0.2, "1": 0.5, "2": 0.3}, "2", kind="score"),
               rec({"0": 0.6, "1": 0.3, "2": 0.1}, "0", kind="score"),
               rec({"a": 0.9, "b": 0.1}, "a")]  # not a score task: ignored
    m = M.compute_metrics(records)
    assert m["n_score"] == 2
    assert m["ordinal_mae"] == pytest.approx((0.9 + 0.5) / 2, abs=TOL)  # |1.1 - 2|, |0.5 - 0|
    assert m["ordinal_mae_argmax"] == pytest.approx((1 + 0) / 2, abs=TOL)
    assert M.compute_metrics(records[2:])["ordinal_mae"] is None


def test_chance_corrected_accuracy():
    records = [rec({"no": 0.2, "yes": 0.8}, "yes", kind="noul"),  # correct, chance 1/2
               rec({"a": 0.7, "b": 0.1, "c": 0.1, "d": 0.1}, "b")]  # wrong, chance 1/4
    m = M.compute_metrics(records)
    assert m["accuracy"] == 0.5
    assert m["chance"] == pytest.approx(0.375, abs=TOL)
    assert m["chance_corrected_accuracy"] == pytest.approx(0.2, abs=TOL)
    assert M.compute_metrics([rec({"only": 1.0}, "only")])["chance_corrected_accuracy"] is None


def test_consistency_within_paraphrase_groups():
    right, wrong = {"a": 0.9, "b": 0.1}, {"a": 0.1, "b": 0.9}
    records = [rec(right, "a", group="g1"), rec(right, "a", group="g1"),  # all correct
               rec(wrong, "a", group="g2"), rec(wrong, "a", group="g2"),  # all wrong: consistent
               rec(right, "a", group="g3"), rec(wrong, "a", group="g3"),  # mixed
               rec(right, "a", group="g4"),  # singleton: ignored
               rec(wrong, "a")]  # no group: ignored
    m = M.compute_metrics(records)
    assert m["n_groups"] == 3
    assert m["consistency"] == pytest.approx(2 / 3, abs=TOL)
    assert m["group_all_correct"] == pytest.approx(1 / 3, abs=TOL)
    assert M.compute_metrics(records[6:])["consistency"] is None


def test_percentiles_linear_interpolation():
    assert M.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5, abs=TOL)
    assert M.percentile([4.0, 1.0, 3.0, 2.0], 95) == pytest.approx(3.85, abs=TOL)
    assert M.percentile([7.0], 95) == 7.0


def test_compute_metrics_small_set_exact():
    records = [rec({"a": 0.7, "b": 0.2, "c": 0.1}, "a", latency=0.1),  # correct, conf .7
               rec({"a": 0.7, "b": 0.2, "c": 0.1}, "b", latency=0.3),  # wrong, conf .7
               rec({"no": 0.4, "yes": 0.6}, "yes", kind="noul", latency=0.2)]  # correct, conf .6
    m = M.compute_metrics(records)
    assert m["n"] == 3
    assert m["accuracy"] == pytest.approx(2 / 3, abs=TOL)
    assert m["brier"] == pytest.approx((0.14 + 1.14 + 0.32) / 3, abs=TOL)
    assert m["log_loss"] == pytest.approx(-(math.log(0.7) + math.log(0.2) + math.log(0.6)) / 3, abs=TOL)
    # bin 7: acc .5, conf .7, n 2; bin 6: acc 1, conf .6, n 1
    assert m["ece"] == pytest.approx(0.2 * 2 / 3 + 0.4 / 3, abs=TOL)
    assert m["latency_p50"] == pytest.approx(0.2, abs=TOL)
    assert m["latency_p95"] == pytest.approx(0.29, abs=TOL)


def test_compute_metrics_empty_and_breakdown():
    m = M.compute_metrics([])
    assert m["n"] == 0 and m["accuracy"] is None and m["ece"] is None
    records = [rec({"a": 0.9, "b": 0.1}, "a", family="x"), rec({"a": 0.9, "b": 0.1}, "b", family="y"),
               rec({"a": 0.9, "b": 0.1}, "a", family="x")]
    by = M.breakdown(records, "family")
    assert list(by) == ["x", "y"]
    assert by["x"]["n"] == 2 and by["x"]["accuracy"] == 1.0 and by["y"]["accuracy"] == 0.0

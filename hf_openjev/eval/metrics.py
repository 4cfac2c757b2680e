"""JevBench metrics: pure functions over per-task results (no model, no files).

A *record* is one scored task as ``hf_openjev.eval.evaluate`` writes it to ``results.jsonl``::

    {"id", "tier", "family", "kind", "group", "labels", "expected", "probabilities", "prediction",
     "correct", "latency", ...}

``labels`` is the task's option order, ``expected`` the correct label (a string; score tasks use the level
index as a string, ``"0".."n-1"``), ``probabilities`` a ``{label: p}`` dict in ``labels`` order.

Definitions (JevBench README, "Scoring"; every average is over the scored tasks of the group of records):

- **distribution**: choice -> the answer's probabilities; score -> the level probabilities ``{"0": p0, ...}``;
  noul -> ``{"no": 1 - p, "yes": p}`` with ``p`` the answer's ``noul`` value.
- **prediction**: the label with the largest probability; exact ties go to the lexicographically smallest label
  (plain ``str`` ordering, so ``"no" < "yes"`` and ``"0" < "1" < ... < "9"``) -- *not* the contract's
  first-in-request-order rule (a reading that differs on purpose: ``hf_openjev.contract.DIFFERING_READINGS``). It
  agrees with the contract's decision for noul (exactly 0.5 is "no") and score; for choice only off exact ties.
- **accuracy**: mean of ``prediction == expected``.
- **Brier** (multi-class): per task ``sum over labels (p_label - [label == expected])**2``, averaged over tasks.
  For a noul task that is ``2 * (1 - p_expected)**2``. Range 0..2.
- **ECE** (top-label, 10 equal-width bins): the confidence of a task is its largest probability (the probability
  of the prediction). Bin ``k`` (``k = 0..9``) holds confidences in ``[k/10, (k+1)/10)``, the last bin is closed
  ``[0.9, 1.0]``; the bin of ``c`` is the largest ``k`` with ``c >= k/10`` (edges are the floats ``k/10``).
  ``ECE = sum over non-empty bins |accuracy_bin - mean_confidence_bin| * n_bin / N``.
- **log loss**: mean of ``-ln(max(p_expected, 1e-15))``.
- **ordinal MAE** (score tasks only): the README's "mean absolute error of the expected level" is read as the
  error of the model's *expected level* ``E = sum_i i * p_i`` (the contract's ``score`` value, which it calls the
  expected level): mean of ``|E - expected|``. The error of the argmax level (``|prediction - expected|``) is
  reported next to it as ``ordinal_mae_argmax``.
- **chance-corrected accuracy**: ``(accuracy - chance) / (1 - chance)`` with ``chance = mean over tasks of
  1 / len(labels)`` (the accuracy of a uniform random guess); ``None`` when ``chance == 1``.
- **consistency** (paraphrase groups): over the groups (``group`` not null) with at least 2 scored tasks, the
  fraction whose tasks are all correct or all wrong (the model's correctness does not depend on the wording).
  ``group_all_correct`` is the stricter fraction of those groups whose tasks are all correct. ``None`` when
  there is no such group.
- **latency**: seconds per task (see ``hf_openjev.eval.evaluate`` for how it is measured); p50/p95 use linear
  interpolation between order statistics (numpy's default ``percentile`` method).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from ..contract import KINDS

N_BINS = 10
LOG_EPS = 1e-15


def distribution(kind: str, answer: Mapping, labels: Sequence[str]) -> dict[str, float]:
    """The task's probability distribution ``{label: p}`` in ``labels`` order, from a contract answer (the table's
    :meth:`~hf_openjev.contract.QuestionKind.distribution`: noul ``{"no": 1 - p, "yes": p}``)."""
    question = KINDS[kind]
    given = dict(zip(question.labels(answer), question.distribution(question.probabilities(answer))))
    return {label: given[label] for label in labels}


def predict(probabilities: Mapping[str, float]) -> str:
    """Argmax label; exact ties go to the lexicographically smallest label."""
    if not probabilities:
        raise ValueError("empty distribution")
    top = max(probabilities.values())
    return min(label for label, p in probabilities.items() if p == top)


def confidence(probabilities: Mapping[str, float]) -> float:
    """Top-label confidence: the largest probability."""
    return max(probabilities.values())


def brier(probabilities: Mapping[str, float], expected: str) -> float:
    """Multi-class Brier score of one task: ``sum_label (p_label - onehot_label)**2``."""
    total = 0.0
    for label, p in probabilities.items():
        target = 1.0 if label == expected else 0.0
        total += (p - target) ** 2
    return total


def log_loss(probabilities: Mapping[str, float], expected: str) -> float:
    """``-ln(max(p_expected, 1e-15))``."""
    return -math.log(max(float(probabilities.get(expected, 0.0)), LOG_EPS))


def expected_level(probabilities: Mapping[str, float]) -> float:
    """``sum_i i * p_i`` over score levels keyed ``"0".."n-1"``."""
    return sum(int(label) * p for label, p in probabilities.items())


def bin_index(conf: float, n_bins: int = N_BINS) -> int:
    """The largest ``k`` with ``conf >= k / n_bins`` (0..n_bins-1); 1.0 falls in the last bin."""
    k = 0
    for edge in range(1, n_bins):
        if conf >= edge / n_bins:
            k = edge
    return k


def reliability_bins(confidences: Sequence[float], corrects: Sequence[bool], n_bins: int = N_BINS) -> list[dict]:
    """Per bin: ``lo``, ``hi``, ``n``, mean ``confidence`` and ``accuracy`` (``None`` for empty bins)."""
    members: list[list[int]] = [[] for _ in range(n_bins)]
    for i, c in enumerate(confidences):
        members[bin_index(c, n_bins)].append(i)
    bins = []
    for k, idx in enumerate(members):
        n = len(idx)
        bins.append({
            "lo": k / n_bins,
            "hi": (k + 1) / n_bins,
            "n": n,
            "confidence": sum(confidences[i] for i in idx) / n if n else None,
            "accuracy": sum(1.0 for i in idx if corrects[i]) / n if n else None,
        })
    return bins


def ece(confidences: Sequence[float], corrects: Sequence[bool], n_bins: int = N_BINS) -> float:
    """Top-label expected calibration error over ``n_bins`` equal-width bins."""
    total = len(confidences)
    if total == 0:
        raise ValueError("ECE of no tasks")
    value = 0.0
    for b in reliability_bins(confidences, corrects, n_bins):
        if b["n"]:
            value += abs(b["accuracy"] - b["confidence"]) * b["n"] / total
    return value


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    frac = pos - lo
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def consistency(records: Sequence[Mapping]) -> dict:
    """Paraphrase-group consistency (see the module docstring)."""
    groups: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        if r.get("group") is not None:
            groups[str(r["group"])].append(bool(r["correct"]))
    eligible = [v for v in groups.values() if len(v) >= 2]
    if not eligible:
        return {"n_groups": 0, "consistency": None, "group_all_correct": None}
    return {
        "n_groups": len(eligible),
        "consistency": sum(1 for v in eligible if all(v) or not any(v)) / len(eligible),
        "group_all_correct": sum(1 for v in eligible if all(v)) / len(eligible),
    }


def compute_metrics(records: Sequence[Mapping]) -> dict:
    """Every metric over ``records`` (scored tasks); values are ``None`` where undefined."""
    n = len(records)
    out: dict = {"n": n}
    if n == 0:
        for key in ("accuracy", "chance", "chance_corrected_accuracy", "brier", "ece", "log_loss",
                    "ordinal_mae", "ordinal_mae_argmax", "latency_p50", "latency_p95", "latency_mean"):
            out[key] = None
        out.update({"n_score": 0, "n_groups": 0, "consistency": None, "group_all_correct": None})
        return out
    corrects = [bool(r["correct"]) for r in records]
    confs = [confidence(r["probabilities"]) for r in records]
    accuracy = sum(corrects) / n
    chance = sum(1.0 / len(r["labels"]) for r in records) / n
    out["accuracy"] = accuracy
    out["chance"] = chance
    out["chance_corrected_accuracy"] = (accuracy - chance) / (1.0 - chance) if chance < 1.0 else None
    out["brier"] = sum(brier(r["probabilities"], r["expected"]) for r in records) / n
    out["ece"] = ece(confs, corrects)
    out["log_loss"] = sum(log_loss(r["probabilities"], r["expected"]) for r in records) / n
    scores = [r for r in records if r["kind"] == "score"]
    out["n_score"] = len(scores)
    out["ordinal_mae"] = _mean(abs(expected_level(r["probabilities"]) - int(r["expected"])) for r in scores)
    out["ordinal_mae_argmax"] = _mean(abs(int(r["prediction"]) - int(r["expected"])) for r in scores)
    out.update(consistency(records))
    latencies = [float(r["latency"]) for r in records if r.get("latency") is not None]
    out["latency_p50"] = percentile(latencies, 50) if latencies else None
    out["latency_p95"] = percentile(latencies, 95) if latencies else None
    out["latency_mean"] = _mean(latencies)
    return out


def breakdown(records: Sequence[Mapping], key: str) -> dict[str, dict]:
    """``compute_metrics`` per value of ``record[key]`` (sorted by value)."""
    groups: dict[str, list[Mapping]] = defaultdict(list)
    for r in records:
        groups[str(r.get(key))].append(r)
    return {name: compute_metrics(groups[name]) for name in sorted(groups)}

"""The verdict of a fidelity run: each configuration against the oracle, judged by the gate against B, plus the
decision agreement with the oracle and the accuracy against the tasks' expected labels; written as
``fidelity_<name>.json``, ``.md`` and ``.png``.

:func:`judge_against_oracle` is the whole back end, for every caller that has an oracle and answers: ``hf-openjev
fidelity`` and the benchmark driver's ``--oracle`` mode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ..contract import KINDS
from .configs import REFERENCE
from .gate import (
    build_fidelity_report,
    compare_with_oracle,
    judge_configurations,
    select_requests,
    write_fidelity_report,
)
from .oracle import check_oracle_progress


def task_distribution(kind: str, probabilities: Sequence[float], labels: Sequence[str]) -> dict[str, float]:
    """One question's entry probabilities as {label: p}, the table's
    :meth:`~hf_openjev.contract.QuestionKind.distribution`: choice / score in the labels' order (the request's
    criteria follow them), noul ``[p(yes)]`` as {"no": 1 - p, "yes": p}."""
    question = KINDS[kind]
    return dict(zip(question.decisions or labels, question.distribution(probabilities)))


def accuracy_against_labels(items: Sequence, entries: Sequence[Mapping]) -> dict | None:
    """Accuracy of ``entries`` against the items' expected labels (eval's prediction rule), None without tasks."""
    from ..eval.metrics import predict

    scored = [(item.task, entry) for item, entry in zip(items, entries) if item.task is not None]
    if not scored:
        return None
    correct = 0
    for task, entry in scored:
        probabilities = entry["probabilities"][task.qid]
        correct += predict(task_distribution(task.kind, probabilities, task.labels)) == task.expected
    return {"n": len(scored), "correct": correct, "accuracy": correct / len(scored)}


def describe_verdict(config: str, c: Mapping) -> str:
    """One line of a configuration's figures and verdict, as the command prints them."""
    verdict = {True: "passes", False: "FAILS", None: "-"}[c["passes"]]
    agreement = f", agreement {c['decision_agreement']['agreement']:.4f}" if c.get("decision_agreement") else ""
    accuracy = f", accuracy {c['accuracy']['accuracy']:.4f}" if c.get("accuracy") else ""
    return (f"{config}: max |dp| {c['max_abs_dp']:.4g}, p99 {c['p99_abs_dp']:.4g}, mean {c['mean_abs_dp']:.4g}, "
            f"{c['flips']} flips (+{c['near_tie_flips']} near-tie){agreement}{accuracy}: {verdict}"
            + (" (the yardstick)" if config == REFERENCE else ""))


def early_verdict(oracle_entries: Mapping[str, Mapping], items: Sequence, entries_by_name: Mapping[str, Sequence],
                  config: str) -> str | None:
    """``config`` against B as the report will judge it (:func:`describe_verdict`, without agreement and accuracy),
    once both have answered and the oracle (entries by id) covers every item; else None. A run that is cut later
    has logged it."""
    if REFERENCE not in entries_by_name or config not in entries_by_name \
            or any(item.id not in oracle_entries for item in items):
        return None
    ordered = select_requests(list(oracle_entries.values()), [item.id for item in items])
    stats = {name: compare_with_oracle(ordered, list(entries_by_name[name])) for name in (REFERENCE, config)}
    return describe_verdict(config, judge_configurations(stats, reference=REFERENCE)[config])


def select_oracle_entries(oracle: Mapping, *, weights_sha256: Mapping | str, items: Sequence) -> list[dict]:
    """``oracle``'s entries of ``items`` (in their order), once its weights are these and every item is in it with
    the same token ids; else a one-line ``ValueError``. A caller can run it before any work, to refuse early."""
    done = check_oracle_progress(dict(oracle), weights_sha256=weights_sha256,
                                 tokens_sha256={item.id: item.tokens_sha256 for item in items})
    return select_requests(list(done.values()), [item.id for item in items])


def judge_against_oracle(oracle: Mapping, *, weights_sha256: Mapping | str, items: Sequence,
                         entries_by_name: Mapping[str, Sequence[Mapping]], out: str | Path, name: str,
                         meta: Mapping | None = None) -> dict:
    """Compare every configuration's entries (``entries_by_name``, each in ``items`` order; ``"B"`` is the gate's
    yardstick) with ``oracle``'s, after checking its weights and token ids (:func:`select_oracle_entries`); write
    ``<out>/fidelity_<name>.{json,md,png}`` and return the report."""
    oracle_entries = select_oracle_entries(oracle, weights_sha256=weights_sha256, items=items)
    n_questions = sum(len(e["probabilities"]) for e in oracle_entries)
    stats = {config: compare_with_oracle(oracle_entries, list(entries)) for config, entries in entries_by_name.items()}
    report = build_fidelity_report(stats, reference=REFERENCE, **dict(meta or {}))
    report["oracle_accuracy"] = accuracy_against_labels(items, oracle_entries)
    for config, entries in entries_by_name.items():
        flips = stats[config].flips + stats[config].near_tie_flips
        report["configurations"][config].update(
            decision_agreement={"n_questions": n_questions, "disagreements": flips,
                                "agreement": 1.0 - flips / n_questions},
            accuracy=accuracy_against_labels(items, entries))
    write_report(Path(out), f"fidelity_{name}", report)
    return report


def render_agreement_markdown(report: Mapping) -> str:
    """The decision agreement and accuracy section of the markdown."""
    oracle = report.get("oracle_accuracy")
    lines = ["", "## Decisions", "", "| configuration | agreement with the oracle | accuracy against the labels |",
             "|---|---|---|"]
    if oracle:
        lines.append(f"| fp32 oracle | 1 | {oracle['accuracy']:.4f} ({oracle['correct']}/{oracle['n']}) |")
    for config, c in report["configurations"].items():
        a, acc = c["decision_agreement"], c.get("accuracy")
        cell = "-" if not acc else f"{acc['accuracy']:.4f} ({acc['correct']}/{acc['n']})"
        lines.append(f"| `{config}` | {a['agreement']:.4f} ({a['disagreements']} of {a['n_questions']} differ) "
                     f"| {cell} |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, stem: str, report: Mapping) -> None:
    """``<stem>.json`` (compact), ``<stem>.png`` (max |dp| per request) and ``<stem>.md`` under ``out``: the gate's
    files (:func:`~hf_openjev.fidelity_check.gate.write_fidelity_report`), the markdown followed by the decisions section."""
    out.mkdir(parents=True, exist_ok=True)
    write_fidelity_report(out, stem, report)
    with (out / f"{stem}.md").open("a") as markdown:
        markdown.write(render_agreement_markdown(report))

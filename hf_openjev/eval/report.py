"""The outputs of ``hf-openjev eval``: summary (metrics by tier, family and kind), markdown report, diagram."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from . import metrics as M
from .tasks import Source

SUMMARY_NAME = "summary.json"
REPORT_NAME = "report.md"
DIAGRAM_NAME = "reliability.png"


def _count_structural(invalid: list[dict]) -> int:
    """Invalid entries that are not among the loaded tasks (malformed lines, bad fields, duplicates)."""
    return sum(1 for e in invalid if e["stage"] == "input")


# -- outputs ---------------------------------------------------------------------------------------------------------

DEFINITIONS = {
    "prediction": "argmax of the probabilities; ties go to the lexicographically smallest label; "
                  "noul probabilities are {no: 1-p, yes: p}",
    "accuracy": "mean of prediction == expected",
    "brier": "mean over tasks of sum over labels (p_label - onehot_label)^2 (multi-class)",
    "ece": "top-label confidence (max probability) in 10 equal-width bins [k/10, (k+1)/10), last bin closed; "
           "sum over bins |accuracy - mean confidence| * n_bin / N",
    "log_loss": "mean of -ln(max(p_expected, 1e-15))",
    "ordinal_mae": "score tasks: mean |E - expected| with E = sum_i i p_i the expected level; "
                   "ordinal_mae_argmax uses the predicted level instead",
    "chance_corrected_accuracy": "(accuracy - chance) / (1 - chance), chance = mean of 1/len(labels)",
    "consistency": "groups (group not null) with >= 2 scored tasks: fraction whose tasks are all correct or all "
                   "wrong; group_all_correct: fraction all correct",
    "latency": "seconds per task = wall time of its batch (tokenize + forward + answers) / valid tasks in the "
               "batch; p50/p95 by linear interpolation",
}


def build_summary(records: list[dict], *, invalid: list[dict], sources: Sequence[Source], fingerprint: dict,
                  total: int, scored_now: int, resumed: int, seconds: float) -> dict:
    confs = [M.confidence(r["probabilities"]) for r in records]
    corrects = [bool(r["correct"]) for r in records]
    return {
        "model": fingerprint,
        "data": [{"path": str(s.path), "tier": s.tier} for s in sources],
        "counts": {"tasks": total, "scored": len(records), "invalid": len(invalid), "scored_this_run": scored_now,
                   "resumed": resumed},
        "overall": M.compute_metrics(records),
        "by_tier": M.breakdown(records, "tier"),
        "by_family": M.breakdown(records, "family"),
        "by_kind": M.breakdown(records, "kind"),
        "reliability": M.reliability_bins(confs, corrects) if records else [],
        "invalid": invalid,
        "definitions": DEFINITIONS,
        "seconds": seconds,
    }


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


_COLUMNS = [("n", "n"), ("accuracy", "acc"), ("chance_corrected_accuracy", "cc-acc"), ("brier", "Brier"),
            ("ece", "ECE"), ("log_loss", "log loss"), ("ordinal_mae", "ord. MAE"), ("consistency", "consistency"),
            ("latency_p50", "p50 s"), ("latency_p95", "p95 s")]


def _table(rows: dict[str, dict], first: str) -> list[str]:
    lines = ["| " + " | ".join([first] + [title for _, title in _COLUMNS]) + " |",
             "|" + "---|" * (len(_COLUMNS) + 1)]
    for name, m in rows.items():
        lines.append("| " + " | ".join([name] + [_fmt(m.get(key)) for key, _ in _COLUMNS]) + " |")
    return lines


def render_report(summary: dict) -> str:
    c, model = summary["counts"], summary["model"]
    lines = [
        "# JevBench evaluation",
        "",
        f"Model: `{model['model_id']}` (revision `{model['checkpoint_revision']}`, T = {model['temperature']}, "
        f"fingerprint `{model['fingerprint']}`" + (f", FP8 projections `{model['fp8']}`" if "fp8" in model else "")
        + ")",
        "",
        "Data: " + ", ".join(f"`{d['path']}` ({d['tier']})" for d in summary["data"]),
        "",
        f"Tasks: {c['tasks']} · scored: {c['scored']} · invalid: {c['invalid']} · scored in this run: "
        f"{c['scored_this_run']} · resumed: {c['resumed']}",
        "",
        "## Overall",
        "",
        *_table({"all": summary["overall"]}, ""),
        "",
    ]
    for key, title in (("by_tier", "tier"), ("by_family", "family"), ("by_kind", "kind")):
        lines += [f"## By {title}", "", *_table(summary[key], title), ""]
    lines += ["## Reliability", "", f"![reliability diagram]({DIAGRAM_NAME})", "",
              "| bin | n | confidence | accuracy |", "|---|---|---|---|"]
    for b in summary["reliability"]:
        close = "]" if b["hi"] >= 1.0 else ")"
        lines.append(f"| [{b['lo']:.1f}, {b['hi']:.1f}{close} | {b['n']} | {_fmt(b['confidence'])} | "
                     f"{_fmt(b['accuracy'])} |")
    lines.append("")
    if summary["invalid"]:
        lines += ["## Invalid tasks", "", "| file | line | id | error |", "|---|---|---|---|"]
        for e in summary["invalid"][:200]:
            error = str(e["error"]).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{e['file']}` | {e['line']} | {e['id'] or '–'} | {error} |")
        if len(summary["invalid"]) > 200:
            lines.append(f"| … | | | {len(summary['invalid']) - 200} more in summary.json |")
        lines.append("")
    lines += ["## Definitions", ""] + [f"- **{k}**: {v}" for k, v in summary["definitions"].items()] + [""]
    return "\n".join(lines)


def plot_reliability(summary: dict, path: Path) -> None:
    """Reliability diagram (accuracy vs confidence per bin, plus counts) with the Agg canvas (no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    bins = summary["reliability"]
    fig = Figure(figsize=(5.5, 6.5), dpi=100)
    FigureCanvasAgg(fig)
    top = fig.add_axes((0.14, 0.36, 0.8, 0.5))
    bottom = fig.add_axes((0.14, 0.08, 0.8, 0.2), sharex=top)
    top.plot([0, 1], [0, 1], linestyle="--", color="gray", linewidth=1, label="perfect calibration")
    filled = [b for b in bins if b["n"]]
    top.bar([b["lo"] for b in filled], [b["accuracy"] for b in filled], width=0.1, align="edge",
            edgecolor="black", color="#4c72b0", alpha=0.8, label="accuracy")
    top.scatter([b["confidence"] for b in filled], [b["accuracy"] for b in filled], color="#dd8452", zorder=3,
                s=18, label="mean confidence")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.set_ylabel("accuracy")
    ece = summary["overall"].get("ece")
    fig.suptitle(f"Reliability ({summary['overall']['n']} tasks, ECE = {_fmt(ece)})", y=0.955)
    # above the axes, under the title: inside, any corner can hide a bar (bars of 0..1 fill every corner)
    top.legend(loc="lower center", bbox_to_anchor=(0.5, 1.01), ncol=3, fontsize=8, frameon=False,
               handlelength=1.5, columnspacing=1.2)
    bottom.bar([b["lo"] for b in bins], [b["n"] for b in bins], width=0.1, align="edge", edgecolor="black",
               color="#8c8c8c")
    bottom.set_xlabel("confidence (max probability)")
    bottom.set_ylabel("tasks")
    fig.savefig(str(path))


def write_outputs(summary: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=1, ensure_ascii=False, allow_nan=False) + "\n",
                                        encoding="utf-8")
    (out_dir / REPORT_NAME).write_text(render_report(summary), encoding="utf-8")
    plot_reliability(summary, out_dir / DIAGRAM_NAME)


# -- command line ----------------------------------------------------------------------------------------------------

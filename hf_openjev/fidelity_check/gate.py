"""Decision fidelity against an fp32 oracle (docs/design.md "Numerics"): |Δp| statistics, decision flips, the gate.

Everything here works on plain JSON-able data, as the oracle recipe (``recipes/oracle.py``) and the benchmark
driver (``recipes/bench_jevbench.py --oracle``) write it. A *request entry*::

    {"id": "easy-intent-00",                      # the workload's request id
     "kind": "choice" | "score" | "noul",
     "probabilities": {"q": [p_0, ..., p_n-1]},   # per question id, one probability per candidate, in order;
                                                  # a noul question has one candidate: [p(yes)]
     "tokens_sha256": "..."}                      # optional: hash_tokens of the request's token ids

An *oracle* (``oracle_<shape>.json``; gzipped, ``oracle_<shape>.json.gz``, as committed in ``data/bench/``) is
``{"format": ORACLE_FORMAT, "shape", "seed", "weights_sha256", "complete", "requests": [entry, ...], ...}``.

Statistics pool every candidate probability of every compared request (a choice question of 5 options gives 5
values, a noul question 1). p99 is ``sorted[max(0, int(0.99 N) - 1)]``, the benchmark's percentile convention.

A decision flip: the decision of :data:`~hf_openjev.contract.KINDS` differs (choice / score, the first arg-max;
noul, the side of 0.5, exactly 0.5 being "no"). It is a near-tie flip when the *oracle's* decision was close: its
top-two margin < NEAR_TIE_MARGIN (noul: ``|p_yes - p_no|``, i.e. ``|p - 0.5| < NEAR_TIE_MARGIN / 2``). The gate
(:func:`passes_gate`) compares a configuration with B, stock Transformers + fla-core in bf16 measured in the same run.

Pure Python: torch and matplotlib are imported only inside :func:`hash_weights` and :func:`plot_fidelity`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..contract import KIND_NAMES, KINDS, NEAR_TIE_MARGIN
from ..json_files import read_json_file

GATE_MAX_RATIO = 1.25  # max |Δp| <= 1.25 x B's
GATE_MEAN_RATIO = 1.10  # mean |Δp| <= 1.10 x B's
ORACLE_FORMAT = "hf-openjev-oracle/1"


@dataclass(frozen=True)
class FidelityStats:
    """One configuration against the oracle, over the same requests (in the oracle's order)."""

    request_ids: tuple[str, ...]
    n_probabilities: int
    max_abs_dp: float
    p99_abs_dp: float
    mean_abs_dp: float
    flips: int  # flips away from near-ties
    near_tie_flips: int
    flipped_requests: tuple[dict, ...]  # {"id", "question", "kind", "oracle", "config", "oracle_margin", "near_tie"}
    per_request_max_abs_dp: tuple[float, ...]  # [n_requests], the plot's y values

    def as_dict(self) -> dict:
        return {"n_requests": len(self.request_ids), "n_probabilities": self.n_probabilities,
                "max_abs_dp": self.max_abs_dp, "p99_abs_dp": self.p99_abs_dp, "mean_abs_dp": self.mean_abs_dp,
                "flips": self.flips, "near_tie_flips": self.near_tie_flips,
                "flipped_requests": [dict(f) for f in self.flipped_requests],
                "per_request_max_abs_dp": list(self.per_request_max_abs_dp)}


@dataclass(frozen=True)
class GateVerdict:
    """``passes``; ``reasons``: one line per failed criterion (empty when it passes); ``limits``: the bounds used."""

    passes: bool
    reasons: tuple[str, ...] = ()
    limits: dict = field(default_factory=dict)


# --- building entries ----------------------------------------------------------------------------------------------

def probabilities_from_response(response: Mapping) -> dict[str, list[float]]:
    """A response dict (docs/contract.md §6) -> {question id: [p per candidate]}; noul -> [p(yes)]."""
    return {qid: KINDS[answer["type"]].probabilities(answer) for qid, answer in response["answers"].items()}


def hash_tokens(tokens: Sequence[Sequence[Sequence[int]]]) -> str:
    """sha256 (hex) of a request's token ids, ``tokens[question][candidate] -> ids``."""
    return hashlib.sha256(json.dumps([[list(map(int, c)) for c in q] for q in tokens],
                                     separators=(",", ":")).encode()).hexdigest()


def describe_request(request_id: str, kind: str, response: Mapping, *, tokens_sha256: str | None = None,
                     **extra) -> dict:
    """The request entry of one response (``extra``: more keys kept as given, e.g. ``scores``)."""
    entry = {"id": str(request_id), "kind": kind, "probabilities": probabilities_from_response(response)}
    if tokens_sha256 is not None:
        entry["tokens_sha256"] = tokens_sha256
    entry.update(extra)
    return entry


def weights_identity(module, *, workers: int = 8) -> dict[str, str]:
    """The two fingerprints of a module's weights, from one pass over its tensors (sorted by name, each recorded
    as ``name, dtype, shape, sha256(raw bytes)``, the records hashed in that order; run it on the stored (bf16)
    weights, before any upcast or patch; tensors are hashed in ``workers`` threads, as hashlib frees the GIL):

    - ``weights_sha256``: every parameter and buffer, derived ones included (rotary ``inv_freq``: a model built on
      a GPU and the same weights loaded from an export compute those on other devices, so they may differ in the
      last bit); the committed oracles carry this one only;
    - ``stored_weights_sha256``: the parameters and persistent buffers alone (what an export stores), so that an
      export matches the model it was written from wherever either was built. Oracles written since carry both,
      and :func:`same_weights` compares this one when both sides have it."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    stored = set(module.state_dict(keep_vars=True))

    def digest(tensor) -> str:
        raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()
        return hashlib.sha256(memoryview(raw)).hexdigest()

    names = sorted(named)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = list(pool.map(lambda n: digest(named[n]), names))
    every, persistent = hashlib.sha256(), hashlib.sha256()
    for name, hexdigest in zip(names, digests):
        tensor = named[name]
        record = f"{name}|{tensor.dtype!s}|{list(tensor.shape)}|{hexdigest}\n".encode()
        every.update(record)
        if name in stored:
            persistent.update(record)
    return {"weights_sha256": every.hexdigest(), "stored_weights_sha256": persistent.hexdigest()}


def hash_weights(module, *, workers: int = 8) -> str:
    """``weights_identity(module)["weights_sha256"]``: every parameter and buffer (the committed oracles' key)."""
    return weights_identity(module, workers=workers)["weights_sha256"]


def same_weights(record: Mapping, weights: Mapping | str) -> bool:
    """Whether an oracle (or its header) ``record`` is of these ``weights`` (a :func:`weights_identity`, or a
    ``weights_sha256`` string): by ``stored_weights_sha256`` when both carry it, else by ``weights_sha256``."""
    weights = {"weights_sha256": weights} if isinstance(weights, str) else weights
    if record.get("stored_weights_sha256") and weights.get("stored_weights_sha256"):
        return record["stored_weights_sha256"] == weights["stored_weights_sha256"]
    return record.get("weights_sha256") == weights.get("weights_sha256")


def short_weights(weights: Mapping | str) -> str:
    """A fingerprint for a message: the stored weights' sha256 when known, else the whole one (16 hex digits)."""
    weights = {"weights_sha256": weights} if isinstance(weights, str) else weights
    return (weights.get("stored_weights_sha256") or weights["weights_sha256"])[:16] + "..."


# --- the oracle file -----------------------------------------------------------------------------------------------

def load_oracle(path: str | Path) -> dict:
    """Read and check an oracle file, ``oracle_<shape>.json`` or gzipped ``oracle_<shape>.json.gz``
    (:func:`~hf_openjev.json_files.read_json_file`): its format and keys (entries are checked when compared). Every
    error is a one-line ``ValueError`` naming the file."""
    path = Path(path)
    oracle = read_json_file(path)
    if not isinstance(oracle, dict) or oracle.get("format") != ORACLE_FORMAT:
        raise ValueError(f"{path}: not an oracle file (format {ORACLE_FORMAT!r} expected)")
    missing = [k for k in ("shape", "seed", "weights_sha256", "requests") if k not in oracle]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    return oracle


def verify_oracle_identity(oracle: Mapping, *, shape: str, seed: int, weights_sha256: Mapping | str | None = None) -> None:
    """Raise ``ValueError`` unless ``oracle`` was computed on this shape, seed and (when given) weights
    (``weights_sha256``: a :func:`weights_identity` or its ``weights_sha256``; :func:`same_weights`)."""
    if oracle["shape"] != shape:
        raise ValueError(f"the oracle is of shape {oracle['shape']!r}, this run is {shape!r}")
    if int(oracle["seed"]) != int(seed):
        raise ValueError(f"the oracle was computed with seed {oracle['seed']}, this run uses {seed}")
    if weights_sha256 is not None and not same_weights(oracle, weights_sha256):
        raise ValueError(f"weights differ from the oracle's: sha256 {short_weights(weights_sha256)} here, "
                         f"{short_weights(oracle)} in the oracle; refusing to compare")


def select_requests(requests: Sequence[Mapping], ids: Iterable[str]) -> list[dict]:
    """The entries of ``requests`` with the given ids, in the order of ``ids``; a missing id is a ValueError."""
    by_id = {str(r["id"]): r for r in requests}
    ids = [str(i) for i in ids]
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"{len(missing)} request(s) not in the oracle, first {missing[0]!r}")
    return [dict(by_id[i]) for i in ids]


# --- the comparison ------------------------------------------------------------------------------------------------

def _check_pair(oracle: Mapping, config: Mapping, position: int) -> None:
    if str(oracle["id"]) != str(config["id"]):
        raise ValueError(f"request {position}: id {config['id']!r} where the oracle has {oracle['id']!r}")
    rid = oracle["id"]
    if oracle["kind"] not in KIND_NAMES or oracle["kind"] != config["kind"]:
        raise ValueError(f"request {rid!r}: kind {config['kind']!r}, the oracle's {oracle['kind']!r}")
    a, b = oracle.get("tokens_sha256"), config.get("tokens_sha256")
    if a is not None and b is not None and a != b:
        raise ValueError(f"request {rid!r}: token ids differ from the oracle's (tokens_sha256)")
    po, pc = oracle["probabilities"], config["probabilities"]
    if list(po) != list(pc):
        raise ValueError(f"request {rid!r}: questions {list(pc)} where the oracle has {list(po)}")
    for qid in po:
        if len(po[qid]) != len(pc[qid]) or not po[qid]:
            raise ValueError(f"request {rid!r} question {qid!r}: {len(pc[qid])} candidate probabilities, "
                             f"the oracle has {len(po[qid])}")
        fixed = KINDS[oracle["kind"]].fixed_candidates
        if fixed is not None and len(po[qid]) != len(fixed):
            raise ValueError(f"request {rid!r} question {qid!r}: a {oracle['kind']} question has {len(fixed)} "
                             "probability")
        for p in (*po[qid], *pc[qid]):
            if not (isinstance(p, (int, float)) and math.isfinite(p) and 0.0 <= p <= 1.0):
                raise ValueError(f"request {rid!r} question {qid!r}: {p!r} is not a probability")


def find_flip(kind: str, oracle_p: Sequence[float], config_p: Sequence[float]) -> dict | None:
    """The flip of one question by the table's decision rule (:meth:`~hf_openjev.contract.QuestionKind.decide`), or
    None: ``{"oracle", "config"`` (arg-max index, or "yes"/"no" for noul), ``"oracle_margin"`` (the oracle's top-two
    margin; noul: ``p_yes - p_no``), ``"near_tie"}`` (:meth:`~hf_openjev.contract.QuestionKind.near_tie`)."""
    question = KINDS[kind]
    io, ic = question.decide(oracle_p), question.decide(config_p)
    if io == ic:
        return None
    names = question.decisions or range(len(oracle_p))
    return {"oracle": names[io], "config": names[ic], "oracle_margin": question.margin(oracle_p),
            "near_tie": question.near_tie(oracle_p)}


def compare_with_oracle(oracle_requests: Sequence[Mapping], config_requests: Sequence[Mapping]) -> FidelityStats:
    """|Δp| statistics and decision flips of one configuration against the oracle.

    Both lists hold request entries for the same requests in the same order (pick the oracle's with
    :func:`select_requests`); ids, kinds, questions, candidate counts (and token hashes, when both carry them)
    must agree, else ``ValueError``.
    """
    if len(oracle_requests) != len(config_requests):
        raise ValueError(f"{len(config_requests)} requests to compare with {len(oracle_requests)} oracle requests")
    if not oracle_requests:
        raise ValueError("no requests to compare")
    ids = [str(r["id"]) for r in oracle_requests]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate request ids")
    diffs: list[float] = []  # every |Δp|
    per_request: list[float] = []
    flipped: list[dict] = []
    for position, (o, c) in enumerate(zip(oracle_requests, config_requests)):
        _check_pair(o, c, position)
        worst = 0.0
        for qid, po in o["probabilities"].items():
            pc = c["probabilities"][qid]
            d = [abs(float(x) - float(y)) for x, y in zip(po, pc)]
            diffs.extend(d)
            worst = max(worst, *d)
            flip = find_flip(o["kind"], po, pc)
            if flip is not None:
                flipped.append({"id": str(o["id"]), "question": qid, "kind": o["kind"], **flip})
        per_request.append(worst)
    ordered = sorted(diffs)
    n = len(ordered)
    near = sum(1 for f in flipped if f["near_tie"])
    return FidelityStats(request_ids=tuple(ids), n_probabilities=n, max_abs_dp=ordered[-1],
                         p99_abs_dp=ordered[max(0, int(0.99 * n) - 1)], mean_abs_dp=math.fsum(ordered) / n,
                         flips=len(flipped) - near, near_tie_flips=near, flipped_requests=tuple(flipped),
                         per_request_max_abs_dp=tuple(per_request))


# --- the gate ------------------------------------------------------------------------------------------------------

def passes_gate(stats: FidelityStats, b_stats: FidelityStats) -> GateVerdict:
    """The gate of docs/design.md "Numerics": max |Δp| <= GATE_MAX_RATIO x B's, mean |Δp| <= GATE_MEAN_RATIO x B's,
    and flips away from near-ties <= B's, both measured against the oracle on the same requests (else ``ValueError``)."""
    if stats.request_ids != b_stats.request_ids:
        raise ValueError("the configuration and B were compared on different requests")
    limits = {"max_abs_dp": GATE_MAX_RATIO * b_stats.max_abs_dp, "mean_abs_dp": GATE_MEAN_RATIO * b_stats.mean_abs_dp,
              "flips": b_stats.flips}
    reasons = []
    if stats.max_abs_dp > limits["max_abs_dp"]:
        reasons.append(f"max |dp| {stats.max_abs_dp:.4g} > {GATE_MAX_RATIO} x B's {b_stats.max_abs_dp:.4g}")
    if stats.mean_abs_dp > limits["mean_abs_dp"]:
        reasons.append(f"mean |dp| {stats.mean_abs_dp:.4g} > {GATE_MEAN_RATIO} x B's {b_stats.mean_abs_dp:.4g}")
    if stats.flips > limits["flips"]:
        reasons.append(f"{stats.flips} flips away from near-ties > B's {b_stats.flips}")
    return GateVerdict(passes=not reasons, reasons=tuple(reasons), limits=limits)


def judge_configurations(stats_by_name: Mapping[str, FidelityStats], *, reference: str = "B") -> dict[str, dict]:
    """Per configuration: its statistics (``FidelityStats.as_dict``) plus ``passes`` (None when the run has no
    ``reference``) and ``gate_reasons``."""
    b = stats_by_name.get(reference)
    out = {}
    for name, stats in stats_by_name.items():
        entry = stats.as_dict()
        if b is None:
            entry.update(passes=None, gate_reasons=[f"no {reference} in this run: the gate cannot be judged"])
        else:
            verdict = passes_gate(stats, b)
            entry.update(passes=verdict.passes, gate_reasons=list(verdict.reasons))
        out[name] = entry
    return out


# --- the report ----------------------------------------------------------------------------------------------------

def build_fidelity_report(stats_by_name: Mapping[str, FidelityStats], *, reference: str = "B", **meta) -> dict:
    """``fidelity_<shape>.json``'s content: ``meta`` (command, versions, device, git commit, oracle check, ...),
    the gate's constants and ``configurations`` (see :func:`judge_configurations`)."""
    return {**meta,
            "gate": {"reference": reference, "max_ratio": GATE_MAX_RATIO, "mean_ratio": GATE_MEAN_RATIO,
                     "near_tie_margin": NEAR_TIE_MARGIN},
            "configurations": judge_configurations(stats_by_name, reference=reference)}


def render_fidelity_markdown(report: Mapping, *, plot_name: str | None = None) -> str:
    """The markdown of a report: one row per configuration, then the flipped requests."""
    gate = report["gate"]
    lines = [f"# Decision fidelity against the fp32 oracle, {report.get('shape', '?')} shape", ""]
    for key in ("command", "git_commit", "device"):
        if key in report:
            lines += [f"{key.replace('_', ' ').capitalize()}: `{report[key]}`", ""]
    if "versions" in report:
        lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), ""]
    for number, run in enumerate(report.get("runs", ()), 1):  # a report joined from several runs (each with its B)
        lines += [f"Run {number}: `{run['command']}` (commit `{run['git_commit']}`, {run['device']}, fp8 "
                  f"{run['fp8']}; " + ", ".join(f"{k} {v}" for k, v in run["versions"].items()) + ")", ""]
    if "oracle_sha256_check" in report:
        lines += [f"Oracle weights check: {report['oracle_sha256_check']}", ""]
    lines += [f"Gate (against {gate['reference']}, same run): max |Δp| <= {gate['max_ratio']} x, mean |Δp| <= "
              f"{gate['mean_ratio']} x, flips away from near-ties <= {gate['reference']}'s (near-tie: oracle top-two "
              f"margin < {gate['near_tie_margin']}; noul |p_yes - p_no|, i.e. |p - 0.5| < {gate['near_tie_margin'] / 2}"
              ").", "",
              "| configuration | requests | max abs dp | p99 abs dp | mean abs dp | flips | near-tie flips | passes |",
              "|---|---|---|---|---|---|---|---|"]
    for name, c in report["configurations"].items():
        verdict = {True: "yes", False: "**no**", None: "-"}[c["passes"]]
        run = f" (run {c['run'] + 1})" if "run" in c else ""
        lines.append(f"| `{name}`{run} | {c['n_requests']} | {c['max_abs_dp']:.4g} | {c['p99_abs_dp']:.4g} | "
                     f"{c['mean_abs_dp']:.4g} | {c['flips']} | {c['near_tie_flips']} | {verdict} |")
    for name, c in report["configurations"].items():
        if c["gate_reasons"] and c["passes"] is False:
            lines += ["", f"`{name}` fails: " + "; ".join(c["gate_reasons"])]
        if c["flipped_requests"]:
            lines += ["", f"`{name}` flips: " + ", ".join(
                f"{f['id']}/{f['question']} ({f['kind']}, {f['oracle']} -> {f['config']}, margin "
                f"{f['oracle_margin']:.3g}{', near-tie' if f['near_tie'] else ''})" for f in c["flipped_requests"])]
    if plot_name:
        lines += ["", f"![max |Δp| per request]({plot_name})"]
    return "\n".join(lines) + "\n"


def plot_fidelity(report: Mapping, path: str | Path) -> None:
    """PNG: each configuration's max |Δp| per request (request index on x, log y; zeros drawn at 1e-9)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    try:
        for name, c in report["configurations"].items():
            ys = [max(v, 1e-9) for v in c["per_request_max_abs_dp"]]
            ax.plot(range(len(ys)), ys, marker=".", linestyle="none", label=name)
        ax.set_yscale("log")
        ax.set_xlabel("request (workload order)")
        ax.set_ylabel("max |Δp| vs fp32 oracle")
        ax.set_title(f"decision fidelity, {report.get('shape', '?')} shape")
        ax.legend(fontsize="small")
        fig.tight_layout()
        _save_palette_png(fig, path)
    finally:
        plt.close(fig)


def _save_palette_png(fig, path: str | Path, colors: int = 64) -> None:
    """Save ``fig`` at 72 dpi as a PNG of ``colors`` palette entries (Pillow, matplotlib's own dependency): a third
    of the size of matplotlib's RGBA file for these few-colour plots, which the results in the tree keep."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=72, format="png")
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def write_fidelity_report(out: str | Path, name: str, report: Mapping) -> None:
    """Write ``<name>.json``, ``<name>.md`` and ``<name>.png`` under ``out``."""
    out = Path(out)
    (out / f"{name}.json").write_text(json.dumps(report, separators=(",", ":")) + "\n")  # compact: 231 x 5 numbers
    plot_fidelity(report, out / f"{name}.png")
    (out / f"{name}.md").write_text(render_fidelity_markdown(report, plot_name=f"{name}.png"))

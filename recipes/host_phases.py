"""The host's share of short fast-path requests, phase by phase, on a CPU (issue 30): the code the CUDA path runs.

    python recipes/host_phases.py --out recipes/results/host_phases [--repeats 300]

The model has the 27B's layer count and layer pattern (64 layers, every 4th full attention: 16) and head layout
at a tiny width: the host work of a request depends on its plan, its levels and its layers, not on the hidden
size. CUDA graphs are stood in for by a :class:`~hf_openjev.patches.cuda_graphs.PackGraphs` whose capture runs the
forward eagerly once and whose replay does nothing, so that ``score_prepared`` takes the graph path of
``score_fast`` (``graph_ready``, ``build_pack_context(pad=True)``, ``PackGraphs.run``: the graph key lookup and the
input copy, the head, the scores) exactly as on CUDA, minus the kernels. Phases (medians of ``--repeats`` calls
after one that captures):

- ``prepare``: ``parse_request`` and the ``PreparedRequest`` (the contract's validation; the token ids are the
  benchmark's synthetic ones, so no tokenizer runs);
- ``plan``: ``plan_with_options``; ``context``: ``build_pack_context`` (a shape seen before: the layout cache's hit);
- ``context, new shape``: the same with the layout cache emptied before each ``score_prepared`` call (its miss: every
  pack's shape is new), when it has one;
- ``launch``: ``PackGraphs.run`` (key lookup, the input copy, the replay call);
- ``head + scores``: the rest of ``score_prepared`` (the head, the scores to the host, the bookkeeping);
- ``host``: all of the above but ``context, new shape``.

Writes ``host_phases.json`` and ``.md``. Run it on the commit before a change and after, on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from benchlib.provenance import command_line, git_commit, versions
from benchlib.random_model import build_model
from benchlib.shapes import SHAPES, TEMPERATURES, VOCAB
from benchlib.timing import add_ms_to
from benchlib.workload import ESTIMATED_MANIFEST as SHAPES_FILE  # the request indices are into this one
from benchlib.workload import build_workload, single_candidate_request

from hf_openjev.contract import KINDS

SHAPE = "host64"
# the 27B's layers and head layout (benchlib.shapes.SHAPES["27b"]) at a tiny hidden size: host timing only
TEMPERATURES.setdefault(SHAPE, TEMPERATURES["27b"])
SHAPES.setdefault(SHAPE, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=64,
                                             num_attention_heads=24, num_key_value_heads=4, head_dim=16,
                                             linear_num_key_heads=16, linear_num_value_heads=48,
                                             linear_key_head_dim=8, linear_value_head_dim=8))
# the short requests issue 30 profiled: workload index -> label
REQUESTS = {71: "median choice <= 128 tokens (index 71, 5 candidates)", 0: "easy-intent-00 (index 0)",
            119: "median 6-candidate request (index 119)", 141: "median choice 129-512 (index 141)"}
PHASES = ("prepare", "plan", "context", "context, new shape", "launch", "head + scores", "host")


class NoReplay:
    """A captured graph's stand-in: replaying it runs nothing."""

    def replay(self) -> None:
        pass


def stand_in_graphs(text_model):
    """A PackGraphs whose capture runs the forward eagerly once and keeps a :class:`NoReplay` (its ``run`` is
    PackGraphs' own: the key lookup, the input copy, the replay call)."""
    from hf_openjev.patches.cuda_graphs import PackGraphs

    class StandInGraphs(PackGraphs):
        def _capture(self, ctx):
            output = self.text_model(pack=ctx)
            self.graphs[ctx.graph_key] = (NoReplay(), ctx, output)
            self.captures += 1
            return output

    return StandInGraphs(text_model)


@contextmanager
def timed_steps(times: dict[str, float]):
    """Wrap score_fast's steps so that each call adds its ms to ``times`` (restored on exit)."""
    from hf_openjev import fast_path
    from hf_openjev.patches.cuda_graphs import PackGraphs

    saved = fast_path.plan_with_options, fast_path.build_pack_context, PackGraphs.run
    fast_path.plan_with_options = add_ms_to(times, "plan", saved[0])
    fast_path.build_pack_context = add_ms_to(times, "context", saved[1])
    PackGraphs.run = add_ms_to(times, "launch", saved[2])
    try:
        yield
    finally:
        fast_path.plan_with_options, fast_path.build_pack_context, PackGraphs.run = saved


def time_new_shapes(model, prepared, repeats: int) -> float:
    """Median ms of ``build_pack_context`` inside ``score_prepared`` (the fast path's own call, its options) with the
    layout cache emptied before each call, so that every pack's shape is new (nan when the package has no layout
    cache)."""
    try:
        from hf_openjev.packing.layout_cache import TEMPLATES
    except ImportError:
        return float("nan")
    from hf_openjev.scoring import score_prepared

    samples = []
    for _ in range(repeats):
        TEMPLATES.clear()
        times: dict[str, float] = {}
        with timed_steps(times):
            score_prepared(model, [prepared], fast=True)
        samples.append(times["context"])
    return statistics.median(samples)


def time_request(model, request: dict, prepared, repeats: int) -> dict[str, float]:
    """Median ms of each phase over ``repeats`` calls, after one that captures."""
    from hf_openjev.contract import parse_request
    from hf_openjev.scoring import PreparedRequest, score_prepared

    score_prepared(model, [prepared], fast=True)
    samples: dict[str, list[float]] = {name: [] for name in PHASES}
    for _ in range(repeats):
        start = time.perf_counter()
        prepared = PreparedRequest(parse_request(request), prepared.tokens)
        prepare = (time.perf_counter() - start) * 1000
        times: dict[str, float] = {}
        with timed_steps(times):
            start = time.perf_counter()
            score_prepared(model, [prepared], fast=True)
            wall = (time.perf_counter() - start) * 1000
        steps = sum(times.values())
        for name, value in {"prepare": prepare, **times, "head + scores": wall - steps,
                            "host": prepare + wall}.items():
            samples[name].append(value)
    result = {name: statistics.median(values) for name, values in samples.items() if values}
    result["context, new shape"] = time_new_shapes(model, prepared, repeats)
    return result


def request_dict(prepared) -> dict:
    """A request dict of the prepared request's question (what ``prepare`` validates)."""
    question = prepared.parsed.questions[0]
    body = {"type": question.type, "instructions": "x"}
    criteria = KINDS[question.type].index_criteria(len(prepared.tokens[0]))
    if criteria is not None:
        body["criteria"] = criteria
    return {"state": "x", "questions": {"q": body}}


def short_requests(indices) -> list[tuple[str, object]]:
    """(label, PreparedRequest): one 107-token noul candidate, then the workload's requests ``indices``."""
    work = build_workload(SHAPES_FILE, vocab=VOCAB, seed=0)
    targets = [("one 107-token candidate (noul)", single_candidate_request(107))]
    for i in indices:
        item, prepared = work[i]
        targets.append((REQUESTS.get(i, f"index {i}") + f": prefix {item['prefix_tokens']}, suffixes "
                        f"{item['suffix_tokens']}", prepared))
    return targets


def write_markdown(result: dict, path: Path) -> None:
    lines = [f"# Host ms of short fast-path requests on a CPU ({result['layers']} layers, medians of "
             f"{result['repeats']})", "", f"Command: `{result['command']}`", "",
             f"Commit: {result.get('git_commit')}", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), "",
             f"Device: {result['device']} (one torch thread)", "",
             "| request | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
    for label, phases in result["requests"].items():
        lines.append(f"| {label} | " + " | ".join(f"{phases[p]:.3f}" for p in PHASES) + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--layers", type=int, default=64, help="decoder layers (64: the 27B's)")
    parser.add_argument("--requests", default="71,0,119,141", help="JevBench workload requests, 0-based indices")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.layers < 4 or args.layers % 4:
        parser.error("--repeats must be at least 1 and --layers a multiple of 4")
    indices = [int(x) for x in args.requests.split(",") if x]
    from hf_openjev.family import text_model_of
    from hf_openjev.patches import apply_patches, patch_record

    torch.set_num_threads(1)
    SHAPES[SHAPE] = {**SHAPES[SHAPE], "num_hidden_layers": args.layers}
    model = build_model(SHAPE, seed=0, device="cpu", dtype=torch.float32)
    record = apply_patches(model)
    record.graphs = stand_in_graphs(text_model_of(model))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.platform()}"
    script_argv = None if argv is None else ["recipes/host_phases.py", *argv]
    result = {"command": command_line(script_argv), "git_commit": git_commit(), "versions": versions(), "device": device,
              "layers": args.layers, "repeats": args.repeats, "requests": {}}
    for label, prepared in short_requests(indices):
        result["requests"][label] = time_request(model, request_dict(prepared), prepared, args.repeats)
        print(label, {k: round(v, 3) for k, v in result["requests"][label].items()}, flush=True)
    result["graphs"] = patch_record(model).graphs.stats()
    (out / "host_phases.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, out / "host_phases.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

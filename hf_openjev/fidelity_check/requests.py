"""The requests a fidelity run compares, and each configuration's answers to them as oracle-format entries.

A :class:`FidelityItem` is one prepared request with its id (``<tier>/<task id>`` for a task file, the shape's
id for the benchmark's workload) and, for a task, the task (its labels and expected answer, for accuracy).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .gate import describe_request, hash_tokens


@dataclass(frozen=True)
class FidelityItem:
    id: str
    kind: str
    prepared: object  # hf_openjev.scoring.PreparedRequest
    task: object | None = None  # hf_openjev.eval.tasks.Task, when the request comes from a task file

    @property
    def tokens_sha256(self) -> str:
        return hash_tokens(self.prepared.tokens)


def items_from_workload(work: Sequence[tuple[dict, object]]) -> list[FidelityItem]:
    """``build_workload``'s ``[(shape item, PreparedRequest)]`` as items (ids and kinds of the shapes)."""
    return [FidelityItem(str(item["id"]), item["kind"], prepared) for item, prepared in work]


def items_from_tasks(model, tasks, *, warn=None) -> tuple[list[FidelityItem], list[dict]]:
    """Tokenize every task with ``model``'s tokenizer: (items, the tasks the contract rejects, as eval lists them)."""
    from ..errors import RequestError
    from ..scoring import prepare_request

    items, invalid = [], []
    for task in tasks:
        try:
            prepared = prepare_request(model, task.request)
        except RequestError as exc:
            reason = f"request rejected: {exc}" + (f" ({exc.detail})" if exc.detail else "")
            invalid.append({"file": task.file, "line": task.line, "tier": task.tier, "id": task.id,
                            "stage": "request", "error": reason})
            if warn is not None:
                warn(f"{task.file}:{task.line}: invalid task: {reason}")
            continue
        items.append(FidelityItem(f"{task.tier}/{task.id}", task.kind, prepared, task))
    return items, invalid


def entries_from_responses(items: Sequence[FidelityItem], responses: Sequence[dict]) -> list[dict]:
    """Response dicts (one per item, in order) -> oracle-format entries with the items' token hashes."""
    if len(items) != len(responses):
        raise ValueError(f"{len(responses)} responses for {len(items)} requests")
    return [describe_request(item.id, item.kind, response, tokens_sha256=item.tokens_sha256)
            for item, response in zip(items, responses)]


def answer_items(model, items: Sequence[FidelityItem], *, fast: bool, options=None, batch_size: int = 32,
                 warm_up: bool = False, desc: str = "", progress: bool = True) -> list[dict]:
    """Each item alone through ``model`` (``fast``: the fast path with ``options``, patched in place first; else the
    reference path in right-padded batches of ``batch_size`` candidates, as a user runs it): the responses.
    ``warm_up``: one unrecorded pass first (kernels autotune and CUDA graphs are captured there), then the answers
    of the steady state, as the benchmark measures them."""
    from tqdm.auto import tqdm

    from ..scoring import prepare_path

    method = prepare_path(model, fast, options)
    for label in (["warm-up " + desc] if warm_up else []) + [desc]:  # the last pass's answers are kept
        responses = _answer_pass(model, items, fast=method == "fast", options=options, batch_size=batch_size,
                                 bar=tqdm(items, desc=label, unit="req", disable=not progress, file=sys.stderr))
    return responses


def _answer_pass(model, items, *, fast: bool, options, batch_size: int, bar) -> list[dict]:
    from ..scoring import build_answer, score_prepared

    responses = []
    for item in bar:
        result = score_prepared(model, [item.prepared], fast=fast, batch_size=batch_size, options=options)
        responses.append(build_answer(model, item.prepared, result.scores[0], seconds=result.seconds,
                                      prefix_cache=result.prefix_cache[0], method=result.path))
    return responses

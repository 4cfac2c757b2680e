"""The benchmark's workload as prepared requests: JevBench request shapes filled with seeded random token ids.

A shapes file (``data/bench/jevbench231-shapes.json``) lists ``{"id", "kind", "prefix_tokens",
"suffix_tokens": [n per candidate]}`` per request. :func:`build_workload` draws the ids with ``random.Random(seed)``
in file order, so the same file, vocabulary and seed always give the same ids (the benchmark's, the fp32
oracle's and ``hf-openjev fidelity --workload``'s).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ..contract import KIND_NAMES, KINDS

MIN_RANDOM_ID = 1000  # ids are drawn from [1000, vocab): clear of the special tokens at the vocabulary's start


def build_workload(path: str | Path, *, vocab: int, seed: int, limit: int | None = None,
                   max_length: int | None = None) -> list[tuple[dict, object]]:
    """``[(shape item, PreparedRequest)]``: one question ``"q"`` per request, its candidates' random ids identical
    within the request's shared prefix. ``limit``: the first N requests; ``max_length``: only those whose longest
    sequence has at most this many tokens (the ids do not depend on either filter)."""
    from ..contract import parse_request
    from ..scoring import PreparedRequest

    data = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    work = []
    for item in data["requests"][:limit]:
        n = len(item["suffix_tokens"])
        kind = item["kind"]
        criteria = KINDS[kind].index_criteria(n)
        question = {"type": kind, "instructions": "x"}
        if criteria is not None:
            question["criteria"] = criteria
        parsed = parse_request({"state": "x", "questions": {"q": question}})
        prefix = [rng.randrange(MIN_RANDOM_ID, vocab) for _ in range(item["prefix_tokens"])]
        tokens = [[prefix + [rng.randrange(MIN_RANDOM_ID, vocab) for _ in range(s)] for s in item["suffix_tokens"]]]
        if max_length is None or item["prefix_tokens"] + max(item["suffix_tokens"]) <= max_length:
            work.append((item, PreparedRequest(parsed, tokens)))
    return work


def check_workload_file(path: str | Path) -> int:
    """The number of requests of a shapes file, or a ValueError saying what is wrong with it (nothing drawn)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the workload ({exc})") from None
    requests = data.get("requests") if isinstance(data, dict) else None
    if not isinstance(requests, list) or not requests:
        raise ValueError(f"{path}: a workload file holds {{\"requests\": [{{\"id\", \"kind\", \"prefix_tokens\", "
                         "\"suffix_tokens\"}, ...]}")
    for number, item in enumerate(requests):
        ok = (isinstance(item, dict) and isinstance(item.get("id"), str)
              and item.get("kind") in KIND_NAMES and isinstance(item.get("prefix_tokens"), int)
              and isinstance(item.get("suffix_tokens"), list) and item["suffix_tokens"]
              and all(isinstance(s, int) and s >= 0 for s in item["suffix_tokens"]))
        fixed = KINDS[item["kind"]].fixed_candidates if ok else None
        if not ok or (fixed is not None and len(item["suffix_tokens"]) != len(fixed)):
            raise ValueError(f"{path}: request {number} is not an id / kind / prefix_tokens / suffix_tokens shape")
    return len(requests)

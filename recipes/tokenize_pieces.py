"""The tokenizer's two batch shortcuts against one call a text, on this machine (issue 37 item 1): a long state
tokenized in pieces on the tokenizer's threads against whole; a short request's candidates tokenized together, in
one call, against one by one.

    python recipes/tokenize_pieces.py [--words 3300] [--rounds 5] [--calls 15]

``prepare_request`` (validation and tokenization) on the demo's tiny checkpoint with the real Qwen3.5 tokenizer, for
a state of ``--words`` words (3,300: about 3,800 tokens a candidate; at most the 16,384 tokens a checkpoint allows) under a choice of 6 options and under a noul;
pieces of ``PIECE_CHARS`` characters (``hf_openjev.tokenizer.candidate_tokens``) alternated with one piece (whole
texts), ``--rounds`` times, each round's median of ``--calls`` calls. Then JevBench's requests whose longest candidate
is at most 512 tokens (the exact manifest's counts), each through ``tokenize_request`` as the server calls it (the
fast path's token budget), with their candidates tokenized together (``BATCH_BYTES``) alternated with one by one
(``BATCH_BYTES`` 0): per round the median per request, by group. Checks that each pair of arms gives the same ids.
Prints a JSON line: per arm and request (or group), the median of the rounds' medians (ms) and every round's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time

WORDS = ["state", "player", "position", "12", "the", "a", "move", "north", ":", "{", "}", "value", "score", "\n"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--words", type=int, default=3300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args(argv)
    import hf_openjev
    from hf_openjev.export.tiny import build_tiny_checkpoint
    from hf_openjev.scoring import prepare_request
    from hf_openjev.tokenizer import candidate_tokens

    with tempfile.TemporaryDirectory() as root:
        tiny = build_tiny_checkpoint(root, tokenizer="qwen3.5", max_length=16384)
        model = hf_openjev.load_export(tiny.export, dtype="float32", device="cpu")
    rng = random.Random(0)
    state = " ".join(rng.choice(WORDS) for _ in range(args.words))
    requests = {"choice of 6": {"state": state, "questions": {"q": {"type": "choice", "instructions": "pick one",
                                                                    "criteria": {f"o{i}": None for i in range(6)}}}},
                "noul": {"state": state, "questions": {"q": {"type": "noul", "instructions": "is it?"}}}}
    arms, rounds, ids = {"pieces": candidate_tokens.PIECE_CHARS, "whole": 1 << 62}, {}, {}
    try:
        for _ in range(args.rounds):
            for arm, size in arms.items():
                candidate_tokens.PIECE_CHARS = size
                for name, request in requests.items():
                    times = []
                    for _ in range(args.calls):
                        start = time.perf_counter()
                        prepared = prepare_request(model, request)
                        times.append(time.perf_counter() - start)
                    ids.setdefault(name, prepared.tokens)
                    if prepared.tokens != ids[name]:
                        raise SystemExit(f"{arm} gave other ids for {name}")
                    rounds.setdefault(f"{arm}, {name}", []).append(round(statistics.median(times) * 1000, 3))
    finally:
        candidate_tokens.PIECE_CHARS = arms["pieces"]
    time_short_requests(model, args.rounds, rounds)
    tokens = {name: [len(c) for q in t for c in q][0] for name, t in ids.items()}
    print(json.dumps({"state_chars": len(state), "tokens_per_candidate": tokens, "piece_chars": arms["pieces"],
                      "batch_bytes": candidate_tokens.BATCH_BYTES,
                      "median_ms": {k: statistics.median(v) for k, v in rounds.items()}, "rounds_ms": rounds}))
    return 0


def time_short_requests(model, n_rounds: int, rounds: dict) -> None:
    """JevBench's short requests through ``tokenize_request``, candidates together against one by one (into
    ``rounds``: ``"<arm>, <group>"`` -> per round the median ms per request); the same ids from both, or SystemExit."""
    from bench_e2e import DATA, load_requests
    from benchlib.groups import longest_tokens
    from benchlib.workload import MANIFEST

    from hf_openjev.contract import parse_request
    from hf_openjev.scoring import tokenize_request
    from hf_openjev.serve.limits import RequestLimits
    from hf_openjev.tokenizer import candidate_tokens

    groups: dict[str, list] = {"noul 1-128": [], "choice 1-512": [], "all <= 512": []}
    for item, request in load_requests(DATA, MANIFEST, limit=None):
        n, parsed = longest_tokens(item), parse_request(request)
        for name, member in (("noul 1-128", item["kind"] == "noul" and n <= 128),
                             ("choice 1-512", item["kind"] == "choice" and n <= 512), ("all <= 512", n <= 512)):
            if member:
                groups[name].append(parsed)
    cap, together, ids = RequestLimits().max_request_tokens, candidate_tokens.BATCH_BYTES, {}
    try:
        for _ in range(n_rounds):
            for arm, size in (("together", together), ("one by one", 0)):
                candidate_tokens.BATCH_BYTES = size
                for name, requests in groups.items():
                    times, tokens = [], []
                    for parsed in requests:
                        start = time.perf_counter()
                        tokens.append(tokenize_request(model, parsed, max_total_tokens=cap, fast=True).tokens)
                        times.append(time.perf_counter() - start)
                    if ids.setdefault(name, tokens) != tokens:
                        raise SystemExit(f"{arm} gave other ids for {name}")
                    rounds.setdefault(f"{arm}, {name}", []).append(round(statistics.median(times) * 1000, 3))
    finally:
        candidate_tokens.BATCH_BYTES = together


if __name__ == "__main__":
    sys.exit(main())

"""A long state tokenized in pieces on the tokenizer's threads against whole, on this machine (issue 37 item 1).

    python recipes/tokenize_pieces.py [--words 3300] [--rounds 5] [--calls 15]

``prepare_request`` (validation and tokenization) on the demo's tiny checkpoint with the real Qwen3.5 tokenizer, for
a state of ``--words`` words (3,300: about 3,800 tokens a candidate; at most the 16,384 tokens a checkpoint allows) under a choice of 6 options and under a noul;
pieces of ``PIECE_CHARS`` characters (``hf_openjev.tokenizer.candidate_tokens``) alternated with one piece (whole
texts), ``--rounds`` times, each round's median of ``--calls`` calls. Checks that both give the same ids. Prints a
JSON line: per arm and request, the median of the rounds' medians (ms) and every round's.
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
    tokens = {name: [len(c) for q in t for c in q][0] for name, t in ids.items()}
    print(json.dumps({"state_chars": len(state), "tokens_per_candidate": tokens, "piece_chars": arms["pieces"],
                      "median_ms": {k: statistics.median(v) for k, v in rounds.items()}, "rounds_ms": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

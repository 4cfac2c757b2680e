"""Small hand-made plans the layout's tests (layout_steps, naive_layout, pack_context) describe step by step.

Three plans of one request whose two candidates share an 80-token state (64 tokens at a multiple of 64, then 16):

- ``TWO``: aligned sharing: segment 0 = the 64-token prefix, 1 and 2 = the candidates (19 and 18 tokens);
- ``TAILS``: exact sharing: 0 = the 64-token prefix, 1 = the 16-token tail (hands no state on), 2 and 3 = the
  candidates' own tokens (3 and 2);
- ``SPLIT``: ``TWO`` one candidate per pack: the prefix runs alone and exports its state, each candidate continues it;

and ``NESTED``: two questions, a 40-token request tail, then each question's 20-token tail, then one own token per
candidate (tails under tails, no state handed on).

:func:`random_token_requests` draws random batches of requests of the same nesting for the fast path's end-to-end
tests.
"""

from __future__ import annotations

import random

from aligned_plans import plan_requests  # the aligned layout these plans describe (tails: TAILS)

from hf_openjev.packing.layout_steps import ExternalBlocks

STATE = list(range(100, 180))  # 80 tokens
CANDIDATES = [[[STATE + [7, 8, 9], STATE + [5, 6]]]]
TWO = plan_requests(CANDIDATES)
TAILS = plan_requests(CANDIDATES, share_tails=True, min_shared_tokens=16)
SPLIT = plan_requests(CANDIDATES, max_sequences=1)
NO_EXTERNAL = ExternalBlocks([], {}, {}, 0)
NESTED = plan_requests([[[list(range(100, 140)) + list(range(200, 220)) + [c] for c in (1, 2)],
                         [list(range(100, 140)) + list(range(300, 320)) + [c] for c in (3, 4)]]],
                       share_tails=True, min_shared_tokens=8)


def random_token_requests(rng: random.Random, vocab: int) -> list:
    """1-3 requests [question][candidate] of token ids: shared states of 0-200 tokens, question heads of 0-100,
    candidates' own 1-40 tokens."""
    requests = []
    for _ in range(rng.randint(1, 3)):
        prefix = [rng.randrange(5, vocab) for _ in range(rng.randint(0, 200))]
        questions = []
        for _ in range(rng.randint(1, 2)):
            head = prefix + [rng.randrange(5, vocab) for _ in range(rng.randint(0, 100))]
            questions.append([head + [rng.randrange(5, vocab) for _ in range(rng.randint(1, 40))]
                              for _ in range(rng.randint(1, 5))])
        requests.append(questions)
    return requests

"""``hf-openjev eval`` as one rank of a launched run, where rank ``$CRASH_RANK`` dies (``os._exit(17)``, no clean-up)
as it starts its batch number ``$CRASH_AFTER + 1``: a real crash of one rank, for tests/test_eval_sharding.py.

    accelerate launch ... tests/eval_rank_crash.py eval --model ... --data ... --out ...
"""

import os
import sys

from hf_openjev.cli import main
from hf_openjev.eval import evaluate as ev

_REAL = ev.score_prepared
_CALLS = [0]


def _crashing(*args, **kwargs):
    doomed = int(os.environ.get("RANK", "0")) == int(os.environ["CRASH_RANK"])
    if doomed and _CALLS[0] >= int(os.environ["CRASH_AFTER"]):
        os._exit(17)
    _CALLS[0] += 1
    return _REAL(*args, **kwargs)


ev.score_prepared = _crashing

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The objects a server holds from its start (the model's modules, the tokenizer, the caches: ~400,000 Python objects
with the tiny demo and the real Qwen3.5 tokenizer) moved out of the garbage collector's reach once loading is done.

Python's full collection walks every tracked object while it holds the GIL: ~250 ms for those, during which no
thread of the server runs, which is what the slowest small requests beside a flood of big bodies waited for
(recipes/RESULTS.md, the big-body probe). After :func:`gc.freeze` a full collection walks only what came later.
Nothing frozen is freed until the process ends; these objects live that long anyway.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_objects"]


def freeze_startup_objects() -> int:
    """Collect once, then freeze everything still alive; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

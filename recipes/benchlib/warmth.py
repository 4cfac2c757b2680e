"""Whether an arm was warmed on every request shape before it was timed: a cold arm's figures take no ratio.

fla-core tunes its kernels per shape on first use, inside whatever pass sees that shape first: an arm whose warm-up
skipped shapes its timed pass runs pays that tuning in its timed requests. An arm is *warm* when every timed
request's shape (``prefix_tokens`` and ``suffix_tokens`` of its manifest item) was run before the timed pass, in
its warm-up or earlier in the same process; otherwise it is labelled *cold* and no C/B ratio is taken from it.
"""

from __future__ import annotations

from collections.abc import Iterable


def item_shape(item: dict) -> tuple:
    """A manifest item's token shape: ``(prefix tokens, (suffix tokens per candidate))``."""
    return item["prefix_tokens"], tuple(item["suffix_tokens"])


def covers_every_shape(seen: Iterable[dict], timed: Iterable[dict]) -> bool:
    """Whether the manifest items ``seen`` (warm-up, earlier passes) hold every shape of the ``timed`` items."""
    shapes = {item_shape(item) for item in seen}
    return all(item_shape(item) in shapes for item in timed)


def warmth_note(cold: bool, warmed: int, total: int) -> str:
    """The label of an arm in a report: empty when warm, else why it is cold."""
    return f" (cold: warmed on {warmed} of {total} requests, not every shape; no ratio)" if cold else ""

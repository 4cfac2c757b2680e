"""Graph buckets chosen by measured GEMM cost: a pack is padded to the cheapest measured row count, not the next step.

A forward's projection GEMMs run over all of a pack's rows (every level, dummies included), and their time as a
function of the row count is not monotone on a GPU: a larger row count can be faster than a smaller one. A
:class:`BucketPolicy` holds one shape's measured cost table (``gemm_costs.py``, which
``recipes/bucket_table.py`` writes from ``recipes/gemm_sweep.py`` outputs) and pads a pack so that its rows are
the cheapest measured row count in ``[rows, rows + window]`` (ties to the smallest): no padded size costs more than
a larger one within the window. Only the pack's last level is padded that way (its earlier levels keep the fixed
token steps of :mod:`.graph_buckets`, so the last level's choice fixes the pack's row count); the sequence-count
buckets, the dummies' invariants and the Gated DeltaNet calls' gathered layouts are unchanged. The distinct row
counts are at most the table's, so the number of graph buckets stays bounded. Past the table's last row, and for
a shape with no table (:func:`bucket_policy_for` gives None), the fixed token steps apply.

Built once per model (``patches.apply_patches`` keeps it on the patch record) and passed to
``build_pack_context(..., buckets=)``; a policy is compared by identity (the layout cache keys on it).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from .gemm_costs import GEMM_COSTS
from .graph_buckets import bucket_tokens

DEFAULT_WINDOW = 128  # rows ahead a pack may be padded to a cheaper row count


@dataclass(frozen=True, eq=False)
class BucketPolicy:
    """A measured cost table: ``ms[i]`` is one forward's GEMM time at ``rows[i]`` rows (``rows`` ascending)."""

    name: str
    rows: tuple[int, ...]
    ms: tuple[float, ...]
    window: int = DEFAULT_WINDOW

    def __post_init__(self):
        if not self.rows or len(self.rows) != len(self.ms):
            raise ValueError(f"bucket table {self.name!r}: give as many ms as rows, at least one")
        if any(b <= a for a, b in zip(self.rows, self.rows[1:])) or self.rows[0] < 1:
            raise ValueError(f"bucket table {self.name!r}: rows must be positive and ascending")
        if self.window < 0:
            raise ValueError(f"bucket table {self.name!r}: window must be >= 0, got {self.window}")

    def pack_rows(self, rows: int) -> int:
        """The padded row count of a pack of at least ``rows`` rows: the cheapest measured row count in
        ``[rows, rows + window]``, ties to the smallest (the fixed token step when ``rows`` is past the table or
        the window holds no measured row count)."""
        first = bisect_left(self.rows, rows)
        best = first
        for index in range(first + 1, len(self.rows)):
            if self.rows[index] > rows + self.window:
                break
            if self.ms[index] < self.ms[best]:
                best = index
        if first == len(self.rows) or self.rows[first] > rows + self.window:
            return bucket_tokens(rows)
        return self.rows[best]

    def cost_ms(self, rows: int) -> float:
        """The measured ms at the smallest measured row count >= ``rows`` (linear in rows past the table's end)."""
        index = bisect_left(self.rows, rows)
        if index == len(self.rows):
            return self.ms[-1] * rows / self.rows[-1]
        return self.ms[index]


def table_policy(name: str, *, window: int = DEFAULT_WINDOW) -> BucketPolicy:
    """The policy of ``GEMM_COSTS[name]`` (``"27b"``, ``"9b"``, ``"2b"``)."""
    if name not in GEMM_COSTS:
        raise ValueError(f"no GEMM cost table for {name!r}; tables: {', '.join(GEMM_COSTS)}")
    _, step, ms = GEMM_COSTS[name]
    return BucketPolicy(name, tuple(range(step, step * len(ms) + 1, step)), tuple(ms), window)


def bucket_policy_for(config) -> BucketPolicy | None:
    """The policy of the cost table measured at ``config``'s shape (a ``Qwen3_5TextConfig``), or None (the fixed
    token steps) for a shape with no table (an unknown shape, the tiny test models)."""
    from hf_openjev.family import shape_of

    try:
        shape = tuple(shape_of(config))
    except AttributeError:  # not a Qwen3.5 text config: no table can match
        return None
    return next((table_policy(name) for name, (table_shape, _, _) in GEMM_COSTS.items()
                 if tuple(table_shape) == shape), None)

"""Several processes for ``hf-openjev eval``: who am I, token-balanced shards, per-rank results files, the merge.

Launched with ``accelerate launch --num_processes N -m hf_openjev eval ...`` (or ``torchrun``, or accelerate's
multi-node configuration), every process runs :func:`~hf_openjev.eval.evaluate.evaluate`; this module holds what
they need to split the work without stepping on each other:

- :func:`current_processes`: rank, world size and local rank through accelerate's ``PartialState`` (gloo on a
  CPU-only machine, accelerate's default backend on GPUs). A process that was not launched as one of several never
  imports accelerate: world size 1, as before.
- :func:`shard_by_tokens`: greedy longest-first assignment of task costs (tokens) to the rank with the fewest tokens
  so far; deterministic, so every rank computes the same shards without talking to the others.
- per-rank results files ``results.rank<k>.jsonl`` (one writer each: no interleaving, even on a network file
  system where ``O_APPEND`` is not atomic) and :func:`merge_results`, which folds them into ``results.jsonl``.
"""

from __future__ import annotations

import heapq
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

RESULTS_NAME = "results.jsonl"
_RANK_FILE = re.compile(r"^results\.rank(\d+)\.jsonl$")
_LAUNCH_ENV = ("LOCAL_RANK", "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
BARRIER_TIMEOUT_S = 4 * 3600  # ranks wait at most this long for the slowest one (model load + its shard)


@dataclass(frozen=True)
class Processes:
    """This process among the ones evaluating together: ``rank`` in [0, world), ``local_rank`` on its node."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    _wait: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wait(self) -> None:
        """A barrier over every process (nothing with one process). Call it only where every rank passes."""
        if self.world > 1 and self._wait is not None:
            self._wait()


def _launched() -> bool:
    """Whether a launcher (torchrun / accelerate launch / mpirun) started this process as one of several."""
    if int(os.environ.get("LOCAL_RANK", "-1")) != -1:
        return True
    return any(int(os.environ.get(name, "1") or 1) > 1 for name in _LAUNCH_ENV[1:])


def current_processes() -> Processes:
    """This process's rank, world size and local rank (``Processes()`` = one process, when not launched).

    Uses ``accelerate.PartialState`` (which initialises ``torch.distributed``: gloo without CUDA, else accelerate's
    GPU default), with a barrier timeout of :data:`BARRIER_TIMEOUT_S`. An already initialised process group is
    reused as is."""
    import torch

    if not _launched() and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return Processes()
    from datetime import timedelta

    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(seconds=BARRIER_TIMEOUT_S))
    if state.num_processes <= 1:
        return Processes()
    return Processes(rank=state.process_index, world=state.num_processes,
                     local_rank=max(state.local_process_index, 0), _wait=state.wait_for_everyone)


def close_processes(processes: Processes) -> None:
    """End the process group of a launched run (``torch.distributed.destroy_process_group``) once every rank is
    done with it: the command line calls this at exit, so NCCL does not warn about a leaked group."""
    import torch

    if processes.world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def rank_device(device, processes: Processes):
    """The device of this rank: ``cuda:<local_rank>`` for ``None`` / ``"cuda"`` with CUDA (several processes),
    else ``device`` unchanged (``None`` -> ``"cuda"`` or ``"cpu"``, as one process picks it)."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if processes.world > 1 and str(device) == "cuda":
        torch.cuda.set_device(processes.local_rank)
        return f"cuda:{processes.local_rank}"
    return device


# -- sharding --------------------------------------------------------------------------------------------------------

def shard_by_tokens(costs: Sequence[int], world: int) -> list[list[int]]:
    """Split task indices ``0..len(costs)-1`` into ``world`` disjoint shards of about equal total cost.

    Greedy longest-first: tasks by decreasing cost (ties: lower index first) go to the shard with the smallest total
    so far (ties: lower rank). Deterministic. Each shard's indices are returned in increasing order (the input
    order, so a shard's batches follow the task files). Guarantee: max total - min total <= max(costs). A shard may
    be empty (more ranks than tasks)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    shards: list[list[int]] = [[] for _ in range(world)]
    heap = [(0, rank) for rank in range(world)]  # (total, rank): the smallest total, then the lowest rank, on top
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        total, rank = heapq.heappop(heap)
        shards[rank].append(index)
        heapq.heappush(heap, (total + costs[index], rank))
    return [sorted(shard) for shard in shards]


# -- per-rank results files ------------------------------------------------------------------------------------------

def rank_results_path(out_dir: Path, rank: int) -> Path:
    """``<out_dir>/results.rank<rank>.jsonl``: the file rank ``rank`` appends its records to."""
    return Path(out_dir) / f"results.rank{rank}.jsonl"


def rank_results_files(out_dir: Path) -> list[Path]:
    """Every ``results.rank<k>.jsonl`` in ``out_dir`` (any k: a run with another world size may have left them),
    by k."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out_dir.iterdir() if (m := _RANK_FILE.match(p.name))]
    return [p for _, p in sorted(found)]


def results_files(out_dir: Path) -> list[Path]:
    """``results.jsonl`` then the per-rank files: the order in which records are read (the last one wins)."""
    return [Path(out_dir) / RESULTS_NAME, *rank_results_files(out_dir)]


def merge_results(out_dir: Path, read, keys: Sequence[tuple[str, str]]) -> None:
    """Fold the per-rank files into ``results.jsonl`` and delete them (nothing to do without per-rank files).

    ``read(path) -> {(tier, id): record}``; ``keys``: the current tasks in input order. The new file holds the
    records of ``results.jsonl`` in their order (tasks of other inputs included), then the other records of the
    current tasks in task order, then any left. Written to a temporary file, fsync'ed and renamed over
    ``results.jsonl`` before the per-rank files go, so a crash at any point loses no record (a record in both
    places is read once: same key)."""
    out_dir = Path(out_dir)
    ranks = rank_results_files(out_dir)
    if not ranks:
        return
    merged = dict(read(out_dir / RESULTS_NAME))
    others: dict[tuple[str, str], dict] = {}
    for path in ranks:
        others.update(read(path))
    for key in keys:
        if key in others:
            merged[key] = others.pop(key)
    merged.update(others)
    tmp = out_dir / f"{RESULTS_NAME}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in merged.values())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out_dir / RESULTS_NAME)
    except BaseException:  # a full disk: the per-rank files still hold every record; no temporary is left
        tmp.unlink(missing_ok=True)
        raise
    for path in ranks:
        path.unlink()

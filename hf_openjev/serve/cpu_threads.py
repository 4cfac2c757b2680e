"""Torch's CPU threads when ``serve`` scores on the CPU: one core left to the server's own work.

The server reads bodies on its event loop and validates and tokenizes them on worker threads while torch scores on
the CPU. With as many torch threads as cores, those threads spin against the server's own work and the tail of a
small request beside a flood of big bodies grows several-fold (recipes/RESULTS.md, the big-body probe). So, on a
CPU replica, torch gets one core fewer than the machine has (at least one), unless ``OMP_NUM_THREADS`` says
otherwise: then torch's own reading of it stands. On CUDA nothing changes.
"""

from __future__ import annotations

import os

__all__ = ["leave_a_core_for_the_server"]


def leave_a_core_for_the_server(devices: list[str], *, cpus: int | None = None, environ=os.environ) -> int | None:
    """Set torch's intra-op threads for a server whose ``devices`` include the CPU: the number set, or None when
    nothing was changed (no CPU replica, or ``OMP_NUM_THREADS`` set)."""
    if not any(str(d).split(":")[0] == "cpu" for d in devices) or environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    threads = max(1, (cpus if cpus is not None else (os.cpu_count() or 1)) - 1)
    torch.set_num_threads(threads)
    return threads

"""Device checks: refuse a device this machine does not have before anything loads, and turn what the loaders
accept into a ``torch.device``."""

from __future__ import annotations

import torch

from .errors import UsageError


def check_device(device) -> None:
    """Refuse a device this machine does not have, with a one-line :class:`UsageError` (a ``ValueError``).

    Accepts what the loaders and ``pipeline(device=...)`` accept: None, ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a
    ``torch.device``, a GPU ordinal (``-1`` is the CPU) or a ``device_map`` dict of those. Without this, a CUDA
    device on a machine without CUDA ends deep in torch with ``AssertionError: Torch not compiled with CUDA enabled``.
    """
    if device is None:
        return
    if isinstance(device, dict):
        for value in device.values():
            check_device(value)
        return
    if isinstance(device, bool):
        raise UsageError(f"device must be 'cpu', 'cuda', 'cuda:N' or a GPU index, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            return
        device = f"cuda:{device}"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'") from None
    if parsed.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
               else "no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)")
        raise UsageError(f"device {str(device)!r} was requested but CUDA is not available on this machine: {why}; "
                         "use device 'cpu' (or leave the device out)")
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise UsageError(f"device {str(device)!r} was requested but this machine has {count} CUDA GPU(s) "
                         f"(cuda:0..cuda:{count - 1})")


def torch_device(device) -> torch.device:
    """What :func:`check_device` accepts (but a dict) as a ``torch.device``: a GPU ordinal is ``cuda:N``, -1 the CPU."""
    if isinstance(device, int):
        return torch.device("cpu") if device < 0 else torch.device(f"cuda:{device}")
    return torch.device(device)

"""One server over several GPUs: ``hf-openjev serve --devices cuda:0,cuda:1,...`` loads one replica of the model per
device; the batcher's one admission queue feeds whichever replica is free (:mod:`hf_openjev.serve.batcher`).

:func:`parse_devices` reads the flag and checks every device before anything loads (one-line
:class:`~hf_openjev.errors.UsageError` otherwise); :func:`load_replicas` loads the export once per device;
:func:`warm_up_replicas` captures each replica's graphs, all devices at once, before the server takes traffic.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from .batcher import bind_device

__all__ = ["load_replicas", "parse_devices", "warm_up_replicas"]

logger = logging.getLogger(__name__)


def parse_devices(text: str) -> list[str]:
    """``"cuda:0,cuda:1"`` -> ``["cuda:0", "cuda:1"]``, each checked with :func:`hf_openjev.devices.check_device`.

    Refuses (:class:`UsageError`, one line) an empty list, an unknown or absent device, a CUDA device listed twice
    (``cuda`` is ``cuda:0``) and a mix of CPU and CUDA. ``cpu`` may repeat (``cpu,cpu``: tests, demos)."""
    import torch

    from ..devices import check_device
    from ..errors import UsageError

    devices = [part.strip() for part in str(text).split(",")]
    if not devices or any(not d for d in devices):
        raise UsageError(f"--devices takes a comma-separated list such as cuda:0,cuda:1; got {text!r}")
    seen = {}
    for device in devices:
        check_device(device)
        parsed = torch.device(device)
        if parsed.type == "cuda":
            key = f"cuda:{parsed.index or 0}"
            if key in seen:
                raise UsageError(f"--devices lists {key} twice ({seen[key]!r} and {device!r}); one replica per GPU")
            seen[key] = device
    kinds = {torch.device(d).type for d in devices}
    if len(kinds) > 1:
        raise UsageError(f"--devices mixes {' and '.join(sorted(kinds))}; replicas must run on one kind of device")
    return devices


def load_replicas(model_dir, devices: list[str], *, dtype="auto", fp8: str = "off",
                  allow_unknown_shape: bool = False) -> list:
    """The export loaded once per device, in order (:func:`hf_openjev.model.load_export`; with ``fp8`` on, each
    replica is quantized on the CPU before it moves to its device, so no device holds the bf16 weights)."""
    from ..model import load_export

    models = []
    for device in devices:
        models.append(load_export(model_dir, dtype=dtype, device=device, fp8=fp8,
                                  allow_unknown_shape=allow_unknown_shape))
        logger.info("replica %d of %d loaded on %s%s", len(models), len(devices), device, _fp8_note(models[-1]))
    return models


def _fp8_note(model) -> str:
    """`` with fp8 all (25 FP8 projections)`` for a model whose projections are FP8, else ``""``."""
    from ..fp8.linear import Fp8Linear
    from ..fp8.swap import fp8_mode_of

    count = sum(isinstance(m, Fp8Linear) for m in model.modules())
    return f" with fp8 {fp8_mode_of(model)} ({count} FP8 projections)" if count else ""


def warm_up_replicas(models: list, shapes, options=None) -> list[dict]:
    """:func:`hf_openjev.serve.warmup.warm_up` on every replica, one thread per replica bound to its device, all at once;
    returns their reports in order (the first failure raises)."""
    from .warmup import warm_up

    def one(model) -> dict:
        bind_device(model)
        return warm_up(model, shapes, options, progress=len(models) == 1)  # one model: with its progress bar

    with ThreadPoolExecutor(max_workers=len(models), thread_name_prefix="jev-warm-up") as pool:
        return list(pool.map(one, models))

"""Transformers' advice to install ``causal_conv1d``, silenced: the project never installs it (the CPU runs the
reference path, whose PyTorch causal conv is the right one there, and CUDA's fast path runs its own kernel,
``torch.ops.hf_openjev.causal_conv1d_packed``), so the note printed on every CPU command asked for what must not be
done. Only that message is dropped; every other Transformers warning still shows."""

from __future__ import annotations

import logging

__all__ = ["quiet_causal_conv_advice"]

HUB_KERNELS_LOGGER = "transformers.integrations.hub_kernels"


class _DropCausalConvAdvice(logging.Filter):
    """Drops the ``causal_conv1d`` fallback note of ``transformers.integrations.hub_kernels``, and nothing else."""

    NEEDLE = "because `causal_conv1d` is not installed"

    def filter(self, record: logging.LogRecord) -> bool:
        return self.NEEDLE not in record.getMessage()


def quiet_causal_conv_advice() -> None:
    """Install the filter on the logger that emits the note (at forward time; idempotent)."""
    hub_logger = logging.getLogger(HUB_KERNELS_LOGGER)
    if not any(isinstance(f, _DropCausalConvAdvice) for f in hub_logger.filters):
        hub_logger.addFilter(_DropCausalConvAdvice())

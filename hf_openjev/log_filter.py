"""The one Transformers log filter this project installs: the advice to install ``flash-linear-attention`` and
``causal_conv1d``, dropped.

Transformers wraps the Gated DeltaNet kernels of ``modeling_qwen3_5`` with
``integrations.hub_kernels.use_kernel_func_from_hub_with_fallback(...)``; when ``fla`` or ``causal_conv1d`` is
missing, the first forward logs (``logger.warning_once`` on the ``transformers.integrations.hub_kernels`` logger)
that it falls back to the PyTorch implementation and to install that package for speed. Both packages are
Triton/CUDA-only and this project never installs them: the CPU runs the reference path (the PyTorch code is the
right one there) and CUDA runs the fast path's own kernels (``torch.ops.hf_openjev.causal_conv1d_packed`` among
them). So every CPU run printed advice that must not be followed. The filter sits on that logger (the notes fire at
forward time, long after loading, so a context manager around loading would miss them) and matches those two
notes only: every other Transformers warning still shows.
"""

from __future__ import annotations

import logging

__all__ = ["quiet_kernel_install_advice"]

HUB_KERNELS_LOGGER = "transformers.integrations.hub_kernels"


class _DropKernelInstallAdvice(logging.Filter):
    """Drops the ``flash-linear-attention`` and ``causal_conv1d`` install advice, and nothing else."""

    NEEDLES = ("because `flash-linear-attention` is not installed", "because `causal_conv1d` is not installed")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(needle in message for needle in self.NEEDLES)


def quiet_kernel_install_advice() -> None:
    """Install the filter on the logger that emits the advice (idempotent: one filter however many loads)."""
    hub_logger = logging.getLogger(HUB_KERNELS_LOGGER)
    if not any(isinstance(f, _DropKernelInstallAdvice) for f in hub_logger.filters):
        hub_logger.addFilter(_DropKernelInstallAdvice())

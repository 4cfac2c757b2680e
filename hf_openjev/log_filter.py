"""The one Transformers warning this project filters: the advice to install ``flash-linear-attention``."""

from __future__ import annotations

import logging


class _DropFlashLinearAttentionAdvice(logging.Filter):
    """Drops Transformers' advice to install ``flash-linear-attention``, and nothing else."""

    NEEDLE = "because `flash-linear-attention` is not installed"

    def filter(self, record: logging.LogRecord) -> bool:
        return self.NEEDLE not in record.getMessage()


def quiet_flash_linear_attention_advice() -> None:
    """Filter the one Transformers warning that says to install ``flash-linear-attention`` (idempotent).

    Transformers wraps the Gated DeltaNet kernels of ``modeling_qwen3_5`` with
    ``integrations.hub_kernels.use_kernel_func_from_hub_with_fallback(..., "fla")``; when ``fla`` is missing, the
    first forward logs (``logger.warning_once`` on the ``transformers.integrations.hub_kernels`` logger) that it
    falls back to the PyTorch implementation and to install ``flash-linear-attention`` for speed. That package is
    Triton/CUDA-only and this project never installs it: the CPU runs the reference path (the PyTorch code is the
    right one there) and CUDA runs the fast path's own kernels. So every CPU run printed advice that must not be
    followed. The filter sits on that logger (the warning fires at forward time, long after loading, so a context
    manager around loading would miss it) and matches that message only: every other Transformers warning still
    shows (the ``causal_conv1d`` fallback note is dropped by its own filter, :mod:`hf_openjev.kernel_advice`).
    """
    hub_logger = logging.getLogger("transformers.integrations.hub_kernels")
    if not any(isinstance(f, _DropFlashLinearAttentionAdvice) for f in hub_logger.filters):
        hub_logger.addFilter(_DropFlashLinearAttentionAdvice())
    from .kernel_advice import quiet_causal_conv_advice

    quiet_causal_conv_advice()  # its own filter: the same reason (hf_openjev.kernel_advice)

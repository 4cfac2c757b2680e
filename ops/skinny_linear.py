"""A linear layer for short packs that streams its weights once: ``torch.ops.hf_openjev.skinny_linear(x, weight)
-> y``, y [M, N] = x [M, K] @ weight [N, K]^T, no bias (the fast path runs ``F.linear`` on [out, in] weights).

Not wired into the forward yet: an op a later change can switch on for levels of at most ``MAX_M`` rows, where
cuBLAS reads a 27B forward's 48.7 GB of weights at 3.5-3.8 TB/s (``recipes/results/gemm_sweep``) and the H200
streams ~4.3 TB/s.

Limits (refused with a one-line ValueError, on every device and in the fake impl): x [M, K] and weight [N, K], both
bf16 or both fp16, on one device; 0 <= M <= 256; K and N multiples of 16.

``skinny_linear_reference`` is plain torch (what the CPU runs): ``F.linear`` in fp32, rounded once to x.dtype. On
CUDA the op runs ``skinny_gemm_triton.skinny_gemm`` (a Triton kernel with fp32 accumulation, split-K summed in a
fixed order: deterministic), whose launch configuration comes from the tables of ``skinny_gemm_configs.py``;
it is graph-capturable (no host syncs). ``recipes/skinny_gemm_check.py`` times it against cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hf_openjev.ops.skinny_gemm_configs import MAX_M

_DTYPES = (torch.bfloat16, torch.float16)


def check_skinny_inputs(x: Tensor, weight: Tensor) -> None:
    """The op's limits (shapes, dtypes, devices only: runs in the fake impl too); a ValueError names the first
    one broken."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"skinny_linear: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"skinny_linear: x and weight must both be bf16 or both fp16, got {x.dtype} and "
                         f"{weight.dtype}")
    (M, K), (N, K_w) = x.shape, weight.shape
    if K != K_w:
        raise ValueError(f"skinny_linear: x has {K} input features but weight is [{N}, {K_w}]")
    if M > MAX_M:
        raise ValueError(f"skinny_linear: M={M} rows; the kernel takes at most {MAX_M} (use F.linear)")
    if K % 16 or N % 16:
        raise ValueError(f"skinny_linear: K={K} and N={N} must be multiples of 16")
    if x.device != weight.device:
        raise ValueError(f"skinny_linear: x and weight must be on one device, got {x.device} and {weight.device}")


def skinny_linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    """Plain torch: x [M, K], weight [N, K] (16-bit) -> y [M, N] in x.dtype; the products and sums in fp32,
    one rounding at the end."""
    check_skinny_inputs(x, weight)
    return F.linear(x.float(), weight.float()).to(x.dtype)


@torch.library.custom_op("hf_openjev::skinny_linear", mutates_args=())
def skinny_linear(
    x: Tensor,  # [M, K] bf16 / fp16, M <= 256
    weight: Tensor,  # [N, K], x's dtype
) -> Tensor:
    """-> y [M, N] in x.dtype. Non-CUDA devices run the reference."""
    return skinny_linear_reference(x, weight)


@skinny_linear.register_fake
def _(x, weight):
    check_skinny_inputs(x, weight)
    return x.new_empty((x.shape[0], weight.shape[0]))


@skinny_linear.register_kernel("cuda")
def _skinny_linear_cuda(x, weight):
    check_skinny_inputs(x, weight)
    from hf_openjev.ops.skinny_gemm_triton import skinny_gemm

    return skinny_gemm(x, weight)

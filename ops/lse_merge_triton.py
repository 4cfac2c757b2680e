"""Triton kernel of the log-sum-exp merge of two attention parts (CUDA only; imported lazily by
``packed_attention.merge_by_lse``).

One kernel for what ``merge_by_lse_reference`` does in ~10 ATen kernels, rounding where it rounds: libdevice
``exp`` (ATen's ``expf``), IEEE division (``div_rn``), no FMA contraction. So it equals the reference bit for bit
(tests/test_op_packed_attention.py, ``-m gpu``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice


@triton.jit
def _merge_kernel(O_OWN, LSE_OWN, O_PRE, LSE_PRE, OUT, stride_lse, n_rows, H, D, BLOCK_R: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Rows r = t * H + h of [Tq * H, D]; lse [H, Tq] at h * stride_lse + t."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = rows < n_rows
    t, h = rows // H, rows % H
    lse_own = tl.load(LSE_OWN + h * stride_lse + t, mask=in_rows, other=0.0)
    lse_pre = tl.load(LSE_PRE + h * stride_lse + t, mask=in_rows, other=0.0)
    empty = ~(tl.abs(lse_pre) < float("inf"))  # no prefix keys: FA2's lse is not finite, the part counts zero
    lse_pre = tl.where(empty, float("-inf"), lse_pre)
    top = tl.maximum(lse_own, lse_pre)
    w_own = libdevice.exp(lse_own - top)[:, None]
    w_pre = libdevice.exp(lse_pre - top)[:, None]
    cols = tl.arange(0, BLOCK_D)
    mask = in_rows[:, None] & (cols < D)[None, :]
    offsets = rows[:, None] * D + cols[None, :]
    o_own = tl.load(O_OWN + offsets, mask=mask, other=0.0).to(tl.float32)
    o_pre = tl.where(empty[:, None], 0.0, tl.load(O_PRE + offsets, mask=mask, other=0.0).to(tl.float32))
    merged = tl.math.div_rn(w_own * o_own + w_pre * o_pre, w_own + w_pre)
    tl.store(OUT + offsets, merged.to(OUT.dtype.element_ty), mask=mask)


def merge_by_lse(o_own: Tensor, lse_own: Tensor, o_pre: Tensor, lse_pre: Tensor) -> Tensor:
    """o_* [Tq, H, D] contiguous; lse_* [H, Tq] fp32 with a contiguous last dim and equal strides -> [Tq, H, D]."""
    Tq, H, D = o_own.shape
    out = torch.empty_like(o_own)
    block_d = triton.next_power_of_2(D)
    block_r = max(1, 4096 // block_d)
    _merge_kernel[(triton.cdiv(Tq * H, block_r),)](
        o_own, lse_own, o_pre, lse_pre, out, lse_own.stride(0), Tq * H, H, D, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=8 if block_r * block_d >= 4096 else 4, enable_fp_fusion=False)
    return out

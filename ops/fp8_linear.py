"""FP8 (e4m3) linear with per-token dynamic activation scales and per-output-channel weight scales:
``torch.ops.hf_openjev.fp8_linear(x, weight_fp8, weight_scale, bias=None) -> y``.

The scheme is compressed-tensors' FP8 "dynamic" one (what ``hf_openjev.fp8.quantize`` writes):

    weight:      w_fp8 [N, K] float8_e4m3fn, weight_scale [N] or [N, 1] fp32 (one scale per output channel)
    activations: quantized inside the op, one scale per row (token): s_x = max(amax(|x_row|), tiny) / 448
    y = (x_fp8 @ w_fp8^T) * s_x * s_w (+ bias), fp32 accumulation, rounded once to x.dtype

Rounding (:func:`quantize_per_token`, :func:`quantize_weight_per_channel`): ``(v / scale).clamp(-448, 448)`` in
fp32, then torch's ``.to(torch.float8_e4m3fn)`` (round to nearest even). The row maximum is clamped from below
by ``MIN_AMAX`` (448 x the smallest normal fp32), so a row of zeros gets a finite non-zero scale and quantizes to
exact zeros: padded CUDA-graph rows give zero outputs (``bias`` rows when a bias is given), never NaN. A row
holding inf or NaN is not defended against (its outputs are not finite).

``fp8_linear_reference`` is plain torch (what the CPU runs): quantize-dequantize the activation exactly as the
kernel does, dequantize the weight to fp32, matmul in fp32, add the bias in fp32, cast to x.dtype. On CUDA the op
quantizes the activation with one Triton kernel (``fp8_quant_triton.py``, bit for bit the plain code's rounding)
and runs one row-wise scaled ``torch._scaled_mm`` (Hopper, fp32 accumulation, bf16 out); it is graph-capturable
(no host syncs). Inputs the kernel does not cover (x not
bf16, K or N not a multiple of 16, no rows) run the reference on the device instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_AMAX = FP8_MAX * torch.finfo(torch.float32).tiny  # the scale of an all-zero row: tiny, finite, non-zero
_FLOAT_X = (torch.bfloat16, torch.float16, torch.float32)


def _quantize_rows(v: Tensor) -> tuple[Tensor, Tensor]:
    """v [..., K] -> (fp8 [..., K], fp32 scale [..., 1]): one scale per row, computed in fp32."""
    h = v.float()
    amax = h.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX)  # [..., 1]
    # a tensor divisor: ATen's CUDA kernel multiplies by the reciprocal of a Python-number divisor (one fp32 unit
    # off for about half the values), its CPU kernel divides; tensor / tensor divides (IEEE) on both
    scale = amax / torch.full_like(amax, FP8_MAX)
    return (h / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token quantization: x [..., K] (any float dtype) -> (x_fp8 [..., K], scale [..., 1] fp32).

    ``x ~= x_fp8.float() * scale``; a row of zeros gives zeros and a finite scale."""
    if not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"quantize_per_token: x must be a float tensor [..., K], got {x.dtype} {tuple(x.shape)}")
    return _quantize_rows(x)


def quantize_weight_per_channel(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Per-output-channel quantization of a linear weight [N, K] -> (w_fp8 [N, K], scale [N, 1] fp32), the
    compressed-tensors "channel" layout (``<module>.weight``, ``<module>.weight_scale``)."""
    if not weight.is_floating_point() or weight.dim() != 2:
        raise ValueError(f"quantize_weight_per_channel: weight must be a float [N, K] tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    return _quantize_rows(weight)


def dequantize_weight(weight_fp8: Tensor, weight_scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """w_fp8 [N, K] x scale ([N] or [N, 1]) in fp32, cast to ``dtype`` (compressed-tensors' dequantization:
    ``(w.to(scale dtype) * scale).to(dtype)`` for an fp32 scale)."""
    return (weight_fp8.float() * weight_scale.float().reshape(-1, 1)).to(dtype)


def _check(x: Tensor, weight_fp8: Tensor, weight_scale: Tensor, bias: Tensor | None) -> None:
    """Validate the op's inputs (shapes, dtypes, devices only: runs in the fake impl too)."""
    if x.dtype not in _FLOAT_X or x.dim() < 1:
        raise ValueError(f"fp8_linear: x must be a bf16/fp16/fp32 tensor [..., K], got {x.dtype} {tuple(x.shape)}")
    if weight_fp8.dtype != FP8_DTYPE or weight_fp8.dim() != 2:
        raise ValueError(f"fp8_linear: weight_fp8 must be a float8_e4m3fn [N, K] tensor, got {weight_fp8.dtype} "
                         f"{tuple(weight_fp8.shape)} (quantize it with quantize_weight_per_channel)")
    N, K = weight_fp8.shape
    if x.shape[-1] != K:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} input features but weight_fp8 is [{N}, {K}]")
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) not in ((N,), (N, 1)):
        raise ValueError(f"fp8_linear: weight_scale must be fp32 [{N}] or [{N}, 1] (one scale per output channel), "
                         f"got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if bias is not None and (not bias.is_floating_point() or tuple(bias.shape) != (N,)):
        raise ValueError(f"fp8_linear: bias must be a float [{N}] tensor, got {bias.dtype} {tuple(bias.shape)}")
    devices = {t.device for t in (x, weight_fp8, weight_scale, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"fp8_linear: all inputs must be on one device, got {sorted(map(str, devices))}")


def fp8_linear_reference(x: Tensor, weight_fp8: Tensor, weight_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """Plain torch: x [..., K]; weight_fp8 [N, K] e4m3; weight_scale [N] / [N, 1] fp32; bias [N] -> y [..., N] in
    x.dtype. The activation is quantized and dequantized exactly as the kernel quantizes it; the matmul is fp32."""
    _check(x, weight_fp8, weight_scale, bias)
    N, K = weight_fp8.shape
    x_fp8, x_scale = _quantize_rows(x.reshape(-1, K))  # [M, K], [M, 1]
    y = (x_fp8.float() * x_scale) @ dequantize_weight(weight_fp8, weight_scale).t()  # [M, N] fp32
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], N).to(x.dtype)


def _kernel_covers(x: Tensor, weight_fp8: Tensor) -> bool:
    """torch._scaled_mm's row-wise CUDA path: bf16 output, K and N multiples of 16, at least one row."""
    N, K = weight_fp8.shape
    return x.dtype == torch.bfloat16 and K % 16 == 0 and N % 16 == 0 and x.numel() > 0


def fp8_linear_scaled_mm(x: Tensor, weight_fp8: Tensor, weight_scale: Tensor, bias: Tensor | None = None, *,
                         quantize=_quantize_rows) -> Tensor:
    """The kernel path: per-token quantization (``quantize``: x [M, K] -> (e4m3 [M, K], fp32 [M, 1]); the plain
    code by default, the Triton kernel on CUDA), then one row-wise scaled ``torch._scaled_mm`` (bf16 out). No host
    syncs. The bias is added to the bf16 product (a second rounding, as nn.Linear does in bf16). Callers check
    :func:`_kernel_covers` (the CUDA op does; the CPU's ``_scaled_mm`` is more lenient)."""
    N, K = weight_fp8.shape
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    x_fp8, x_scale = quantize(x2)  # [M, K], [M, 1]
    y = torch._scaled_mm(x_fp8, weight_fp8.t(), scale_a=x_scale, scale_b=weight_scale.reshape(1, N),
                         out_dtype=torch.bfloat16)  # [M, N]
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], N).to(x.dtype)


def quantize_rows_triton(x: Tensor) -> tuple[Tensor, Tensor]:
    """The CUDA quantization: ``fp8_quant_triton.quantize_rows``, one kernel equal to the plain code bit for bit.
    x [M, K] with a contiguous last dimension (rows may be strided)."""
    from hf_openjev.ops import fp8_quant_triton

    return fp8_quant_triton.quantize_rows(x, MIN_AMAX, FP8_MAX)


@torch.library.custom_op("hf_openjev::fp8_linear", mutates_args=())
def fp8_linear(
    x: Tensor,  # [..., K] bf16 / fp16 / fp32
    weight_fp8: Tensor,  # [N, K] float8_e4m3fn
    weight_scale: Tensor,  # [N] or [N, 1] fp32, one per output channel
    bias: Tensor | None = None,  # [N]
) -> Tensor:
    """-> y [..., N] in x.dtype (per-token dynamic activation scales, per-channel weight scales)."""
    return fp8_linear_reference(x, weight_fp8, weight_scale, bias)


@fp8_linear.register_fake
def _(x, weight_fp8, weight_scale, bias=None):
    _check(x, weight_fp8, weight_scale, bias)
    return x.new_empty((*x.shape[:-1], weight_fp8.shape[0]))


@fp8_linear.register_kernel("cuda")
def _fp8_linear_cuda(x, weight_fp8, weight_scale, bias=None):
    _check(x, weight_fp8, weight_scale, bias)
    if not _kernel_covers(x, weight_fp8):
        return fp8_linear_reference(x, weight_fp8, weight_scale, bias)
    return fp8_linear_scaled_mm(x, weight_fp8, weight_scale, bias, quantize=quantize_rows_triton)

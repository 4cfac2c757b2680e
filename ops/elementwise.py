"""The elementwise group: residual + zero-centred RMSNorm, gated RMSNorm, SiLU*mul, sigmoid gate, final-row head.

Each ``<op>_reference`` is the plain torch code with the exact dtype handling of the stock Qwen3.5 modules; it
is what a compiled model forward should call so that Inductor fuses it with its neighbours. The registered ops
``torch.ops.hf_openjev.<op>`` run the same plain code on every device (CPU and CUDA): per the issue, a Triton
kernel replaces it only where it measurably beats ``torch.compile`` of the plain code on the H200
(``recipes/gpu_ops_check.py`` records that comparison).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3_5RMSNorm: fp32 x * rsqrt(mean(x^2) + eps) * (1 + w), cast back to x.dtype. x [..., D]; w [D]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(normed, new_residual): new_residual = residual + x in the model dtype, normed = RMSNorm(new_residual)."""
    new_residual = residual + x
    return rms_norm_reference(new_residual, weight, eps), new_residual


def gated_rms_norm_reference(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3_5RMSNormGated: weight * norm(x).to(x.dtype) * silu(gate in fp32), cast to x.dtype. x, gate [..., D]."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


def silu_mul_reference(gate: Tensor, up: Tensor) -> Tensor:
    """The MLP activation: silu(gate) * up (model dtype)."""
    return F.silu(gate) * up


def sigmoid_gate_reference(x: Tensor, gate: Tensor) -> Tensor:
    """The attention output gate: x * sigmoid(gate) (model dtype)."""
    return x * torch.sigmoid(gate)


def final_rows_head_reference(
    hidden: Tensor, rows: Tensor, norm_weight: Tensor, eps: float, head_weight: Tensor, head_bias: Tensor
) -> Tensor:
    """hidden [T, D] (model dtype); rows [N] int64; head_weight [1, D] fp32; head_bias [1] fp32 -> scores [N] fp32.

    The final norm in model-dtype semantics (fp32 math, rounded to hidden.dtype), then cast to fp32 and the
    fp32 linear head, as the reference path does on the last row of each candidate.
    """
    h = rms_norm_reference(hidden.index_select(0, rows), norm_weight, eps)
    return F.linear(h.float(), head_weight.float(), head_bias.float()).squeeze(-1)


def _register(name: str, fn, schema_fn):
    """A custom op running ``fn`` on every device; its fake impl is ``fn`` itself (shape-only tensor code)."""
    op = torch.library.custom_op(f"hf_openjev::{name}", mutates_args=())(schema_fn)
    op.register_fake(fn)
    return op


def _add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return add_rms_norm_reference(x, residual, weight, eps)


def _gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    return gated_rms_norm_reference(x, gate, weight, eps)


def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return silu_mul_reference(gate, up)


def _sigmoid_gate(x: Tensor, gate: Tensor) -> Tensor:
    return sigmoid_gate_reference(x, gate)


def _final_rows_head(
    hidden: Tensor, rows: Tensor, norm_weight: Tensor, eps: float, head_weight: Tensor, head_bias: Tensor
) -> Tensor:
    return final_rows_head_reference(hidden, rows, norm_weight, eps, head_weight, head_bias)


add_rms_norm = _register("add_rms_norm", add_rms_norm_reference, _add_rms_norm)
gated_rms_norm = _register("gated_rms_norm", gated_rms_norm_reference, _gated_rms_norm)
silu_mul = _register("silu_mul", silu_mul_reference, _silu_mul)
sigmoid_gate = _register("sigmoid_gate", sigmoid_gate_reference, _sigmoid_gate)
final_rows_head = _register("final_rows_head", final_rows_head_reference, _final_rows_head)

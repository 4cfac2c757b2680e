"""The patched forward's elementwise work, plain or compiled by Inductor (``PatchOptions.compile_elementwise``).

The plain functions are the ``hf_openjev.ops.elementwise`` references, which repeat the stock Qwen3.5 modules'
math and dtype handling op for op (tests/test_op_elementwise.py checks them against the modules), plus the Gated
DeltaNet gate math of the stock forward. With ``compile_elementwise`` each one goes through
``torch.compile(dynamic=True, fullgraph=True)`` on CUDA, so its several kernels become one; on other devices the
plain functions run either way.

Measured on the H200 (recipes/results/h200-2026-11-29-s3), CUDA graphs on in every run:
- speed: a 3,400-token 27B forward's elementwise kernels drop from 73.6 to 19.5 ms; the 27B JevBench mean from
  109.5 ms (plain, session 2) to 93.5 ms (profile2/bench), 89.8 ms with the column-view qkv and fused q/k
  norm + RoPE (final/bench27). Those runs compiled without ``emulate_precision_casts``; its cost is not measured.
- parity: at the mid shape, the fast path against stock Transformers with fla moves from max |dp| 0.0095 (no
  flips; plain) to 0.030 (2 flips) compiled, and to 0.017 (1 flip) with ``emulate_precision_casts``, which these
  compiles now set. The rest is presumably fused kernels rounding differently from ATen's (reduction order,
  exp / rsqrt implementations); that is inferred, not isolated.
Parity is an acceptance gate, so the option is off by default: a deployment that accepts the numerics change for
the speed switches it on (``apply_patches(model, compile_elementwise=True)``).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

from hf_openjev.ops.elementwise import (
    add_rms_norm_reference,
    gated_rms_norm_reference,
    rms_norm_reference,
    sigmoid_gate_reference,
    silu_mul_reference,
)


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """The stock Gated DeltaNet gates: beta = sigmoid(b) (model dtype), g = -exp(A_log) * softplus(a + dt_bias)
    (fp32). a, b [T, Hv] -> (g [T, Hv] fp32, beta [T, Hv])."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def qk_norm_rope(query: Tensor, key: Tensor, q_weight: Tensor, k_weight: Tensor, q_eps: float, k_eps: float,
                 cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The stock attention's q/k RMSNorm then (partial) RoPE. query [T, H, D], key [T, Hkv, D], cos/sin [T, R]."""
    query, key = rms_norm_reference(query, q_weight, q_eps), rms_norm_reference(key, k_weight, k_eps)
    return qwen.apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=1)


PLAIN = SimpleNamespace(rms_norm=rms_norm_reference, add_rms_norm=add_rms_norm_reference,
                        gated_rms_norm=gated_rms_norm_reference, silu_mul=silu_mul_reference,
                        sigmoid_gate=sigmoid_gate_reference, gdn_gates=gdn_gates, qk_norm_rope=qk_norm_rope)


@functools.cache
def _compiled() -> SimpleNamespace:
    # emulate_precision_casts: round where the plain code casts to bf16, as eager does (Inductor otherwise keeps
    # such intermediates in fp32, which moved mid-shape parity against stock from 0.0095 to 0.030)
    options = {"emulate_precision_casts": True}
    return SimpleNamespace(**{name: torch.compile(fn, dynamic=True, fullgraph=True, options=options)
                              for name, fn in vars(PLAIN).items()})


def elementwise_functions(compiled: bool, device: torch.device) -> SimpleNamespace:
    """The functions a packed forward calls: compiled ones only when asked for and on CUDA."""
    return _compiled() if compiled and device.type == "cuda" else PLAIN

"""The patched forward's elementwise work, plain or compiled by Inductor (``PatchOptions.compile_elementwise``).

The plain functions are the ``hf_openjev.ops.elementwise`` references, which repeat the stock Qwen3.5 modules'
math and dtype handling op for op (tests/test_op_elementwise.py checks them against the modules), plus the Gated
DeltaNet gate math of the stock forward. With ``compile_elementwise`` each one goes through
``torch.compile(dynamic=True, fullgraph=True)`` on CUDA, so its several kernels become one; on other devices the
plain functions run either way.

Why (on by default): the H200 micro-benchmark (recipes/results/h200-2026-11-29-s2/check/opsbench) measured the
compiled plain code 8-15x faster than eager for the norms at >= 936 tokens; inside the 27B model
(recipes/results/h200-2026-11-29-s3/profile2) it cut the elementwise kernels of a 3,400-token forward from 73.6 to
19.5 ms and the JevBench mean from 109.5 to 93.5 ms, with CUDA graphs on in both. On other devices, or with
``compile_elementwise=False``, the plain functions run.
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

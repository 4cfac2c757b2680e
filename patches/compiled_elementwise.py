"""The patched forward's elementwise work: Triton kernels, plain torch, or plain torch compiled by Inductor.

Three sets of the same functions (norms, gated norm, q/k norm + RoPE, SiLU-mul, sigmoid gate, Gated DeltaNet
gates, the Gated DeltaNet's SiLU + q/k/v split), chosen per pack by ``elementwise_functions``:

- ``FUSED`` (``FastPathOptions.fused_elementwise``, the default): the ``torch.ops.hf_openjev`` ops. On CUDA each is
  one hand-written Triton kernel that rounds where the plain code rounds (``hf_openjev/ops/elementwise_triton.py``)
  and reads the stacked projections' column views in place; on the CPU the ops run the plain code.
- ``PLAIN``: the ``hf_openjev.ops.elementwise`` references, which repeat the stock Qwen3.5 modules' math and
  dtype handling op for op (tests/test_op_elementwise.py checks them against the modules); several ATen kernels
  per function.
- compiled (``FastPathOptions.compile_elementwise``, CUDA only, wins over ``fused_elementwise``): ``PLAIN`` through
  ``torch.compile(dynamic=True, fullgraph=True)`` with ``emulate_precision_casts``.

With CUDA graphs, compiled is faster than plain on the 27B JevBench workload, but it moves mid-shape parity
against stock Transformers with fla further than plain does (a decision flip included), hence opt-in. The Triton
set runs far fewer kernels per forward than plain and is faster still; its kernels equal the plain code bit for
bit (the norms sum in ATen's order), so the default fast path keeps the plain code's parity. Figures:
recipes/RESULTS.md.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

import hf_openjev.ops  # noqa: F401 - registers torch.ops.hf_openjev.*
from hf_openjev.ops import elementwise as ops

NAMES = ("rms_norm", "add_rms_norm", "gated_rms_norm", "silu_mul", "sigmoid_gate", "gdn_gates", "qk_norm_rope",
         "silu_qkv")
PLAIN = SimpleNamespace(**{name: getattr(ops, f"{name}_reference") for name in NAMES})
FUSED = SimpleNamespace(**{name: getattr(torch.ops.hf_openjev, name) for name in NAMES})


@functools.cache
def _compiled() -> SimpleNamespace:
    # emulate_precision_casts: round where the plain code casts to bf16, as eager does (Inductor otherwise keeps
    # such intermediates in fp32, which moved mid-shape parity against stock from 0.0095 to 0.030)
    options = {"emulate_precision_casts": True}
    return SimpleNamespace(**{name: torch.compile(fn, dynamic=True, fullgraph=True, options=options)
                              for name, fn in vars(PLAIN).items()})


def elementwise_functions(compiled: bool, device: torch.device, *, fused: bool = False) -> SimpleNamespace:
    """The functions a packed forward calls: compiled ones when asked for and on CUDA, else the ops (Triton
    kernels on CUDA) when ``fused``, else the plain code."""
    if compiled and device.type == "cuda":
        return _compiled()
    return FUSED if fused else PLAIN

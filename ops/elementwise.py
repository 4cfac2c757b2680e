"""The elementwise group: (residual +) zero-centred RMSNorm, gated RMSNorm, q/k norm + RoPE, SiLU*mul, sigmoid
gate, Gated DeltaNet gates, the Gated DeltaNet's SiLU + q/k/v split.

Each ``<op>_reference`` is the plain torch code with the exact dtype handling of the stock Qwen3.5 modules; it
is what a compiled model forward calls so that Inductor fuses it with its neighbours. The registered ops
``torch.ops.hf_openjev.<op>`` run the reference on the CPU. On CUDA, each runs one Triton kernel
(``elementwise_triton.py``) that rounds where the reference rounds and reads row-strided views in place; inputs
it does not cover (mixed dtypes other than ``add_rms_norm``'s fp32 residual, a strided last dimension) fall
back to the reference.
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
    """(normed, new_residual): new_residual = residual + x in the residual's dtype (the model's, or fp32: the fast
    path's ``residual_fp32``), normed = RMSNorm(new_residual) in x's dtype."""
    new_residual = residual + x
    return rms_norm_reference(new_residual, weight, eps).to(x.dtype), new_residual


def gated_rms_norm_reference(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3_5RMSNormGated: weight * norm(x).to(x.dtype) * silu(gate in fp32), cast to x.dtype. x, gate [..., D]."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


def qk_norm_rope_reference(query: Tensor, key: Tensor, q_weight: Tensor, k_weight: Tensor, q_eps: float,
                           k_eps: float, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The stock attention's q/k RMSNorm, then transformers' own (partial) RoPE on the first R dims.
    query [T, H, D], key [T, Hkv, D], cos/sin [T, R] -> new [T, H, D], [T, Hkv, D]."""
    # imported here, not at module level: the stock module imports fla when it is installed (hf_openjev.ops never)
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    query, key = rms_norm_reference(query, q_weight, q_eps), rms_norm_reference(key, k_weight, k_eps)
    return apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=1)


def gdn_gates_reference(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """The stock Gated DeltaNet gates: g = -exp(A_log) * softplus(a + dt_bias) (fp32), beta = sigmoid(b) (b's
    dtype). a, b [T, Hv] -> (g [T, Hv] fp32, beta [T, Hv])."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def silu_qkv_reference(mixed: Tensor, key_dim: int, value_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The Gated DeltaNet's activation after its conv: SiLU(mixed) in the model dtype, split into contiguous
    q [T, key_dim], k [T, key_dim], v [T, value_dim] (fla's kernels read contiguous tensors; views would be copied
    there). mixed [T, 2 * key_dim + value_dim]."""
    parts = F.silu(mixed).split([key_dim, key_dim, value_dim], dim=-1)
    return tuple(part.clone(memory_format=torch.contiguous_format) for part in parts)


def silu_mul_reference(gate: Tensor, up: Tensor) -> Tensor:
    """The MLP activation: silu(gate) * up (model dtype)."""
    return F.silu(gate) * up


def sigmoid_gate_reference(x: Tensor, gate: Tensor) -> Tensor:
    """The attention output gate: x * sigmoid(gate) (model dtype)."""
    return x * torch.sigmoid(gate)


def _register(name: str, fn, cuda_fn=None):
    """The custom op ``hf_openjev::<name>``: ``fn`` (the reference, whose annotations give the schema) on every
    device, ``cuda_fn`` instead on CUDA when given; the fake impl is ``fn`` itself (shape-only tensor code)."""
    op = torch.library.custom_op(f"hf_openjev::{name}", fn, mutates_args=())
    op.register_fake(fn)
    if cuda_fn is not None:
        op.register_kernel("cuda")(cuda_fn)
    return op


def _kernel_can_read(*tensors: Tensor) -> bool:
    """The Triton kernels address with int32 offsets along rows of a contiguous last dimension."""
    return all(t.stride(-1) == 1 and sum((n - 1) * st for n, st in zip(t.shape, t.stride())) < 2**31 - 1
               for t in tensors)


def _same_dtype(*tensors: Tensor) -> bool:
    return len({t.dtype for t in tensors}) == 1


def _triton():
    from hf_openjev.ops import elementwise_triton

    return elementwise_triton


def _rms_norm_cuda(x, weight, eps):
    if x.dim() not in (2, 3) or not _kernel_can_read(x, weight):
        return rms_norm_reference(x, weight, eps)
    return _triton().rms_norm(x, weight, eps)[0]


def _add_rms_norm_cuda(x, residual, weight, eps):
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype not in (x.dtype, torch.float32) \
            or not _kernel_can_read(x, residual, weight):
        return add_rms_norm_reference(x, residual, weight, eps)
    return _triton().rms_norm(x, weight, eps, residual=residual)


def _gated_rms_norm_cuda(x, gate, weight, eps):
    if x.dim() not in (2, 3) or gate.shape != x.shape or not _same_dtype(x, gate, weight) \
            or not _kernel_can_read(x, gate, weight):
        return gated_rms_norm_reference(x, gate, weight, eps)
    return _triton().gated_rms_norm(x, gate, weight, eps)


def _qk_norm_rope_cuda(query, key, q_weight, k_weight, q_eps, k_eps, cos, sin):
    ok = (query.dim() == 3 and key.dim() == 3 and cos.dim() == 2 and cos.shape == sin.shape
          and cos.shape[0] == query.shape[0] == key.shape[0] and cos.shape[1] % 2 == 0
          and cos.shape[1] <= query.shape[-1] and _same_dtype(query, key, cos, sin)
          and _kernel_can_read(query, key, cos, sin, q_weight, k_weight) and cos.stride(0) == sin.stride(0))
    if not ok:
        return qk_norm_rope_reference(query, key, q_weight, k_weight, q_eps, k_eps, cos, sin)
    triton_ops = _triton()
    return triton_ops.norm_rope(query, q_weight, q_eps, cos, sin), triton_ops.norm_rope(key, k_weight, k_eps, cos, sin)


def _silu_mul_cuda(gate, up):
    if gate.dim() != 2 or gate.shape != up.shape or not _same_dtype(gate, up) or not _kernel_can_read(gate, up):
        return silu_mul_reference(gate, up)
    return _triton().silu_mul(gate, up)


def _silu_qkv_cuda(mixed, key_dim, value_dim):
    if mixed.dim() != 2 or mixed.shape[1] != 2 * key_dim + value_dim or not _kernel_can_read(mixed):
        return silu_qkv_reference(mixed, key_dim, value_dim)
    return _triton().silu_qkv(mixed, key_dim, value_dim)


def _sigmoid_gate_cuda(x, gate):
    if x.dim() not in (2, 3) or gate.shape != x.shape or not _same_dtype(x, gate) or not _kernel_can_read(x, gate):
        return sigmoid_gate_reference(x, gate)
    return _triton().sigmoid_gate(x, gate)


def _gdn_gates_cuda(a, b, A_log, dt_bias):
    if a.dim() != 2 or b.shape != a.shape or not _kernel_can_read(a, b, A_log, dt_bias):
        return gdn_gates_reference(a, b, A_log, dt_bias)
    return _triton().gdn_gates(a, b, A_log, dt_bias)


rms_norm = _register("rms_norm", rms_norm_reference, _rms_norm_cuda)
add_rms_norm = _register("add_rms_norm", add_rms_norm_reference, _add_rms_norm_cuda)
gated_rms_norm = _register("gated_rms_norm", gated_rms_norm_reference, _gated_rms_norm_cuda)
qk_norm_rope = _register("qk_norm_rope", qk_norm_rope_reference, _qk_norm_rope_cuda)
gdn_gates = _register("gdn_gates", gdn_gates_reference, _gdn_gates_cuda)
silu_mul = _register("silu_mul", silu_mul_reference, _silu_mul_cuda)
silu_qkv = _register("silu_qkv", silu_qkv_reference, _silu_qkv_cuda)
sigmoid_gate = _register("sigmoid_gate", sigmoid_gate_reference, _sigmoid_gate_cuda)

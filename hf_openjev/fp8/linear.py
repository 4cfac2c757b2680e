"""``Fp8Linear``: an ``nn.Linear`` stand-in whose forward is ``torch.ops.hf_openjev.fp8_linear``.

It holds the compressed-tensors FP8 layout of one projection as buffers (``weight`` e4m3 [N, K], ``weight_scale``
fp32 [N, 1], optional ``bias`` [N]), so its ``state_dict`` names are an FP8 export's. The activations are quantized
per token inside the op (``hf_openjev.ops.fp8_linear``); a row of zeros (a padded CUDA-graph row) gives zeros.

A dtype cast of the model (``model.to(torch.float32)``, ``.half()``) moves the buffers but keeps the weight e4m3
and its scales fp32 (the bias follows the cast): casting them would silently un-quantize the layer.
"""

from __future__ import annotations

import torch
from torch import nn

import hf_openjev.ops.fp8_linear  # noqa: F401 - registers torch.ops.hf_openjev.fp8_linear
from hf_openjev.ops.fp8_linear import FP8_DTYPE, quantize_weight_per_channel

_CHUNK_BYTES = 64 * 1024**2  # fp32 work per block of rows while quantizing one weight


class Fp8Linear(nn.Module):
    """y [..., N] = fp8_linear(x [..., K], weight [N, K] e4m3, weight_scale [N, 1] fp32, bias [N] | None)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"Fp8Linear: weight must be a float8_e4m3fn [N, K] tensor, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        n = weight.shape[0]
        if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) not in ((n,), (n, 1)):
            raise ValueError(f"Fp8Linear: weight_scale must be fp32 [{n}, 1], got {weight_scale.dtype} "
                             f"{tuple(weight_scale.shape)}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.reshape(n, 1))
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.hf_openjev.fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def _apply(self, fn, recurse=True):
        for name in ("weight", "weight_scale"):  # moved, never cast: a cast would undo the quantization
            tensor = self._buffers[name]
            moved = fn(tensor)
            self._buffers[name] = moved if moved.dtype == tensor.dtype else tensor.to(moved.device)
        if self._buffers["bias"] is not None:
            self._buffers["bias"] = fn(self._buffers["bias"])
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                "e4m3 weight with per-channel scales, per-token activation scales")


@torch.no_grad()
def quantize_linear(linear: nn.Linear) -> Fp8Linear:
    """An ``Fp8Linear`` from ``linear``'s weight [N, K] (per-channel, in blocks of rows: the same bits as
    :func:`hf_openjev.ops.fp8_linear.quantize_weight_per_channel` on the whole weight, and as ``quantize_export``),
    on the weight's device. ``linear`` is left as it was."""
    w = linear.weight.detach()  # [N, K]
    n, k = w.shape
    weight = torch.empty((n, k), dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=w.device)
    step = max(1, _CHUNK_BYTES // (4 * k))
    for start in range(0, n, step):
        stop = min(n, start + step)
        weight[start:stop], scale[start:stop] = quantize_weight_per_channel(w[start:stop])
    bias = linear.bias.detach().clone() if linear.bias is not None else None
    return Fp8Linear(weight, scale, bias)

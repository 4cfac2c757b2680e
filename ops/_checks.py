"""Shared by the op tests and ``recipes/gpu_ops_check.py``: random packed inputs, error metrics, CUDA-graph replay.

Input builders return a dict of the op's arguments (call ``op(**args)``); tensors are random and never all
zero (states are zero only when ``state=False``, which is what "no state" means).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from hf_openjev.ops.varlen import prepare_varlen_metadata


def split_lengths(total: int, n: int, rng: random.Random) -> list[int]:
    """n positive lengths summing to total (n <= total)."""
    cuts = sorted(rng.sample(range(1, total), n - 1)) if n > 1 else []
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def cu(lengths: Sequence[int], device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _randn(gen, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def gdn_inputs(lengths, hk, hv, dk, dv, dtype=torch.float32, device="cpu", state=True, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    meta = prepare_varlen_metadata(cu(lengths).tolist(), device=device)
    decay_rate = torch.exp(torch.randn(hv, generator=gen) - 1.0)  # per-head decay speed, like exp(A_log)
    h0 = _randn(gen, N, hv, dk, dv, device=device, scale=0.5)
    return dict(
        q=_randn(gen, T, hk, dk, dtype=dtype, device=device),
        k=_randn(gen, T, hk, dk, dtype=dtype, device=device),
        v=_randn(gen, T, hv, dv, dtype=dtype, device=device),
        g=(-F.softplus(torch.randn(T, hv, generator=gen)) * decay_rate).to(device),  # fp32 log decay < 0
        beta=torch.sigmoid(torch.randn(T, hv, generator=gen)).to(device=device, dtype=dtype),
        cu_seqlens=meta.cu_seqlens,
        initial_state=h0 if state else torch.zeros_like(h0),
        chunk_indices=meta.chunk_indices,
    )


def conv_inputs(lengths, channels, kernel=4, dtype=torch.float32, device="cpu", state=True, seed=0, fla=True) -> dict:
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    meta = prepare_varlen_metadata(cu(lengths).tolist(), device=device)
    s0 = _randn(gen, N, channels, kernel, dtype=dtype, device=device)
    return dict(
        x=_randn(gen, T, channels, dtype=dtype, device=device),
        weight=_randn(gen, channels, kernel, dtype=dtype, device=device, scale=0.5),
        cu_seqlens=meta.cu_seqlens,
        initial_state=s0 if state else torch.zeros_like(s0),
        chunk_indices=meta.chunk_indices if fla else None,
    )


def attention_inputs(lengths_q, lengths_k, h, hkv, d, dtype=torch.float32, device="cpu", seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=_randn(gen, sum(lengths_q), h, d, dtype=dtype, device=device),
        k=_randn(gen, sum(lengths_k), hkv, d, dtype=dtype, device=device),
        v=_randn(gen, sum(lengths_k), hkv, d, dtype=dtype, device=device),
        cu_seqlens_q=cu(lengths_q, device),
        cu_seqlens_k=cu(lengths_k, device),
        max_seqlen_q=max(lengths_q),
        max_seqlen_k=max(lengths_k),
        scale=d**-0.5,
    )


def prefix_inputs(lengths, block_lengths, block_of_sequence, h, hkv, d, dtype=torch.float32, device="cpu", seed=0):
    """Prefix attention inputs: sequence i reads prefix block ``block_of_sequence[i]`` (blocks packed in order)."""
    gen = torch.Generator().manual_seed(seed)
    T, P = sum(lengths), sum(block_lengths)
    block_starts = cu(block_lengths, "cpu").tolist()
    starts = [block_starts[j] for j in block_of_sequence]
    return dict(
        q=_randn(gen, T, h, d, dtype=dtype, device=device),
        k=_randn(gen, T, hkv, d, dtype=dtype, device=device),
        v=_randn(gen, T, hkv, d, dtype=dtype, device=device),
        cu_seqlens=cu(lengths, device),
        prefix_k=_randn(gen, P, hkv, d, dtype=dtype, device=device),
        prefix_v=_randn(gen, P, hkv, d, dtype=dtype, device=device),
        prefix_starts=torch.tensor(starts + [P], dtype=torch.int32, device=device),
        prefix_lengths=torch.tensor([block_lengths[j] for j in block_of_sequence], dtype=torch.int32, device=device),
        scale=d**-0.5,
        max_seqlen_q=max(lengths),
        max_seqlen_prefix=max(max(block_lengths), 1),
    )


def to_device(args: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def max_errors(out, ref) -> tuple[float, float]:
    """(max abs error, max abs error / max |ref|) over a tensor or a tuple of tensors (fp32 math)."""
    outs, refs = (out, ref) if isinstance(out, (tuple, list)) else ((out,), (ref,))
    abs_err, rel_err = 0.0, 0.0
    for o, r in zip(outs, refs):
        e = (o.float().cpu() - r.float().cpu()).abs().max().item() if r.numel() else 0.0
        scale = r.float().abs().max().item() if r.numel() else 1.0
        abs_err, rel_err = max(abs_err, e), max(rel_err, e / max(scale, 1e-30))
    return abs_err, rel_err


def capture_replay(fn: Callable, args_a: dict, args_b: dict, warmup: int = 2):
    """Capture ``fn(**static)`` with static buffers holding args_a, copy args_b in, replay.

    Returns (replayed outputs, eager ``fn(**args_b)``); they must agree. Non-tensor args must be equal in a
    and b; tensors must have equal shapes (e.g. a permutation of the same sequence lengths).
    """
    static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args_a.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up / autotune outside the capture
        for _ in range(warmup):
            fn(**static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(**static)
    for key, value in args_b.items():
        if isinstance(value, torch.Tensor):
            static[key].copy_(value)
        elif value != static[key]:
            raise ValueError(f"capture_replay: non-tensor argument {key} differs ({static[key]} vs {value})")
    graph.replay()
    torch.cuda.synchronize()
    return out, fn(**args_b)

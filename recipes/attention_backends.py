"""Causal attention at the 27B shape (24 query heads, 4 KV heads, head dim 256): torch's kernels side by side.

    python recipes/attention_backends.py --out results/attention             # CUDA
    python recipes/attention_backends.py --lengths 3400 --sequences 1,8 --out /tmp/attn

For each total length T and number of packed sequences n (T split evenly, cumulative lengths as the fast path
passes them), times the packed causal attention of one layer through:

- ``flash2 varlen``: ``aten._flash_attention_forward`` with cu_seqlens (what ``packed_attention`` calls today);
- ``cudnn varlen``: ``aten._cudnn_attention_forward`` with cumulative lengths (the ragged layout), K/V with 4 heads
  and, if cuDNN refuses that, with K/V repeated to 24 heads (the repeat's time included and labelled);
- ``cudnn sdpa`` / ``flash sdpa`` / ``efficient sdpa``: ``F.scaled_dot_product_attention`` on the padded
  ``[n, H, T/n, D]`` layout under one backend each, ``enable_gqa=True``.

Each output is compared with an fp32 reference (``math`` on fp32 copies of the same inputs): max |diff| and, against
flash2's own distance, whether the backend is as close. Backends that fail report their error instead of a time.
Times: the fastest of ``--repeats`` runs, events around each, after two warm-ups.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from benchlib.provenance import command_line, versions
from benchlib.tables import save_table
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256  # 27B full attention (docs/checkpoints.md)


def timed(fn, *, repeats: int) -> tuple[float, torch.Tensor]:
    """(fastest milliseconds, output) of ``fn()``; CUDA events around each run."""
    out = fn()
    fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best, out


def backends(q, k, v, cu, max_len: int, scale: float) -> dict:
    """name -> zero-argument callable returning [T, H, D]; q [T, H, D], k/v [T, Hkv, D], cu [n+1] int32."""
    n = cu.numel() - 1
    per = max_len

    def padded(x):  # equal lengths: [T, h, D] -> [n, h, T/n, D]
        return x.reshape(n, per, x.shape[1], x.shape[2]).transpose(1, 2)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True, scale=scale,
                                                     enable_gqa=True)
            return out.transpose(1, 2).reshape(q.shape)
        return run

    group = HEADS // KV_HEADS
    return {
        "flash2 varlen": lambda: torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)[0],
        "cudnn varlen": lambda: torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale)[0],
        "cudnn varlen, K/V repeated": lambda: torch.ops.aten._cudnn_attention_forward(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), None, cu, cu, max_len, max_len, True,
            0.0, True, False, scale=scale)[0],
        "cudnn sdpa": sdpa(SDPBackend.CUDNN_ATTENTION),
        "flash sdpa": sdpa(SDPBackend.FLASH_ATTENTION),
        "efficient sdpa": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }


def reference(q, k, v, n: int, scale: float) -> torch.Tensor:
    """fp32 math attention per sequence: [T, H, D]."""
    per = q.shape[0] // n
    group = HEADS // KV_HEADS
    qf, kf, vf = (x.float().reshape(n, per, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(q.shape)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512,1024,2048,3400,4096", help="total tokens T")
    parser.add_argument("--sequences", default="1,8", help="packed sequences n (T rounded down to a multiple)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    device = torch.device("cuda")
    scale = HEAD_DIM ** -0.5
    result = {"command": command_line(), "versions": versions(),
              "cudnn": torch.backends.cudnn.version(), "runs": []}
    rows = []
    for total in [int(x) for x in args.lengths.split(",") if x]:
        for n in [int(x) for x in args.sequences.split(",") if x]:
            per = total // n
            if per < 1:
                continue
            tokens = per * n
            gen = torch.Generator(device=device).manual_seed(tokens * 31 + n)
            q, k, v = (torch.randn(tokens, h, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
                       for h in (HEADS, KV_HEADS, KV_HEADS))
            cu = torch.arange(0, tokens + 1, per, device=device, dtype=torch.int32)
            ref = reference(q, k, v, n, scale)
            for name, fn in backends(q, k, v, cu, per, scale).items():
                entry = {"tokens": tokens, "sequences": n, "backend": name}
                try:
                    ms, out = timed(fn, repeats=args.repeats)
                    entry.update(ms=ms, max_abs_diff=(out.float() - ref).abs().max().item(),
                                 tflops=4 * n * per * per / 2 * HEADS * HEAD_DIM / ms / 1e9)
                except Exception as error:  # noqa: BLE001 - a refusing backend is a result
                    entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                result["runs"].append(entry)
                rows.append([tokens, n, name, f"{entry['ms']:.3f}" if "ms" in entry else "-",
                             f"{entry['tflops']:.0f}" if "ms" in entry else "-",
                             f"{entry['max_abs_diff']:.2e}" if "ms" in entry else entry["error"]])
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
            torch.cuda.empty_cache()
            time.sleep(0.05)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_table(out, "attention_backends", result, "Causal attention, 27B shape (24/4 heads, dim 256), one layer",
               ["tokens", "sequences", "backend", "ms", "TFLOP/s (causal)", "max abs diff vs fp32 / error"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

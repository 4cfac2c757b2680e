"""Which packed (varlen) attention kernel rounds as the 2B's default does, one dense call per sequence (issue 39).

    python recipes/varlen_attention_probe.py --shape 2b --out results/varlen_attention

The 2B's default scores every candidate alone with one dense causal attention call (cuDNN through SDPA): it passes the
fidelity gate on three sets of weights where the packed path, whose attention is FA2's varlen kernel, fails on two
(recipes/RESULTS.md, s19-s20: the layers before the first attention layer are bit-identical to stock's, the packed
path departs at that layer). Packing the candidates again would take back most of the 2.8x it costs, if a varlen
kernel rounds per sequence as the dense call does. This probe answers that on random bf16 inputs at the shape's
attention heads, per level of packed sequences ([T, H, D] rows, GQA), for each kernel:

- ``dense``: ``hf_openjev.ops.causal_attention`` per sequence (the 2B default's kernel; the yardstick);
- ``fa2_varlen``: ``hf_openjev.ops.packed_attention`` (FA2 varlen, the packed path's);
- ``efficient_varlen``: the same op with ``kernel_name="efficient"`` (``aten._efficient_attention_forward``, varlen);
- ``stock``: what stock Transformers' SDPA does in B, a right-padded batch [N, H, L, D] with a boolean mask
  (torch picks the kernel), rows taken back out.

cuDNN's ragged path (``aten._cudnn_attention_forward`` with cumulative lengths) is not here: it answers eagerly but
invalidates a CUDA-graph capture (torch 2.11 on an H100, RESULTS.md s22). Every kernel here takes its sequence
bounds from ``lengths`` on the host, so each is captured and timed the same way.

Per kernel and level: the share of output elements bit-equal to ``dense``'s, the largest difference to ``dense``, to
``stock`` and to the fp32 reference (``packed_attention_reference`` in fp32), and the graph-replayed time (median
us). A kernel the device refuses is reported with its error. On a CPU only ``dense`` and ``fa2_varlen`` run (their
plain-torch references): a smoke run. Writes ``varlen_attention_<shape>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from benchlib.provenance import command_line, versions
from benchlib.shapes import SHAPES
from benchlib.timing import graph_of, median_ms

import hf_openjev.ops  # noqa: F401  (registers torch.ops.hf_openjev.*)
from hf_openjev.ops.packed_attention import packed_attention_reference

# levels of packed sequences: one candidate, several short ones, many short ones, a few long ones, odd lengths
LEVELS = ((107,), (40,) * 5, (60,) * 6, (64,) * 16, (37, 91, 64, 120, 15), (300, 200, 150), (1000, 900, 800))
CUDA_ONLY = ("efficient_varlen", "stock")


def repeat_heads(x, heads: int):
    """[T, Hkv, D] -> [T, heads, D] (query head h reads kv head h // (heads // Hkv))."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def bounds(lengths) -> list[tuple[int, int]]:
    """Each sequence's (start, end) rows, from the host's lengths (no device read: capturable)."""
    return [(end - length, end) for end, length in zip(itertools.accumulate(lengths), lengths)]


def dense(q, k, v, cu, lengths, scale):
    return torch.cat([torch.ops.hf_openjev.causal_attention(q[a:b], k[a:b], v[a:b], scale) for a, b in bounds(lengths)])


def varlen(kernel: str):
    """``hf_openjev.ops.packed_attention`` with ``kernel`` (FastPathOptions.packed_attention)."""
    def attend(q, k, v, cu, lengths, scale):
        return torch.ops.hf_openjev.packed_attention(q, k, v, cu, cu, max(lengths), max(lengths), scale, kernel)
    return attend


fa2_varlen = varlen("flash")


def stock(q, k, v, cu, lengths, scale):
    """B's way: right-padded [N, H, L, D] batch, a boolean causal + padding mask, SDPA's own kernel choice."""
    n, top, heads = len(lengths), max(lengths), q.shape[1]
    rows = bounds(lengths)

    def padded(x):
        out = x.new_zeros((n, top, heads, x.shape[-1]))
        for i, (start, end) in enumerate(rows):
            out[i, :end - start] = x[start:end]
        return out.transpose(1, 2)  # [N, H, L, D]

    qp, kp, vp = padded(q), padded(repeat_heads(k, heads)), padded(repeat_heads(v, heads))
    valid = torch.zeros(n, top, dtype=torch.bool, device=q.device)  # [N, L]
    for i, length in enumerate(lengths):
        valid[i, :length] = True
    mask = torch.ones(top, top, dtype=torch.bool, device=q.device).tril()[None] & valid[:, None, :]  # [N, Lq, Lk]
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask[:, None], scale=scale).transpose(1, 2)
    return torch.cat([out[i, :length] for i, length in enumerate(lengths)])


KERNELS = {"dense": dense, "fa2_varlen": fa2_varlen, "efficient_varlen": varlen("efficient"), "stock": stock}


def level_inputs(lengths, heads: int, kv_heads: int, head_dim: int, device, seed: int):
    """Random bf16 q [T, H, D], k, v [T, Hkv, D] (scaled as a trained model's: logits of a few units) and cu [N+1]."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn((total, h, head_dim), generator=g) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return [x.to(device) for x in (q.bfloat16(), k.bfloat16(), v.bfloat16(), cu)]


def probe_level(lengths, shape: dict, device, seed: int) -> dict:
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    q, k, v, cu = level_inputs(lengths, heads, kv_heads, head_dim, device, seed)
    scale = head_dim ** -0.5
    fp32 = packed_attention_reference(q.float(), k.float(), v.float(), cu, cu, scale=scale)
    outputs, row = {}, {"lengths": list(lengths), "tokens": sum(lengths), "kernels": {}}
    for name, kernel in KERNELS.items():
        if name in CUDA_ONLY and device.type != "cuda":
            continue
        try:
            outputs[name] = kernel(q, k, v, cu, lengths, scale)
            if device.type == "cuda":
                graph = graph_of(lambda: kernel(q, k, v, cu, lengths, scale), {})
                row["kernels"][name] = {"us": round(median_ms(graph.replay, 50) * 1000, 2)}  # graph-replayed
            else:
                row["kernels"][name] = {}
        except Exception as error:  # noqa: BLE001 - a refused kernel is a finding, reported as such
            row["kernels"][name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    for name, out in outputs.items():
        entry = row["kernels"][name]
        entry["equal_to_dense"] = round((out == outputs["dense"]).float().mean().item(), 6)
        entry["max_diff_dense"] = (out.float() - outputs["dense"].float()).abs().max().item()
        if "stock" in outputs:
            entry["max_diff_stock"] = (out.float() - outputs["stock"].float()).abs().max().item()
        entry["max_diff_fp32"] = (out.float() - fp32).abs().max().item()
    return row


def write_report(out: Path, shape_name: str, result: dict) -> None:
    (out / f"varlen_attention_{shape_name}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Packed attention kernels against one dense call per sequence, {shape_name}", "",
             f"`{result['command']}`, {result['device']}", "",
             "| level (lengths) | kernel | bit-equal to dense | max diff to dense | to stock | to fp32 | us |",
             "|---|---|---|---|---|---|---|"]
    for row in result["levels"]:
        label = ", ".join(map(str, row["lengths"])) if len(set(row["lengths"])) > 1 else \
            f"{len(row['lengths'])} x {row['lengths'][0]}"
        for name, e in row["kernels"].items():
            if "error" in e:
                lines.append(f"| {label} | {name} | {e['error']} | | | | |")
                continue
            figures = [f"{e['equal_to_dense']:.4f}", f"{e['max_diff_dense']:.3g}", f"{e.get('max_diff_stock', 0):.3g}"
                       if "max_diff_stock" in e else "", f"{e['max_diff_fp32']:.3g}", f"{e.get('us', '')}"]
            lines.append(f"| {label} | {name} | " + " | ".join(figures) + " |")
    (out / f"varlen_attention_{shape_name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2b", choices=sorted(SHAPES))
    parser.add_argument("--levels", type=int, default=len(LEVELS), help=f"the first N levels (of {len(LEVELS)})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"command": command_line(), "versions": versions(), "shape": args.shape,
              "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "levels": []}
    for index, lengths in enumerate(LEVELS[: args.levels]):
        result["levels"].append(probe_level(lengths, SHAPES[args.shape], device, args.seed + index))
    write_report(args.out, args.shape, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

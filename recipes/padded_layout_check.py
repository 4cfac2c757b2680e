"""Do the kernels of a packed forward give the same rows when the layout is padded to upper bounds? (issue 39)

    python recipes/padded_layout_check.py --out results/padded_layout             # a GPU
    TRITON_INTERPRET=1 python recipes/padded_layout_check.py --out /tmp/padded    # a CPU with fla: the GDN part only

(Triton 3.6's interpreter runs fla 0.6's GDN kernels only with two local fixes to those packages, recipes/RESULTS.md
s31; the autotuner, which has nothing to time there, takes its first configuration.)

The 27B's warm-up records 120 CUDA graphs, most of them told apart by their layout alone (recipes/RESULTS.md s30:
69 would remain if each graph read its whole layout from padded device buffers). That design needs every kernel of a
packed forward to accept a layout padded to fixed upper bounds, and to leave the real rows unchanged:

- ``gdn``: fla's chunked Gated DeltaNet forward as ``ops/gdn_prefill.fla_chunk_forward`` calls it, with extra token
  rows after the last sequence (large values), zero-length sequences at the end of ``cu_seqlens`` and dummy rows of
  ``chunk_indices`` that point at a zero-length sequence (the grid sized by the bound, not the batch);
- ``fa2``: FA2's varlen attention (``hf_openjev.ops.packed_attention``) with zero-length padded sequences and a
  ``max_seqlen`` above the real longest (CUDA only: its CPU reference ignores both).

Each is compared with the unpadded call: the real rows' largest difference (0 means bit-equal), the padded
sequences' final states against their initial ones, and whether the padding rows stay finite. Exit 1 if a real row
differs. Under Triton's interpreter (CPU) the bf16 rounding is not the GPU's; the inputs here are fp32 for that
reason, so the GDN check there is about layout, not rounding. Writes ``padded_layout.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def varlen_layout(lengths: list[int], device: str):
    """The fast path's varlen metadata (cu_seqlens, chunk_indices, chunk_offsets, max_seqlen) of ``lengths``."""
    from hf_openjev.ops.varlen import prepare_varlen_metadata

    return prepare_varlen_metadata([0, *itertools.accumulate(lengths)], device=device)


def check_gdn(*, device: str, lengths: list[int], pad_rows: int, pad_sequences: int, dummy_chunks: int,
              seed: int = 0) -> dict:
    """fla's GDN forward, plain and padded (the bounds above), on random fp32 inputs [T, H, D]."""
    from hf_openjev.ops.gdn_prefill import fla_chunk_forward

    gen = torch.Generator().manual_seed(seed)
    heads, dim = 2, 32
    total = sum(lengths)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    q, k, v = F.normalize(rand(total, heads, dim), dim=-1), F.normalize(rand(total, heads, dim), dim=-1), rand(total, heads, dim)
    g, beta = -rand(total, heads).abs() * 0.5, torch.sigmoid(rand(total, heads))
    h0 = rand(len(lengths), heads, dim, dim)

    def run(q, k, v, g, beta, h0, cu, indices, offsets):
        o, final = fla_chunk_forward(q[None], k[None], v[None], g[None], beta[None], dim ** -0.5, h0, True, cu,
                                     indices, offsets)
        return o[0], final

    plain = varlen_layout(lengths, device)
    o, final = run(q, k, v, g, beta, h0, plain.cu_seqlens, plain.chunk_indices, plain.chunk_offsets)
    padded = varlen_layout(lengths + [0] * pad_sequences, device)
    dummy = torch.tensor([[len(lengths), 0]] * dummy_chunks, dtype=padded.chunk_indices.dtype, device=device)
    indices = torch.cat([padded.chunk_indices, dummy])  # the grid's upper bound: chunks of an empty sequence

    def pad(x, low=None, high=None):
        extra = (torch.randn(pad_rows, *x.shape[1:], generator=gen) * 1e3).to(device)
        return torch.cat([x, extra.clamp(low, high) if low is not None or high is not None else extra])

    padded_h0 = torch.cat([h0, rand(pad_sequences, heads, dim, dim)])
    o_pad, final_pad = run(pad(q), pad(k), pad(v), pad(g, high=0.0), pad(beta, 0.0, 1.0), padded_h0,
                           padded.cu_seqlens, indices, padded.chunk_offsets)
    n = len(lengths)
    return {"lengths": lengths, "pad_rows": pad_rows, "pad_sequences": pad_sequences, "dummy_chunks": dummy_chunks,
            "rows_max_diff": (o_pad[:total] - o).abs().max().item(),
            "states_max_diff": (final_pad[:n] - final).abs().max().item(),
            "padded_states_keep_their_initial": bool(torch.equal(final_pad[n:], padded_h0[n:])),
            "padding_rows_finite": bool(torch.isfinite(o_pad[total:]).all())}


def check_fa2(*, lengths: list[int], pad_rows: int, pad_sequences: int, max_seqlen: int, seed: int = 0) -> dict:
    """FA2 varlen causal attention, plain and padded, bf16 [T, H, D] with GQA (CUDA)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total, heads, kv_heads, dim = sum(lengths), 8, 2, 128

    def rand(t, h):
        return torch.randn(t, h, dim, generator=gen, device="cuda").bfloat16()

    q, k, v = rand(total, heads), rand(total, kv_heads), rand(total, kv_heads)
    cu = varlen_layout(lengths, "cuda").cu_seqlens
    o = torch.ops.hf_openjev.packed_attention(q, k, v, cu, cu, max(lengths), max(lengths), dim ** -0.5)
    padded_cu = varlen_layout(lengths + [0] * pad_sequences, "cuda").cu_seqlens
    qp, kp, vp = (torch.cat([x, rand(pad_rows, x.shape[1])]) for x in (q, k, v))
    o_pad = torch.ops.hf_openjev.packed_attention(qp, kp, vp, padded_cu, padded_cu, max_seqlen, max_seqlen,
                                                  dim ** -0.5)
    return {"lengths": lengths, "pad_rows": pad_rows, "pad_sequences": pad_sequences, "max_seqlen": max_seqlen,
            "rows_max_diff": (o_pad[:total].float() - o.float()).abs().max().item(),
            "padding_rows_finite": bool(torch.isfinite(o_pad[total:]).all())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for padded_layout.json")
    args = parser.parse_args(argv)
    import hf_openjev.ops  # noqa: F401  (registers the ops)

    if os.environ.get("TRITON_INTERPRET") == "1":  # no device to time configurations on: each gives the same rows
        import triton.runtime.autotuner as autotuner

        autotuner.Autotuner._bench = lambda self, *a, config, **k: [1.0, 1.0, 1.0]

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = [70, 1, 130, 64, 200]
    results = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (Triton's interpreter)",
               "gdn": check_gdn(device=device, lengths=lengths, pad_rows=61, pad_sequences=3, dummy_chunks=5)}
    if device == "cuda":
        results["fa2"] = check_fa2(lengths=lengths, pad_rows=61, pad_sequences=3, max_seqlen=1024)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "padded_layout.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0 if all(part["rows_max_diff"] == 0.0 for part in results.values() if isinstance(part, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Which part of the fast path moves probabilities away from stock Transformers (arm A), one switch at a time.

    python recipes/parity_ablation.py --shape mid --dtype bfloat16 --max-length 128 --out results/ablation

Runs the stock model (A, right-padded batches of 32), the stock model one candidate per batch (A1: how far
rounding alone moves p on this model), then the fast path with all patches and with each patch option switched
off or on in turn; reports max |dp| and decision flips against A for each. Graphs stay off (their effect is arm
E of bench_jevbench.py). Writes ``ablation_<shape>_<dtype>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchlib.parity import parity
from benchlib.provenance import command_line, versions
from benchlib.random_model import add_model_arguments, prepare_recipe
from benchlib.shapes import VOCAB
from benchlib.tables import save_table
from benchlib.timing import run_pass
from benchlib.workload import add_manifest_argument, build_workload, check_manifest_argument, manifest_identity

VARIANTS = {  # name -> FastPathOptions changes (cuda_graphs always off)
    "all patches": {},
    "no stacked projections": {"stacked_projections": False},
    "no shared prefixes": {"shared_prefix": False},
    "no packing (one candidate per forward)": {"packed_candidates": False},
    "no final-row MLP": {"final_row_mlp": False},
    "GDN fed fp32": {"gdn_fp32": True},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, shape="mid")
    parser.add_argument("--max-length", type=int, default=128, help="requests whose longest sequence fits")
    parser.add_argument("--limit", type=int, default=None, help="of the first N requests")
    add_manifest_argument(parser)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    args = parser.parse_args(argv)
    check_manifest_argument(parser, args)
    from hf_openjev.fast_options import FastPathOptions
    from hf_openjev.patches import apply_patches

    out, device, model = prepare_recipe(args)
    work = build_workload(args.manifest, vocab=VOCAB, seed=args.seed, limit=args.limit, max_length=args.max_length)
    result = {"command": command_line(), "versions": versions(), "shape": args.shape,
              "dtype": args.dtype, **manifest_identity(args.manifest),
              "requests": len(work), "rows": []}
    reference = [r for _, r in run_pass(model, work, fast=False)]
    stock_alone = [r for _, r in run_pass(model, work, fast=False, batch_size=1)]
    result["rows"].append({"variant": "A1: stock, one candidate per batch", **parity(reference, stock_alone)})
    for name in args.variants.split(","):
        apply_patches(model, FastPathOptions(**VARIANTS[name], cuda_graphs=False))
        fast = [r for _, r in run_pass(model, work, fast=True)]
        result["rows"].append({"variant": f"C: {name}", **parity(reference, fast)})
        print(json.dumps(result["rows"][-1]), flush=True)
    apply_patches(model)
    title = (f"Parity against stock Transformers (A), {args.shape} shape, {args.dtype}, {len(work)} requests "
             f"(longest sequence <= {args.max_length} tokens), {device}")
    print(save_table(out, f"ablation_{args.shape}_{args.dtype}", result, title,
                     ["variant", "max abs dp", "decision flips", "near-tie flips"],
                     [[r["variant"], f"{r['max_abs_dp']:.4g}", r["decision_flips"], r["near_tie_flips"]]
                      for r in result["rows"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

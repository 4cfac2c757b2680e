"""Graph buckets by the fixed token steps against buckets chosen by measured GEMM cost, on the JevBench workload (CPU).

    python recipes/bucket_report.py --out results/buckets          # the 27B shape: buckets.json and buckets.md
    python recipes/bucket_report.py --shape 9b --out results/buckets

Each request of the benchmark's workload (``--manifest``, the same token ids as ``bench_jevbench.py``) is planned
as the fast path plans it (``plan_with_options`` with the shape's own defaults, ``options_for``, the request
alone: a 2B plans every candidate alone), and each
pack the fast path would replay as a CUDA graph (``graph_ready``) is laid out padded, as ``build_pack_context``
lays it out, under each rule: the fixed token steps (``bucket_policy=None``, the fast path's default) and the shape's
measured table (``hf_openjev/packing/gemm_costs.py``) at a few windows. Per rule: the padded GEMM milliseconds of
the graphed packs on the measured curve (``BucketPolicy.cost_ms``: the time at the smallest measured row count >=
the pack's rows), the padding tokens, and the distinct graph keys (graphs a warm-up captures) and row counts. This
is a costing on the measured curve, not a GPU timing; eager packs (over ``graph_tokens``, 4,096 by default, or
handing states on) are left out, being the same under every rule.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchlib.provenance import command_line
from benchlib.shapes import VOCAB
from benchlib.workload import add_manifest_argument, build_workload, check_manifest_argument

from hf_openjev.family import member_sized
from hf_openjev.fast_options import FastPathOptions, options_for
from hf_openjev.packing.bucket_policy import BucketPolicy, table_policy
from hf_openjev.packing.gemm_costs import GEMM_COSTS
from hf_openjev.packing.layout import lay_out_template
from hf_openjev.packing.planner import plan_with_options
from hf_openjev.patches.cuda_graphs import graph_ready

WINDOWS = (64, 128, 256)
# packs over these tokens (before padding) as eager forwards instead of graphs (FastPathOptions.graph_tokens; its
# default is 4,096): the graph keys left. Measured at 27B (RESULTS.md s30): a 2,049-4,096-token pack run eagerly is
# still host-bound, so these cuts shorten a warm-up at a cost in speed
EAGER_ABOVE = (2048, 2560, 3072)


def graphed_packs(requests, options: FastPathOptions) -> list[tuple[object, object]]:
    """``(plan, pack)`` of every pack the fast path replays as a graph, request by request."""
    found = []
    for tokens in requests:
        plan = plan_with_options([tokens], options)
        found += [(plan, pack) for pack in plan.packs if graph_ready(plan, pack)]
    return found


def padded_rows(packs, buckets: BucketPolicy | None, *, dense_attention_tokens: int) -> list[tuple[int, tuple]]:
    """``(padded rows, graph key)`` of each pack, laid out as ``build_pack_context(pad=True, buckets=)`` lays it out."""
    found = []
    for plan, pack in packs:
        template = lay_out_template(plan, pack, {}, pad=True, merge_levels=True,
                                    dense_attention_tokens=dense_attention_tokens, buckets=buckets)
        found.append((sum(length for _, length in template.token_runs), template.key_tail))
    return found


def key_without_gdn_shapes(key_tail: tuple) -> tuple:
    """A graph key's tail (``naive_layout.key_graph``: final rows, levels, GDN calls) without its GDN calls' shapes:
    the graphs a warm-up would capture if every GDN call's gathered rows and chunk counts were padded to one size."""
    final_rows, levels, _calls = key_tail
    return final_rows, levels


def key_by_rows_and_level_kinds(rows: int, key_tail: tuple) -> tuple:
    """A graph key if a graph took every layout on the device (each level's tokens, sequences and chunks, the GDN
    calls' rows, the scored rows, all in padded device buffers read by kernels launched over upper bounds): the
    padded rows and each level's kind (has parents, dense attention) alone. Not built; a costing of that design."""
    _final_rows, levels, _calls = key_tail
    return rows, tuple((level[3], level[6]) for level in levels)  # naive_layout.key_graph: has_parents, dense


def cost_rule(packs, laid_out, before, curve: BucketPolicy) -> dict:
    """One rule's figures (``laid_out``: :func:`padded_rows` of ``packs``; ``before``: the token steps' rows):
    padded GEMM ms on ``curve``, the most one pack's padding adds over its unpadded ms, the packs that cost more than
    under the token steps, real and padding tokens, distinct graph keys and padded row counts."""
    real = [pack.tokens(plan) for plan, pack in packs]
    cost = [curve.cost_ms(rows) for rows, _ in laid_out]
    padded = sum(rows for rows, _ in laid_out)
    return {"gemm_ms": round(sum(cost), 1),
            "max_over_unpadded_ms": round(max(c - curve.cost_ms(t) for c, t in zip(cost, real)), 2),
            "packs_costlier_than_steps": sum(c > curve.cost_ms(rows) for c, (rows, _) in zip(cost, before)),
            "real_tokens": sum(real), "padding_tokens": padded - sum(real),
            "padding_share": round((padded - sum(real)) / sum(real), 4),
            "graph_keys": len({key for _, key in laid_out}),
            "graph_keys_without_gdn_shapes": len({key_without_gdn_shapes(key) for _, key in laid_out}),
            "graph_keys_rows_and_level_kinds": len({key_by_rows_and_level_kinds(*entry) for entry in laid_out}),
            "graph_keys_eager_above": {str(limit): len({key for (plan, pack), (_, key) in zip(packs, laid_out)
                                                        if graph_ready(plan, pack, limit)})
                                       for limit in EAGER_ABOVE},
            "row_counts": len({rows for rows, _ in laid_out})}


def compare_rules(packs, shape: str, options: FastPathOptions) -> dict:
    """``rule name -> figures`` over ``packs`` (:func:`graphed_packs` under ``options``) for the fixed token steps
    (the fast path's default) and the measured table of ``shape`` at each of ``WINDOWS`` (opt-in)."""
    dense = options.dense_attention_tokens
    curve = table_policy(shape)
    default_window = " (its default window; opt-in: measured_buckets)"
    rules = {"token steps (the fast path's default)": None}
    rules.update({f"measured, window {w}" + (default_window if w == curve.window else ""): table_policy(shape, window=w)
                  for w in WINDOWS})
    before = padded_rows(packs, None, dense_attention_tokens=dense)
    return {name: cost_rule(packs, padded_rows(packs, buckets, dense_attention_tokens=dense), before, curve)
            for name, buckets in rules.items()}


def render_markdown(results: dict, command: str) -> str:
    lines = [f"# Graph buckets on the JevBench workload, {results['shape']} shape: token steps vs measured cost", "",
             f"Command: `{command}`", "",
             "A costing on the measured GEMM curve (`hf_openjev/packing/gemm_costs.py`, from "
             "`recipes/results/gemm_sweep/`), not a GPU timing: each graphed pack's padded rows cost the curve's time "
             f"at the smallest measured row count >= them. {results['graphed_packs']} graphed packs of "
             f"{results['requests']} requests (the shape's own default options: {results['options']}; eager packs left out). Past the table's last "
             f"row ({results['table_rows']}) packs keep the token steps and cost the last point's ms per row.", "",
             f"Unpadded (each pack at its real tokens' ms on the curve): {results['unpadded_gemm_ms']:.1f} ms.", "",
             "| rule | padded GEMM ms | most one pack's padding adds, ms | packs costlier than the steps | "
             "padding tokens | padding / real | graph keys | without the GDN calls' shapes | "
             "padded rows and level kinds alone (layout on the device) | "
             + " | ".join(f"packs over {limit:,} tokens eager" for limit in EAGER_ABOVE) + " | row counts |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(EAGER_ABOVE) + "---|"]
    for name, r in results["rules"].items():
        lines.append(f"| {name} | {r['gemm_ms']:.1f} | {r['max_over_unpadded_ms']:.2f} | {r['packs_costlier_than_steps']} | {r['padding_tokens']} | {100 * r['padding_share']:.1f}% | "
                     f"{r['graph_keys']} | {r['graph_keys_without_gdn_shapes']} | "
                     f"{r['graph_keys_rows_and_level_kinds']} | "
                     + " | ".join(str(r["graph_keys_eager_above"][str(limit)]) for limit in EAGER_ABOVE)
                     + f" | {r['row_counts']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="27b", choices=sorted(GEMM_COSTS), help="a shape with a measured table")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only (smoke runs)")
    parser.add_argument("--out", default=None, help="folder for buckets[_<shape>].json and .md")
    add_manifest_argument(parser)
    args = parser.parse_args(argv)
    check_manifest_argument(parser, args)
    requests = [request.tokens for _, request in build_workload(args.manifest, vocab=VOCAB, seed=0,
                                                                limit=args.limit)]
    options = options_for(member_sized(args.shape))  # the shape's own defaults, as the fast path plans them
    packs = graphed_packs(requests, options)
    curve = table_policy(args.shape)
    results = {"command": command_line(), "shape": args.shape, "requests": len(requests), "graphed_packs": len(packs),
               "table_rows": curve.rows[-1], "options": options.to_dict(changed_only=True),
               "unpadded_gemm_ms": round(sum(curve.cost_ms(pack.tokens(plan)) for plan, pack in packs), 1),
               "note": "a costing on the measured GEMM curve, not a GPU timing",
               "rules": compare_rules(packs, args.shape, options)}
    text = render_markdown(results, results["command"])
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = "buckets" if args.shape == "27b" else f"buckets_{args.shape}"
        (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
        (out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

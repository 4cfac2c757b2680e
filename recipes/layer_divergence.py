"""The first layer where the fast path stops matching stock Transformers, on one random candidate.

    python recipes/layer_divergence.py --shape mid --dtype bfloat16 --tokens 100 --out results/divergence

Runs one sequence through the stock text model and through the fast path (one pack, no graphs, every layer on
every row) with a forward hook on each decoder layer, and reports per layer: its type, the fraction of output
elements that differ, and max |difference| / max |stock|. In bf16 a bit-for-bit match means the two round
alike; the first layer with a mismatch is where to look. Writes ``divergence_<shape>_<dtype>.json`` and ``.md``.

    python recipes/layer_divergence.py --shape 2b --seed 1 --request hard-sol-c-judge_hard-08 --fp32 --out DIR

``--request ID``: instead of a random sequence, that request's candidate (``--candidate``, default the first) of the
fidelity gate's workload (the estimated manifest, ids drawn with ``--seed``, the seed of the weights too: the tokens
and weights ``data/bench/oracle_<shape>_seed<N>.json.gz`` was scored on). ``--fp32``: the stock model once more in
fp32 under the oracle's numerics (``exact_numerics``) as the yardstick: per layer, each bf16 path's relative error
against it (``||bf16 - fp32|| / ||fp32||``, over the layer's output and on its last row, the row that is scored),
so the layer where the fast path's error grows past stock's is where its flips come from. Named
``divergence_<shape>_<dtype>_<request>``.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch
from benchlib.provenance import command_line, versions
from benchlib.random_model import add_model_arguments, prepare_recipe
from benchlib.shapes import VOCAB
from benchlib.tables import save_table


def layer_outputs(text_model, run) -> list[torch.Tensor]:
    """Each decoder layer's output ([tokens, hidden]) during ``run()``."""
    outputs: list[torch.Tensor] = []

    def keep(_module, _args, kwargs, output):
        if kwargs.get("pack") is not None:  # the packed layer returns (mlp_out, residual); its output is the sum
            mlp_out, residual = output
            output = residual + mlp_out
        elif isinstance(output, tuple):
            output = output[0]
        outputs.append(output.reshape(-1, output.shape[-1]).detach())

    hooks = [layer.register_forward_hook(keep, with_kwargs=True) for layer in text_model.layers]
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def compare(stock: list[torch.Tensor], fast: list[torch.Tensor], layer_types: list[str],
            fp32: list[torch.Tensor] | None = None) -> list[dict]:
    """Per layer: the elements where stock and fast differ, max |difference| / max |stock|; with ``fp32``, each
    path's relative error against it over the whole output and on the last row."""
    rows = []
    for i, (s, f) in enumerate(zip(stock, fast)):
        diff = (s.float() - f.float()).abs()
        row = {"layer": i, "type": layer_types[i], "mismatch_fraction": (s != f).float().mean().item(),
               "max_rel": (diff.max() / s.float().abs().max().clamp_min(1e-30)).item()}
        if fp32 is not None:
            for name, path in (("stock", s), ("fast", f)):
                row[f"{name}_vs_fp32"] = relative_error(path, fp32[i])
                row[f"{name}_vs_fp32_last_row"] = relative_error(path[-1:], fp32[i][-1:])
        rows.append(row)
    return rows


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``||value - reference|| / ||reference||`` in fp32 (Frobenius norms)."""
    reference = reference.float()
    return ((value.float() - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def request_sequence(request_id: str, candidate: int, seed: int) -> list[int]:
    """The token ids of candidate ``candidate`` of ``request_id`` in the fidelity gate's workload of ``seed``."""
    from benchlib.workload import ESTIMATED_MANIFEST

    from hf_openjev.fidelity_check.workload import build_workload

    for item, prepared in build_workload(ESTIMATED_MANIFEST, vocab=VOCAB, seed=seed):
        if item["id"] == request_id:
            candidates = prepared.tokens[0]
            if not 0 <= candidate < len(candidates):
                raise SystemExit(f"--candidate {candidate}: {request_id} has {len(candidates)} candidates")
            return candidates[candidate]
    raise SystemExit(f"--request {request_id}: no such request in {ESTIMATED_MANIFEST.name}")


def fp32_outputs(text_model, sequence: list[int], device: str) -> list[torch.Tensor]:
    """Each layer's output of the stock model in fp32 under the oracle's numerics; every parameter and buffer is
    put back in its own dtype afterwards (bf16 -> fp32 -> bf16 is exact; RoPE's fp32 buffers stay fp32)."""
    from hf_openjev.fidelity_check.oracle import exact_numerics

    dtypes = {(module, name, kind): tensor.dtype for module in text_model.modules()
              for kind, tensors in (("p", module._parameters), ("b", module._buffers))
              for name, tensor in tensors.items() if tensor is not None}
    text_model.float()
    try:
        with exact_numerics():
            return layer_outputs(text_model, lambda: text_model(input_ids=torch.tensor([sequence], device=device),
                                                                use_cache=False))
    finally:
        for (module, name, kind), dtype in dtypes.items():
            if kind == "p":
                module._parameters[name].data = module._parameters[name].data.to(dtype)
            else:
                module._buffers[name] = module._buffers[name].to(dtype)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, shape="mid")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--patch-options", default="{}", help="JSON of FastPathOptions")
    parser.add_argument("--request", default=None, help="a request id of the gate's workload (see the docstring)")
    parser.add_argument("--candidate", type=int, default=0, help="with --request: which candidate (0: the first)")
    parser.add_argument("--fp32", action="store_true", help="compare both paths with the stock model in fp32")
    args = parser.parse_args(argv)
    if args.fp32 and args.dtype != "bfloat16":
        parser.error("--fp32 compares the bf16 paths with fp32: use it with --dtype bfloat16")
    from hf_openjev.fast_options import options_for, options_mapping_from_json

    try:  # the options checked before any model is built
        patch_options = {**options_mapping_from_json(args.patch_options, flag="--patch-options"),
                         "cuda_graphs": False, "final_row_mlp": False}
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    sequence = request_sequence(args.request, args.candidate, args.seed) if args.request else None
    from hf_openjev.family import member_sized, text_model_of
    from hf_openjev.fast_path import score_fast
    from hf_openjev.patches import apply_patches, revert_patches

    out, device, model = prepare_recipe(args)
    text_model = text_model_of(model)
    if sequence is None:
        rng = random.Random(args.tokens)
        sequence = [rng.randrange(1000, VOCAB) for _ in range(args.tokens)]
    revert_patches(model)
    stock = layer_outputs(text_model, lambda: text_model(input_ids=torch.tensor([sequence], device=device),
                                                         use_cache=False))
    fp32 = fp32_outputs(text_model, sequence, device) if args.fp32 else None
    apply_patches(model, options_for(member_sized(args.shape), patch_options))  # over the shape's defaults
    fast = layer_outputs(text_model, lambda: score_fast(model, [[[sequence]]]))
    layer_types = list(text_model.config.layer_types[: len(stock)])
    result = {"command": command_line(), "versions": versions(), "shape": args.shape, "seed": args.seed,
              "dtype": args.dtype, "device": device, "tokens": len(sequence), "request": args.request,
              "candidate": args.candidate if args.request else None, "patch_options": patch_options,
              "layers": compare(stock, fast, layer_types, fp32)}
    what = f"{args.request} candidate {args.candidate}, " if args.request else "one random sequence, "
    title = (f"Fast path against stock Transformers, layer by layer ({args.shape}, seed {args.seed}, {args.dtype}, "
             f"{device}, {what}{len(sequence)} tokens)")
    headers = ["layer", "type", "elements that differ", "max diff / max stock"]
    rows = [[r["layer"], r["type"], f"{r['mismatch_fraction']:.2%}", f"{r['max_rel']:.3g}"] for r in result["layers"]]
    if fp32 is not None:
        headers += ["stock vs fp32", "fast vs fp32", "last row: stock", "last row: fast"]
        for row, r in zip(rows, result["layers"]):
            row += [f"{r[k]:.3g}" for k in ("stock_vs_fp32", "fast_vs_fp32", "stock_vs_fp32_last_row",
                                             "fast_vs_fp32_last_row")]
    name = f"divergence_{args.shape}_{args.dtype}" + (f"_{args.request}" if args.request else "")
    print(save_table(out, name, result, title, headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The first layer where the fast path stops matching stock Transformers, on one random candidate.

    python recipes/layer_divergence.py --shape mid --dtype bfloat16 --tokens 100 --out results/divergence

Runs one sequence through the stock text model and through the fast path (one pack, no graphs, every layer on
every row) with a forward hook on each decoder layer, and reports per layer: its type, the fraction of output
elements that differ, and max |difference| / max |stock|. In bf16 a bit-for-bit match means the two round
alike; the first layer with a mismatch is where to look. Writes ``divergence_<shape>_<dtype>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
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


def compare(stock: list[torch.Tensor], fast: list[torch.Tensor], layer_types: list[str]) -> list[dict]:
    rows = []
    for i, (s, f) in enumerate(zip(stock, fast)):
        diff = (s.float() - f.float()).abs()
        rows.append({"layer": i, "type": layer_types[i], "mismatch_fraction": (s != f).float().mean().item(),
                     "max_rel": (diff.max() / s.float().abs().max().clamp_min(1e-30)).item()})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, shape="mid")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--patch-options", default="{}", help="JSON of FastPathOptions")
    args = parser.parse_args(argv)
    from hf_openjev.family import text_model_of
    from hf_openjev.fast_options import FastPathOptions
    from hf_openjev.fast_path import score_fast
    from hf_openjev.patches import apply_patches, revert_patches

    out, device, model = prepare_recipe(args)
    text_model = text_model_of(model)
    rng = random.Random(args.tokens)
    sequence = [rng.randrange(1000, VOCAB) for _ in range(args.tokens)]
    revert_patches(model)
    stock = layer_outputs(text_model, lambda: text_model(input_ids=torch.tensor([sequence], device=device),
                                                         use_cache=False))
    patch_options = {**json.loads(args.patch_options), "cuda_graphs": False, "final_row_mlp": False}
    apply_patches(model, FastPathOptions.from_mapping(patch_options))
    fast = layer_outputs(text_model, lambda: score_fast(model, [[[sequence]]]))
    layer_types = list(text_model.config.layer_types[: len(stock)])
    result = {"command": command_line(), "versions": versions(), "shape": args.shape,
              "dtype": args.dtype, "device": device, "tokens": args.tokens, "patch_options": patch_options,
              "layers": compare(stock, fast, layer_types)}
    title = (f"Fast path against stock Transformers, layer by layer ({args.shape}, {args.dtype}, {device}, "
             f"one {args.tokens}-token sequence)")
    print(save_table(out, f"divergence_{args.shape}_{args.dtype}", result, title,
                     ["layer", "type", "elements that differ", "max diff / max stock"],
                     [[r["layer"], r["type"], f"{r['mismatch_fraction']:.2%}", f"{r['max_rel']:.3g}"]
                      for r in result["layers"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

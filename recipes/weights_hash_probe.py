"""Why a random export's weights hash can differ from its random model's: build the bench's seeded model of a
shape, write it as an export (recipes/random_export.py), load it back with ``load_export``, and list every
parameter or buffer whose bytes differ (or that only one side has).

  python recipes/weights_hash_probe.py --shape mid --device cuda --out /tmp/probe
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch
from benchlib.random_model import build_model
from benchlib.shapes import SHAPES
from random_export import write_random_export


def tensor_digests(module) -> dict[str, str]:
    named = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    named.update(buffers)
    persistent = set(module.state_dict(keep_vars=True))
    return {f"{name}{'' if name in persistent else ' (non-persistent)'}":
            hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()).hexdigest()
            for name, t in named.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mid", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", required=True, help="a new directory for the export")
    args = parser.parse_args(argv)
    from hf_openjev.fidelity_check.gate import hash_weights
    from hf_openjev.model import load_export

    built = build_model(args.shape, seed=0, device=args.device)
    export = write_random_export(args.shape, Path(args.out), seed=0, device=args.device)
    loaded = load_export(export, device=args.device, allow_unknown_shape=True)
    a, b = tensor_digests(built.backbone), tensor_digests(loaded.backbone)
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    print(f"{args.shape} on {args.device}: hash_weights built {hash_weights(built.backbone)[:16]}, "
          f"loaded {hash_weights(loaded.backbone)[:16]}; {len(differ)} of {len(set(a) | set(b))} tensors differ")
    for name in differ[:20]:
        print(f"  {name}: built {a.get(name, '-')[:12]} loaded {b.get(name, '-')[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

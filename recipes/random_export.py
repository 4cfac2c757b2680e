"""The benchmark's random model (``bench_jevbench.build_model``: seeded bf16 weights, random head) written as a
merged export, so that ``hf-openjev fidelity`` runs on exactly the weights of ``data/bench/oracle_<shape>.json.gz``
(its ``weights_sha256``) and reproduces the committed fidelity tables:

  python recipes/random_export.py --shape 27b --out /scratch/random-27b      # 51 GB of bf16 on disk
  hf-openjev fidelity --model /scratch/random-27b --workload data/bench/jevbench231-shapes.json \\
      --oracle data/bench/oracle_27b.json.gz --configs default --out results/ --name 27b

The export holds the backbone (``save_pretrained``: config.json and bf16 safetensors shards), the manifest
(``open_jev_export.json``: the bench's head, temperature and empty chat halves) and the tiny tokenizer (the
workload is token ids: no text is tokenized). The model is built on the CPU unless ``--device`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from benchlib.random_model import build_model
from benchlib.shapes import SHAPES


def write_random_export(shape: str, out: Path, *, seed: int = 0, device: str = "cpu",
                        max_shard_size: str = "5GB") -> Path:
    """Build ``build_model(shape, seed=seed)`` in bf16 and write it under ``out`` as a merged export."""
    from hf_openjev.checkpoint.manifest import MANIFEST_NAME
    from hf_openjev.checkpoint.tiny import build_tiny_tokenizer

    model = build_model(shape, seed=seed, device=device, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    backbone = model.backbone
    backbone.config.architectures = ["Qwen3_5TextModel"]
    backbone.save_pretrained(str(out), max_shard_size=max_shard_size)
    (out / MANIFEST_NAME).write_text(json.dumps(model.manifest.to_json(), indent=1))
    build_tiny_tokenizer().save_pretrained(str(out))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    parser.add_argument("--seed", type=int, default=0, help="the bench's and the oracle's seed")
    parser.add_argument("--out", required=True, help="the export directory to write (must not exist yet)")
    parser.add_argument("--device", default="cpu", help="where the model is built (cuda is faster at 27B)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        parser.error(f"--out {out} exists; give a new directory")
    write_random_export(args.shape, out, seed=args.seed, device=args.device)
    print(f"wrote {out}: the {args.shape} random model, seed {args.seed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

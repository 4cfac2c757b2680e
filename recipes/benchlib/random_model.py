"""The recipes' seeded random Open-Jev model of a shape, and the options every model-building recipe shares."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchlib.shapes import SHAPES, TEMPERATURES, VOCAB


def build_model(shape: str, *, seed: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """Random weights from Transformers' own init (seeded), a random fp32 head, the shape's temperature
    (``benchlib.shapes.TEMPERATURES``). The same seed builds bit-identical weights on every run."""
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    from hf_openjev.checkpoint.backbone import make_head as _make_head
    from hf_openjev.checkpoint.manifest import ExportManifest
    from hf_openjev.model import JevModel

    config = Qwen3_5TextConfig(vocab_size=VOCAB, max_position_embeddings=32768, rms_norm_eps=1e-6,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                "mrope_interleaved": True},
                               **SHAPES[shape])
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            backbone = Qwen3_5TextModel(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():  # the zero-initialised (1 + w) norms get small random weights, as trained ones have
        for name, p in backbone.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    generator = torch.Generator().manual_seed(seed + 1)
    weight = torch.randn(1, config.hidden_size, generator=generator) / config.hidden_size**0.5 * 4
    manifest = ExportManifest(model_id=f"random-{shape}", base_revision="random", checkpoint_revision="random",
                              temperature=TEMPERATURES[shape], max_length=16384, chat_prefix="", chat_suffix="",
                              head_weight=tuple(weight.flatten().tolist()), head_bias=0.1,
                              # the tiny and mid shapes are no Open-Jev model's: marked as test checkpoints, so
                              # that their exports load without allow_unknown_shape (hf_openjev.family)
                              test_checkpoint=shape in ("tiny", "mid"))
    head = _make_head(manifest.head_weight, manifest.head_bias, device)
    return JevModel(backbone, head, None, manifest, method="random")


def add_model_arguments(parser: argparse.ArgumentParser, *, shape: str) -> None:
    """The options every model-building recipe shares: --shape, --dtype, --seed, --out."""
    parser.add_argument("--shape", default=shape, choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)


def default_device() -> str:
    """CUDA when there is one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare_recipe(args: argparse.Namespace) -> tuple[Path, str, object]:
    """(output folder, created; the device: CUDA when there is one; the seeded random model of ``args``)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = default_device()
    return out, device, build_model(args.shape, seed=args.seed, device=device, dtype=getattr(torch, args.dtype))


def weights_gb(model) -> float:
    """GB (1e9) of the model's parameters and buffers, each storage counted once (stacked views share one)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values()) / 1e9

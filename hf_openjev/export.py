"""``hf-openjev export``: merge the LoRA adapter into a merged checkpoint, one safetensors shard at a time.

Every LoRA-targeted weight becomes ``bf16(W + scale * B @ A)`` computed in fp32 (``scale = alpha / r``); every
other text-backbone tensor is copied bit for bit; the vision tower, MTP layers and LM head are dropped. The
output is written into a temporary directory beside ``out_dir`` and renamed at the end, with
``open_jev_export.json`` written last.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import CheckpointError
from .manifest import ExportManifest, check_max_length, write_manifest
from .package import read_base_text_config, read_lora_pairs, read_package

MAX_SHARD_BYTES = 5 * 1000**3
_TEXT_PREFIXES = ("model.language_model.", "model.")
_DROPPED = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.|lm_head\.)")
_TOKENIZER_FILES = re.compile(r"^(tokenizer.*|special_tokens_map\.json|vocab.*|merges\.txt|added_tokens\.json|"
                              r"chat_template.*)$")


def base_weight_files(base_dir: Path) -> list[Path]:
    """The base's safetensors shards, in index order."""
    index = base_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (base_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{base_dir}: shards named in the index are missing: {missing[:3]}")
        return [base_dir / f for f in files]
    single = base_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{base_dir} has no model.safetensors or model.safetensors.index.json")


def text_key(key: str) -> str | None:
    """The backbone name of a base tensor (``layers.0.mlp.up_proj.weight``), or None for tensors export drops."""
    if _DROPPED.match(key):
        return None
    for prefix in _TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def merge_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``bf16(W + scale * B @ A)`` computed in fp32 (the same rounding as PEFT's ``merge_and_unload``)."""
    delta = (b.float() @ a.float()) * scale
    return (weight.float() + delta).to(torch.bfloat16)


class _ShardWriter:
    """Collects tensors and writes shards of at most ``max_bytes``; names them once the count is known."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.out_dir / f"part-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Rename parts to ``model-0000i-of-0000n.safetensors`` (or ``model.safetensors``) and write the index."""
        self.flush()
        n = len(self.written)
        if n == 1:
            self.written[0][0].rename(self.out_dir / "model.safetensors")
            return
        weight_map, total = {}, 0
        for i, (path, names) in enumerate(self.written, start=1):
            final = self.out_dir / f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(final)
            total += final.stat().st_size
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def merge_lora(base_dir, package_dir, out_dir, *, max_length: int = 4096, overwrite: bool = False,
               verify: bool = True, progress: bool = True, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Merge the package's LoRA adapter into the base and write a merged export at ``out_dir``.

    Everything is checked before anything is written; no output directory is left behind on failure.
    """
    from .chat import render_chat_halves
    from .model import _load_tokenizer

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    check_max_length(max_length)
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"{out_dir} already exists; pass --overwrite to replace it")
    package = read_package(package_dir)
    text_config = read_base_text_config(base_dir)
    files = base_weight_files(base_dir)
    pairs = read_lora_pairs(package)
    tokenizer = _load_tokenizer(base_dir)
    chat_prefix, chat_suffix = render_chat_halves(tokenizer)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        writer = _ShardWriter(tmp, max_shard_bytes)
        merged = set()
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    name = text_key(key)
                    if name is None:
                        continue
                    tensor = handle.get_tensor(key)
                    module = name[: -len(".weight")] if name.endswith(".weight") else None
                    if module in pairs:
                        a, b = pairs[module]
                        tensor = merge_weight(tensor, a, b, package.lora_scale)
                        merged.add(module)
                    writer.add(name, tensor)
        unmatched = sorted(set(pairs) - merged)
        if unmatched:
            raise CheckpointError(f"the adapter targets modules the base does not have: {unmatched[:3]}")
        writer.finish()
        text_config.architectures = ["Qwen3_5TextModel"]
        text_config.to_json_file(str(tmp / "config.json"))
        for item in base_dir.iterdir():
            if item.is_file() and _TOKENIZER_FILES.match(item.name):
                shutil.copy2(item, tmp / item.name)
        manifest = ExportManifest(
            model_id=package.model_id,
            base_revision=str(package.model_info.get("base_revision", "")),
            checkpoint_revision=package.revision,
            temperature=package.temperature,
            max_length=max_length,
            chat_prefix=chat_prefix,
            chat_suffix=chat_suffix,
            head_weight=tuple(package.head_weight.flatten().tolist()),
            head_bias=float(package.head_bias[0]),
        )
        write_manifest(tmp, manifest)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir

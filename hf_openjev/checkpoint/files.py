"""Reading checkpoints: base safetensors shards and headers, backbone names and shapes, the shipped tokenizer.

A leaf module: the loaders (``hf_openjev.model``) and the export command (``hf_openjev.export``) both read
checkpoints through it, so neither imports the other.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
import weakref
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import GET_CHECKPOINT_DOCS, CheckpointError

_TEXT_PREFIXES = ("model.language_model.", "model.")
_DROPPED = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.|lm_head\.)")
FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def base_weight_files(base_dir: Path) -> list[Path]:
    """The base's safetensors shards, in index order (``model.safetensors`` when not sharded)."""
    base_dir = Path(base_dir)
    index = base_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {exc}") from exc
        missing = [f for f in files if not (base_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{base_dir}: shards named in {index.name} are missing: {missing[:3]}; "
                                  f"download the complete base model ({GET_CHECKPOINT_DOCS})")
        if not files:
            raise CheckpointError(f"{index} names no shards")
        return [base_dir / f for f in files]
    single = base_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{base_dir} has no model.safetensors or model.safetensors.index.json "
                          f"(the base model's weights are missing; {GET_CHECKPOINT_DOCS})")


def text_key(key: str) -> str | None:
    """The backbone name of a base tensor (``layers.0.mlp.up_proj.weight``), or None for tensors export drops."""
    if _DROPPED.match(key):
        return None
    for prefix in _TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def read_safetensors_headers(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (shape, dtype)}`` from a safetensors header (no tensor data is read)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            out = {}
            for key in handle.keys():
                piece = handle.get_slice(key)
                out[key] = (tuple(int(d) for d in piece.get_shape()), str(piece.get_dtype()))
            return out
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc


def expected_backbone_shapes(text_config) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every weight ``Qwen3_5TextModel(text_config)`` loads (built on the meta device)."""
    from transformers import Qwen3_5TextModel

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Qwen3_5TextModel(text_config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def load_tokenizer(path: Path):
    """The tokenizer exactly as shipped in ``tokenizer.json`` (no model-specific class rewriting it).

    ``AutoTokenizer`` would pick a class from ``config.json`` (``qwen3_5`` vs ``qwen3_5_text``), and those
    classes rebuild the pre-tokenizer: the base and its export would then tokenize differently.
    """
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path / 'tokenizer.json'} is missing; the checkpoint has no usable tokenizer")
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    except Exception as exc:
        raise CheckpointError(f"cannot load the tokenizer from {path}: {exc}") from exc
    if len(tokenizer) <= 1:
        raise CheckpointError(f"the tokenizer in {path} is empty")
    note_tokenizer_file(tokenizer, path / "tokenizer.json")  # its analysis's cache key, without serializing it
    return tokenizer


_file_digests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its tokenizer.json's sha256


def note_tokenizer_file(tokenizer, path: str | Path) -> None:
    """Remember that ``tokenizer`` was loaded from the ``tokenizer.json`` at ``path`` (its digest, read now), so that
    :func:`hf_openjev.tokenizer.tokenizer_analysis.tokenizer_fingerprint` need not serialize it. Replace nothing of its model
    after this (its vocabulary is taken to be the file's)."""
    try:
        _file_digests[tokenizer] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except (OSError, TypeError):  # unreadable, or not weak-referenceable: fingerprinted by serializing
        pass


def tokenizer_file_digest(tokenizer) -> str | None:
    """The sha256 :func:`note_tokenizer_file` noted for ``tokenizer``, or None."""
    try:
        return _file_digests.get(tokenizer)
    except TypeError:  # not weak-referenceable
        return None

"""The Open-Jev family: every published member's shape, temperature and tied flag, and the check a checkpoint
passes when it is exported or loaded.

A shape is the tuple (hidden, MLP, layers, attention heads, KV heads, GDN key heads, GDN value heads), read from
the text config. :func:`check_family_member` refuses, with one line naming what is off:

- a shape that is no member's (the message names the nearest member);
- a checkpoint that names a member (its base repo id, e.g. ``Qwen/Qwen3.5-9B``, or a model id such as
  ``open-jev/Open-Jev-9B``) but has another shape, or a member's shape with another member's temperature;
- a member's shape whose ``tie_word_embeddings`` is not the member's (a tied 2B exported untied, say).

To run an unknown shape anyway (a new fine-tune, a pruned model): ``allow_unknown_shape=True`` in
``load_export`` / ``load_reference`` / ``merge_lora`` / ``pipeline("jev-decision", ...)``, or
``--allow-unknown-shape`` on ``hf-openjev export``, ``eval`` and ``serve``. Checkpoints built for tests (the
package's tiny random ones) carry ``"test_checkpoint": true`` in their ``model.json`` and export manifest and
are not checked: their sizes are not special-cased.

The 2B's MLP width (6144) is not in the project's checkpoint document; it is from public descriptions of
Qwen3.5-2B (see README, "Models").
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from .checkpoint.manifest import TEST_CHECKPOINT_KEY
from .errors import CheckpointError

VOCAB_SIZE = 248_320  # every member's (docs/checkpoints.md)
UNKNOWN_SHAPE_HELP = ("accept a checkpoint whose shape (hidden, MLP, layers, heads, KV heads, GDN heads) is no "
                      "Open-Jev model's (27B, 9B, 2B), or that names one model but has another's shape, temperature "
                      "or tied flag; without it such a checkpoint is refused")  # --allow-unknown-shape
_FIELDS = "(hidden, MLP, layers, heads, KV heads, GDN key heads, GDN value heads)"
_OPEN_JEV_ID = re.compile(r"^open-jev-(\d+b)(?![0-9a-z])", re.IGNORECASE)


class ModelShape(NamedTuple):
    """The tuple a checkpoint is recognised by."""

    hidden: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int
    gdn_key_heads: int
    gdn_value_heads: int

    def describe(self) -> str:
        """``"(2048, 6144, 24, 8, 2, 16, 16)"``."""
        return "(" + ", ".join(str(v) for v in self) + ")"


@dataclass(frozen=True)
class FamilyMember:
    """One published Open-Jev model (docs/checkpoints.md "Models")."""

    name: str  # "Open-Jev-9B"
    base: str  # the Hugging Face repo id of its base model
    shape: ModelShape
    temperature: float
    tied: bool  # tie_word_embeddings of its base

    @property
    def size(self) -> str:
        """``"9b"``: what a model id names it by."""
        return _OPEN_JEV_ID.match(self.name).group(1).lower()


MEMBERS: tuple[FamilyMember, ...] = (
    FamilyMember("Open-Jev-27B-v1.1", "Qwen/Qwen3.8-27B", ModelShape(5120, 17408, 64, 24, 4, 16, 48),
                 2.5343690298472983, tied=False),
    FamilyMember("Open-Jev-9B", "Qwen/Qwen3.5-9B", ModelShape(4096, 12288, 32, 16, 4, 16, 32),
                 1.8969118766347646, tied=False),
    FamilyMember("Open-Jev-2B", "Qwen/Qwen3.5-2B", ModelShape(2048, 6144, 24, 8, 2, 16, 16),
                 1.518796342858676, tied=True),
)


def shape_of(config) -> ModelShape:
    """The shape tuple of a ``Qwen3_5TextConfig`` (or anything with its attribute names)."""
    return ModelShape(config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                      config.num_attention_heads, config.num_key_value_heads, config.linear_num_key_heads,
                      config.linear_num_value_heads)


def member_with_shape(shape: ModelShape) -> FamilyMember | None:
    return next((m for m in MEMBERS if m.shape == tuple(shape)), None)


def member_sized(size: str) -> FamilyMember | None:
    """The member a size names (``"9b"``; the benchmark's shapes), or None (``"mid"``, a test shape)."""
    return next((m for m in MEMBERS if m.size == str(size).lower()), None)


def nearest_member(shape: ModelShape) -> FamilyMember:
    """The member whose shape is closest (sum of |log ratio| over the fields)."""
    def distance(member: FamilyMember) -> float:
        return sum(abs(math.log(max(a, 1) / max(b, 1))) for a, b in zip(shape, member.shape))

    return min(MEMBERS, key=distance)


def members_named(names: Iterable[str]) -> list[tuple[str, FamilyMember]]:
    """``(name, member)`` for each name that is a member's base repo id or an ``open-jev-<size>`` model id."""
    found = []
    for name in names:
        if not isinstance(name, str) or not name:
            continue
        last = name.rstrip("/").rsplit("/", 1)[-1]
        size = _OPEN_JEV_ID.match(last)
        for member in MEMBERS:
            if name.lower() == member.base.lower() or (size and size.group(1).lower() == member.size):
                found.append((name, member))
    return found


def check_family_member(config, *, temperature: float, names: Iterable[str] = (), test_checkpoint: bool = False,
                        allow_unknown: bool = False, where: str) -> FamilyMember | None:
    """The member ``config`` (a text config) is, checked as the module docstring says; None for a test checkpoint or
    an unknown shape allowed with ``allow_unknown``. Raises :class:`CheckpointError` (one line) otherwise."""
    shape = shape_of(config)
    matched = member_with_shape(shape)
    if test_checkpoint or allow_unknown:
        return matched
    how = "pass allow_unknown_shape=True (--allow-unknown-shape) to run it anyway"
    for name, member in members_named(names):
        if member is not matched:
            raise CheckpointError(f"{where}: it names {member.name} ({name!r}) but its shape {_FIELDS} = "
                                  f"{shape.describe()} is not that model's {member.shape.describe()}; {how}")
    if matched is None:
        nearest = nearest_member(shape)
        raise CheckpointError(f"{where}: its shape {_FIELDS} = {shape.describe()} is no Open-Jev model's; the "
                              f"nearest is {nearest.name} {nearest.shape.describe()}; {how}")
    other = next((m for m in MEMBERS if m is not matched and m.temperature == temperature), None)
    if other is not None:
        raise CheckpointError(f"{where}: it has the shape of {matched.name} but the temperature of {other.name} "
                              f"({temperature!r}); the package's temperature.json comes from another model; {how}")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied != matched.tied:
        raise CheckpointError(f"{where}: tie_word_embeddings is {str(tied).lower()} but {matched.name} "
                              f"{'ties' if matched.tied else 'does not tie'} its embeddings; the config was edited "
                              f"or comes from another base; {how}")
    return matched


def text_config_of(member: FamilyMember):
    """A ``Qwen3_5TextConfig`` of ``member``'s shape (every 4th layer full attention, head dims 256 and 128)."""
    from transformers import Qwen3_5TextConfig

    s = member.shape
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(s.layers)]
    return Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=s.hidden, intermediate_size=s.mlp, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=256,
        linear_num_key_heads=s.gdn_key_heads, linear_num_value_heads=s.gdn_value_heads, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, layer_types=layer_types,
        tie_word_embeddings=member.tied)


def backbone_parameters(member: FamilyMember) -> int:
    """Parameters of ``member``'s text backbone (an export: embeddings included, no LM head)."""
    from .checkpoint.files import expected_backbone_shapes

    return sum(math.prod(shape) for shape in expected_backbone_shapes(text_config_of(member)).values())


def package_names(package) -> list[str]:
    """What a published package calls itself and its base: its model id, PEFT's ``base_model_name_or_path`` and
    ``model.json``'s ``base_model`` / ``base_model_id`` (the names :func:`members_named` reads)."""
    info, adapter = package.model_info, package.adapter_config
    values = [package.model_id, adapter.get("base_model_name_or_path"), info.get("base_model"), info.get("base_model_id")]
    return [v for v in values if isinstance(v, str) and v]


def is_test_package(package) -> bool:
    """``"test_checkpoint": true`` in the package's ``model.json``."""
    return package.model_info.get(TEST_CHECKPOINT_KEY) is True


def check_export_shape(export_dir, *, allow_unknown: bool = False) -> FamilyMember | None:
    """:func:`check_family_member` for an export directory, from its manifest and ``config.json`` alone (no
    weights, no Transformers): ``eval`` and ``serve`` call it before any other work. A config it cannot read is
    left to the loader, which says what is wrong with it."""
    import json
    import types
    from pathlib import Path

    from .checkpoint.manifest import read_manifest

    manifest = read_manifest(export_dir)
    try:
        config = types.SimpleNamespace(**json.loads((Path(export_dir) / "config.json").read_text(encoding="utf-8")))
        shape_of(config)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return check_family_member(config, temperature=manifest.temperature, names=[manifest.model_id],
                               test_checkpoint=manifest.test_checkpoint, allow_unknown=allow_unknown,
                               where=str(export_dir))


def text_model_of(model):
    """The Qwen3.5 text model (an ``nn.Module``) inside a JevModel, a PEFT wrapper or a bare backbone; the patches
    and the FP8 swap both find it here."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    root = getattr(model, "backbone", model)
    for module in root.modules():
        if isinstance(module, Qwen3_5TextModel):
            return module
    raise TypeError(f"{type(model).__name__} holds no Qwen3_5TextModel to patch")

"""Where the patches find the Qwen3.5 text model of whatever they are given."""

from __future__ import annotations

from torch import nn


def text_model_of(model) -> nn.Module:
    """The Qwen3.5 text model inside a JevModel, a PEFT wrapper or a bare backbone."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    root = getattr(model, "backbone", model)
    for module in root.modules():
        if isinstance(module, Qwen3_5TextModel):
            return module
    raise TypeError(f"{type(model).__name__} holds no Qwen3_5TextModel to patch")

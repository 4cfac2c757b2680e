"""The published package's LoRA adapter on a base backbone, unmerged (PEFT layers): the reference model's backbone."""

from __future__ import annotations

from torch import nn

from ..errors import CheckpointError
from .package import read_lora_pairs


def apply_lora_unmerged(backbone: nn.Module, package) -> nn.Module:
    """Wrap ``backbone`` with PEFT LoRA layers holding the package's fp32 adapter (not merged)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    pairs = read_lora_pairs(package)
    modules = dict(backbone.named_modules())
    for name, (a, b) in pairs.items():
        target = modules.get(name)
        if not isinstance(target, nn.Linear):
            raise CheckpointError(f"the adapter targets {name}, which is not a linear layer of the base model")
        if a.shape[1] != target.in_features or b.shape[0] != target.out_features:
            raise CheckpointError(
                f"the adapter's {name} has shapes A {tuple(a.shape)} / B {tuple(b.shape)} but the base layer is "
                f"{target.out_features}x{target.in_features}; adapter and base do not match"
            )
    config = LoraConfig(r=package.lora_rank, lora_alpha=package.lora_alpha, lora_dropout=0.0, bias="none",
                        target_modules=sorted(pairs))
    peft_model = get_peft_model(backbone, config, autocast_adapter_dtype=True)
    state = {}
    for name, (a, b) in pairs.items():
        state[f"{name}.lora_A.weight"] = a
        state[f"{name}.lora_B.weight"] = b
    result = set_peft_model_state_dict(peft_model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise CheckpointError(f"PEFT did not place adapter weights {unexpected[:3]}")
    return peft_model

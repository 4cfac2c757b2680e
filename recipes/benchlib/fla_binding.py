"""Arms A and B: stock Transformers with its torch fallbacks (fla unbound) or with fla-core bound."""

from __future__ import annotations


def bind_fla(enabled: bool) -> None:
    """Arm A unbinds fla from the stock module (torch fallback); arm B restores what Transformers bound."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        current = getattr(qwen, name)
        original = getattr(qwen, f"_hf_openjev_bound_{name}", None)
        if original is None:
            setattr(qwen, f"_hf_openjev_bound_{name}", current)
            original = current
        setattr(qwen, name, original if enabled else getattr(original, "__wrapped__", original))

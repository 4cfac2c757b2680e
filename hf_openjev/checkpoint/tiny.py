"""A tiny random Open-Jev checkpoint, built locally (no downloads): tests and the demo run on it.

``write_tiny_base_and_package(root)`` writes two directories (``hf_openjev.export.tiny.build_tiny_checkpoint``
adds ``<root>/export/``, the merged export):

```
<root>/base/      a full-style Qwen3.5 base: config.json (qwen3_5 with text_config), weights under
                  model.language_model. plus a vision tensor, an MTP tensor and lm_head (which export drops;
                  none with tied embeddings: ``tiny_text_config(tie_word_embeddings=True)``, as the 2B),
                  and a tokenizer: by default a toy byte-level BPE with the Qwen chat special tokens and chat
                  template (``build_tiny_checkpoint(..., tokenizer="qwen3.5")`` passes the real one instead)
<root>/package/   the published package: checkpoint/{model.json, adapter/, head.pt, temperature.json}
```

The package's ``model.json`` says ``"test_checkpoint": true``: its shape is no Open-Jev model's, and the family
check (:mod:`hf_openjev.family`) lets it through for that mark, not for its size.

The weights are random: answers from this checkpoint mean nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .manifest import TEST_CHECKPOINT_KEY

TINY_TEMPERATURE = 2.5343690298472983
TINY_MODEL_ID = "open-jev/tiny-random"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3.5's template for one user turn, reduced to what the contract uses (no tools, no images).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
_CORPUS = [
    "Context:\nQuestion: Proposed answer: Is this proposed answer correct? Answer Yes or No.",
    "Is the answer to this question yes? Answer Yes or No.\nYes means: No means:",
    "The customer wants to cancel the order, track a package, change the address or ask about billing.",
    "Which intent does the user's message express? Rate the severity from low to high.",
    '{"key": "value", "items": [1, 2, 3], "nested": {"a": true, "b": null}}',
    "Über naïve café — 日本語のテキスト, emoji 🙂 and numbers 0123456789.",
]



def tiny_text_config(*, vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 4, seed_variant: int = 0,
                     **overrides):
    """A tiny Qwen3.5 text config with both layer types (every 4th layer full attention, as the real models)."""
    from transformers import Qwen3_5TextConfig

    layer_types = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(num_layers)]
    if "full_attention" not in layer_types:
        layer_types[-1] = "full_attention"
    params = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=layer_types,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )
    params.update(overrides)
    return Qwen3_5TextConfig(**params)


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with the Qwen chat special tokens and a Qwen-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _random_lora(backbone, rank: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random (non-zero) LoRA A/B for the published target modules, keyed as PEFT saves them for the full model."""
    from .package import PUBLISHED_TARGETS

    tensors = {}
    for name, module in backbone.named_modules():
        if name.split(".")[-1] in PUBLISHED_TARGETS and isinstance(module, torch.nn.Linear):
            key = f"base_model.model.model.language_model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * 0.05
    return tensors


def write_tiny_base_and_package(root: str | Path, *, seed: int = 0, config=None, lora_rank: int = 8,
                                lora_alpha: float = 16.0, temperature: float = TINY_TEMPERATURE,
                                max_length: int = 4096, tokenizer=None, vocab_size: int | None = None
                                ) -> tuple[Path, Path]:
    """Write ``<root>/base`` and ``<root>/package`` (a published-style package with a random LoRA and head).

    ``tokenizer``: a fast tokenizer with a Qwen-style chat template, saved into the base (default: the toy one,
    :func:`build_tiny_tokenizer`); ``vocab_size``: the embedding rows (default ``len(tokenizer)``)."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5TextModel

    root = Path(root)
    base, package = root / "base", root / "package"
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    config = config or tiny_text_config(vocab_size=vocab_size or len(tokenizer))
    torch.manual_seed(seed)
    backbone = Qwen3_5TextModel(config).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # make the zero-initialised norms and biases non-trivial
        for name, param in backbone.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1 + (1.0 if "dt_bias" in name else 0.0))

    base.mkdir(parents=True, exist_ok=True)
    weights = {f"model.language_model.{k}": v.contiguous() for k, v in backbone.state_dict().items()}
    hidden = config.hidden_size
    weights["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, generator=generator).bfloat16()
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator).bfloat16()
    if not config.tie_word_embeddings:  # a tied base stores the embedding once (as save_pretrained does)
        weights["lm_head.weight"] = torch.randn(config.vocab_size, hidden, generator=generator).bfloat16()
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    text = config.to_dict()
    text.pop("architectures", None)
    full_config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                   "tie_word_embeddings": config.tie_word_embeddings, "text_config": text, "vision_config": {"depth": 1, "hidden_size": 8, "num_heads": 1,
                                                          "out_hidden_size": hidden}}
    (base / "config.json").write_text(json.dumps(full_config, indent=1))
    tokenizer.save_pretrained(str(base))

    ckpt = package / "checkpoint"
    (ckpt / "adapter").mkdir(parents=True, exist_ok=True)
    lora = _random_lora(backbone, lora_rank, generator)
    save_file(lora, str(ckpt / "adapter" / "adapter_model.safetensors"))
    targets = sorted({k.split(".lora_")[0].split(".")[-1] for k in lora})
    adapter_config = {"peft_type": "LORA", "r": lora_rank, "lora_alpha": lora_alpha, "lora_dropout": 0.0,
                      "bias": "none", "target_modules": targets, "task_type": None}
    (ckpt / "adapter" / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    head = {"weight": torch.randn(1, hidden, generator=generator) * 0.5, "bias": torch.randn(1, generator=generator)}
    torch.save(head, ckpt / "head.pt")
    (ckpt / "temperature.json").write_text(json.dumps({"temperature": temperature}))
    model_info = {"model_id": TINY_MODEL_ID, "revision": f"tiny-seed{seed}", "max_length": max_length,
                  "lora_rank": lora_rank, "method": "lora+scalar-head", TEST_CHECKPOINT_KEY: True}
    (ckpt / "model.json").write_text(json.dumps(model_info, indent=1))
    return base, package



def default_cache_dir() -> Path:
    """Where the demo keeps its tiny checkpoint (``$HF_OPENJEV_CACHE`` or ``~/.cache/hf_openjev``)."""
    env = os.environ.get("HF_OPENJEV_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "hf_openjev"

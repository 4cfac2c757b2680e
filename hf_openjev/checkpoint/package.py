"""Reading the published Open-Jev package and its base model directory (docs/checkpoints.md "Open-Jev package").

```
<package>/checkpoint/model.json          {"model_id", "revision", "max_length", "lora_rank", "method"}
<package>/checkpoint/adapter/            adapter_config.json + adapter_model.safetensors (fp32)
<package>/checkpoint/head.pt             {"weight": [1, hidden], "bias": [1]} (fp32)
<package>/checkpoint/temperature.json    {"temperature": T, ...}
```

Everything here validates before anything heavy is loaded, so that ``export`` and the reference loader fail
with a message that says what to fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import GET_CHECKPOINT_DOCS, CheckpointError
from .manifest import check_head, check_temperature
from .manifest import read_json_object as _read_json

# The modules LoRA adapts in Open-Jev (docs/checkpoints.md): attention q/k/v/o, GDN in_proj_qkv and out_proj.
PUBLISHED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "out_proj")
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")

# PEFT keys of text decoder layers: [base_model.model.][model.][language_model.]layers.N.<module>.lora_A|B[.adapter].weight
_LORA_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(layers\.\d+\.[\w.]+?)\.lora_([AB])(?:\.\w+)?\.weight$"
)


@dataclass(frozen=True)
class OpenJevPackage:
    """A validated published package (the big tensors are read lazily)."""

    checkpoint_dir: Path
    model_info: dict
    temperature: float
    head_weight: torch.Tensor  # [1, hidden] fp32
    head_bias: torch.Tensor  # [1] fp32
    lora_rank: int
    lora_alpha: float
    adapter_config: dict
    adapter_file: Path

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank

    @property
    def model_id(self) -> str:
        return str(self.model_info.get("model_id", "open-jev"))

    @property
    def revision(self) -> str:
        return str(self.model_info.get("revision", ""))


def find_checkpoint_dir(package_dir: str | Path) -> Path:
    """Accept the package root (holding ``checkpoint/``) or the ``checkpoint/`` folder itself."""
    root = Path(package_dir)
    if not root.is_dir():
        raise CheckpointError(f"package directory {root} does not exist; download the published package first "
                              f"({GET_CHECKPOINT_DOCS})")
    if (root / "checkpoint").is_dir():
        return root / "checkpoint"
    if (root / "model.json").is_file() or (root / "adapter").is_dir():
        return root
    raise CheckpointError(f"{root} has no checkpoint/ folder; pass the published Open-Jev package directory")


def read_package(package_dir: str | Path) -> OpenJevPackage:
    """Validate a published package: every file present, rank/alpha given, head and temperature finite."""
    ckpt = find_checkpoint_dir(package_dir)
    model_info = _read_json(ckpt / "model.json", "the package's model.json")
    temperature_data = _read_json(ckpt / "temperature.json", "the calibration temperature")
    if "temperature" not in temperature_data:
        raise CheckpointError(f"{ckpt / 'temperature.json'} has no 'temperature'")
    try:
        temperature = check_temperature(temperature_data["temperature"])
    except CheckpointError as exc:
        raise CheckpointError(f"{ckpt / 'temperature.json'}: {exc}") from None

    adapter_dir = ckpt / "adapter"
    adapter_config = _read_json(adapter_dir / "adapter_config.json", "the LoRA adapter config")
    adapter_file = adapter_dir / "adapter_model.safetensors"
    if not adapter_file.is_file():
        raise CheckpointError(f"{adapter_file} is missing (the LoRA adapter weights)")
    rank, alpha = adapter_config.get("r"), adapter_config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise CheckpointError(f"{adapter_dir / 'adapter_config.json'}: LoRA rank 'r' is missing or not a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise CheckpointError(f"{adapter_dir / 'adapter_config.json'}: 'lora_alpha' is missing or not a positive number")

    head_path = ckpt / "head.pt"
    if not head_path.is_file():
        raise CheckpointError(f"{head_path} is missing (the scalar head)")
    try:
        head = torch.load(head_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling failure means a corrupt file
        raise CheckpointError(f"{head_path} cannot be read as a state dict: {exc}") from exc
    if not isinstance(head, dict) or "weight" not in head or "bias" not in head:
        raise CheckpointError(f"{head_path} must be a state dict with 'weight' [1, hidden] and 'bias' [1]")
    weight, bias = head["weight"], head["bias"]
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.shape[0] != 1:
        raise CheckpointError(f"{head_path}: head weight must have shape [1, hidden], got {tuple(getattr(weight, 'shape', ()))}")
    if not isinstance(bias, torch.Tensor) or bias.numel() != 1:
        raise CheckpointError(f"{head_path}: head bias must have one element")
    check_head(weight.float().flatten().tolist(), float(bias.float().flatten()[0]))
    return OpenJevPackage(
        checkpoint_dir=ckpt,
        model_info=model_info,
        temperature=temperature,
        head_weight=weight.detach().float().clone(),
        head_bias=bias.detach().float().reshape(1).clone(),
        lora_rank=rank,
        lora_alpha=float(alpha),
        adapter_config=adapter_config,
        adapter_file=adapter_file,
    )


def read_lora_pairs(package: OpenJevPackage) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter as ``{"layers.3.self_attn.q_proj": (A [r, in], B [out, r])}`` in fp32.

    PEFT key prefixes (``base_model.model.``, ``model.``, ``model.language_model.``) are stripped, so an adapter
    trained on the full multimodal model and one trained on the text model read the same.
    """
    halves: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(package.adapter_file), framework="pt") as handle:
        for key in handle.keys():
            match = _LORA_KEY.search(key)
            if match is None:
                raise CheckpointError(
                    f"adapter tensor {key!r} is not a LoRA A/B weight of a decoder layer; "
                    "only text-backbone LoRA adapters are supported"
                )
            halves.setdefault(match.group(1), {})[match.group(2)] = handle.get_tensor(key).float()
    pairs = {}
    for module, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"adapter module {module} lacks its lora_{'B' if 'A' in ab else 'A'} weight")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != package.lora_rank or b.shape[1] != package.lora_rank:
            raise CheckpointError(
                f"adapter module {module}: shapes A {tuple(a.shape)} / B {tuple(b.shape)} do not match rank "
                f"r={package.lora_rank} from adapter_config.json"
            )
        pairs[module] = (a, b)
    if not pairs:
        raise CheckpointError(f"{package.adapter_file} holds no LoRA weights")
    return pairs


def read_base_text_config(base_dir: str | Path):
    """The base's text config (``qwen3_5_text``), from a full ``qwen3_5`` config or a text-only one. A full config's
    top-level ``tie_word_embeddings`` (what ``Qwen3_5ForConditionalGeneration`` ties by) wins over its
    ``text_config``'s, so that a tied base (the 2B) exports tied."""
    from transformers import Qwen3_5TextConfig

    base = Path(base_dir)
    data = _read_json(base / "config.json", "the base model's config")
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{base / 'config.json'}: model_type {model_type!r} is not a Qwen3.5 model "
            f"(expected one of {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if model_type == "qwen3_5":
        if not isinstance(data.get("text_config"), dict):
            raise CheckpointError(f"{base / 'config.json'}: a qwen3_5 config needs a text_config object")
        top = data
        data = dict(data["text_config"])
        if isinstance(top.get("tie_word_embeddings"), bool):  # the full model ties by its top-level flag
            data["tie_word_embeddings"] = top["tie_word_embeddings"]
    data.pop("model_type", None)
    data.pop("architectures", None)
    try:
        config = Qwen3_5TextConfig(**data)
    except Exception as exc:  # strict config validation raises several types
        raise CheckpointError(f"{base / 'config.json'} is not a valid Qwen3.5 text config: {exc}") from exc
    check_text_config(config, where=str(base / "config.json"))
    return config


def check_text_config(config, *, where: str) -> None:
    """Refuse configs the package does not support, with the reason."""
    if getattr(config, "model_type", None) != "qwen3_5_text":
        raise CheckpointError(f"{where}: unsupported config type {getattr(config, 'model_type', None)!r}; need qwen3_5_text")
    kinds = set(config.layer_types)
    if not kinds <= {"linear_attention", "full_attention"}:
        raise CheckpointError(f"{where}: unsupported layer types {sorted(kinds)}")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise CheckpointError(f"{where}: GDN value heads must be a multiple of key heads")
    if config.num_attention_heads % config.num_key_value_heads:
        raise CheckpointError(f"{where}: attention heads must be a multiple of KV heads")

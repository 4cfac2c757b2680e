"""One model object for an Open-Jev checkpoint: backbone, fp32 scalar head, temperature, chat halves, limits.

Two loaders:

- :func:`load_export` reads a merged export (``open-jev-text-merged/1``), the serving format, or an FP8 export
  (``open-jev-text-merged-fp8/1``), dequantized to the model dtype (what the reference path and every comparison
  read; the fast path's ``fp8`` option then swaps in the export's own e4m3 weights). With ``fp8="all"`` or
  ``"no-gdn"`` it sets the fast path's FP8 projections up on the CPU before the model reaches its device, so the
  device never holds the bf16 weights;
- :func:`load_reference` reads the published package + base directory into the unmerged PEFT model, the
  oracle that export and the fast path are checked against.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from .checkpoint_io import base_weight_files, expected_backbone_shapes, load_tokenizer, read_safetensors_headers, text_key
from .errors import CheckpointError, UsageError
from .manifest import ExportManifest, read_manifest
from .package import check_text_config, read_base_text_config, read_lora_pairs, read_package

SERVED_ALIASES = ("open-jev", "jev-latest")


def check_device(device) -> None:
    """Refuse a device this machine does not have, with a one-line :class:`UsageError` (a ``ValueError``).

    Accepts what the loaders and ``pipeline(device=...)`` accept: None, ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a
    ``torch.device``, a GPU ordinal (``-1`` is the CPU) or a ``device_map`` dict of those. Without this, a CUDA
    device on a machine without CUDA ends deep in torch with ``AssertionError: Torch not compiled with CUDA enabled``.
    """
    if device is None:
        return
    if isinstance(device, dict):
        for value in device.values():
            check_device(value)
        return
    if isinstance(device, bool):
        raise UsageError(f"device must be 'cpu', 'cuda', 'cuda:N' or a GPU index, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            return
        device = f"cuda:{device}"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N'") from None
    if parsed.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
               else "no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)")
        raise UsageError(f"device {str(device)!r} was requested but CUDA is not available on this machine: {why}; "
                         "use device 'cpu' (or leave the device out)")
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise UsageError(f"device {str(device)!r} was requested but this machine has {count} CUDA GPU(s) "
                         f"(cuda:0..cuda:{count - 1})")


class _DropFlashLinearAttentionAdvice(logging.Filter):
    """Drops Transformers' advice to install ``flash-linear-attention``, and nothing else."""

    NEEDLE = "because `flash-linear-attention` is not installed"

    def filter(self, record: logging.LogRecord) -> bool:
        return self.NEEDLE not in record.getMessage()


def quiet_flash_linear_attention_advice() -> None:
    """Filter the one Transformers warning that says to install ``flash-linear-attention`` (idempotent).

    Transformers wraps the Gated DeltaNet kernels of ``modeling_qwen3_5`` with
    ``integrations.hub_kernels.use_kernel_func_from_hub_with_fallback(..., "fla")``; when ``fla`` is missing, the
    first forward logs (``logger.warning_once`` on the ``transformers.integrations.hub_kernels`` logger) that it
    falls back to the PyTorch implementation and to install ``flash-linear-attention`` for speed. That package is
    Triton/CUDA-only and this project never installs it: the CPU runs the reference path (the PyTorch code is the
    right one there) and CUDA runs the fast path's own kernels. So every CPU run printed advice that must not be
    followed. The filter sits on that logger (the warning fires at forward time, long after loading, so a context
    manager around loading would miss it) and matches that message only: every other Transformers warning still
    shows (the ``causal_conv1d`` fallback note is dropped by its own filter, :mod:`hf_openjev.kernel_advice`).
    """
    hub_logger = logging.getLogger("transformers.integrations.hub_kernels")
    if not any(isinstance(f, _DropFlashLinearAttentionAdvice) for f in hub_logger.filters):
        hub_logger.addFilter(_DropFlashLinearAttentionAdvice())
    from .kernel_advice import quiet_causal_conv_advice

    quiet_causal_conv_advice()  # its own filter: the same reason (hf_openjev.kernel_advice)


def resolve_dtype(dtype) -> torch.dtype:
    """``"auto"``/None -> bfloat16 (the checkpoint dtype); strings like ``"float32"`` -> torch dtypes."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise UsageError(f"unknown dtype {dtype!r}; use 'bfloat16', 'float16', 'float32' or 'auto'")
        return resolved
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"dtype must be a torch.dtype or its name, got {dtype!r}")
    return dtype


class JevModel(nn.Module):
    """A Qwen3.5 text backbone plus the Open-Jev scalar head and calibration.

    ``score = head(final_norm(h)[last token].float())`` per candidate; the temperature is applied by the contract.
    """

    def __init__(self, backbone: nn.Module, head: nn.Linear, tokenizer, manifest: ExportManifest, *,
                 method: str, aliases: tuple[str, ...] = ()):
        super().__init__()
        self.backbone = backbone
        self.head = head.float()
        self.tokenizer = tokenizer
        self.manifest = manifest
        self.method = method
        self.aliases = aliases

    # -- what the contract needs -------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self.manifest.model_id

    @property
    def temperature(self) -> float:
        return self.manifest.temperature

    @property
    def max_length(self) -> int:
        return self.manifest.max_length

    @property
    def chat_prefix(self) -> str:
        return self.manifest.chat_prefix

    @property
    def chat_suffix(self) -> str:
        return self.manifest.chat_suffix

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Names a request's ``model`` field may carry (contract §1)."""
        return (self.model_id, *SERVED_ALIASES, *self.aliases)

    @property
    def quantization(self) -> dict | None:
        """The FP8 export's ``quantization`` entry (scheme, layout, modules) when loaded from one, else None. The
        weights are then the export's dequantized ones until the fast path's ``fp8`` option swaps in FP8 modules
        (``hf_openjev.patches.fp8_swap.fp8_modules`` says which are)."""
        return self.manifest.quantization

    @property
    def config(self):
        return self.backbone.config

    @property
    def device(self) -> torch.device:
        return self.backbone.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.embed_tokens.weight.dtype

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added (no BOS)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def to(self, *args, **kwargs):  # the head stays fp32 whatever dtype the backbone is moved to
        super().to(*args, **kwargs)
        self.head.float()
        return self

    @classmethod
    def from_pretrained(cls, path, *, dtype="auto", device=None, device_map=None, fp8="off",
                        **_pipeline_kwargs) -> "JevModel":
        """Entry used by ``transformers.pipeline("jev-decision", model=<export dir>)`` (``fp8`` through its
        ``model_kwargs``: see :func:`load_export`)."""
        target = device if device is not None else device_map
        return load_export(path, dtype=dtype, device=target, fp8=fp8)


def _load_backbone(weights_dir: Path, text_config, *, dtype: torch.dtype, device) -> nn.Module:
    """``Qwen3_5TextModel.from_pretrained`` with every backbone weight required (no silent random init)."""
    from transformers import Qwen3_5TextModel

    quiet_flash_linear_attention_advice()
    _check_weight_shapes(weights_dir, text_config)
    kwargs = {"config": text_config, "dtype": dtype, "output_loading_info": True}
    if device is not None:
        kwargs["device_map"] = str(torch.device(device)) if not isinstance(device, dict) else device
    try:
        backbone, info = Qwen3_5TextModel.from_pretrained(str(weights_dir), **kwargs)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{weights_dir}: cannot load the backbone weights: {exc}") from exc
    missing = [k for k in info.get("missing_keys", []) if not k.endswith("inv_freq")]
    if missing:
        raise CheckpointError(
            f"{weights_dir}: {len(missing)} backbone weights are missing (e.g. {sorted(missing)[:3]}); "
            "the checkpoint is incomplete or not a Qwen3.5 text model"
        )
    return backbone.eval()


def _load_fp8_backbone(export_dir: Path, text_config, *, dtype: torch.dtype, device) -> nn.Module:
    """An FP8 export's backbone with every e4m3 weight dequantized to ``dtype`` (``load_fp8_state_dict``, one
    tensor at a time, straight to ``device``), assigned without a copy by ``from_pretrained(state_dict=...)``. The
    model remembers the export (``attach_fp8_source``) so that the fast path's ``fp8`` option reads its e4m3 bits."""
    from transformers import Qwen3_5TextModel

    from .fp8_scheme import read_fp8_quantization
    from .fp8_state import load_fp8_state_dict
    from .patches.fp8_swap import attach_fp8_source

    quiet_flash_linear_attention_advice()
    _check_weight_shapes(export_dir, text_config)
    target = device if device is not None and not isinstance(device, dict) else "cpu"
    state = load_fp8_state_dict(export_dir, dtype=dtype, device=torch.device(target))
    kwargs = {"config": text_config, "dtype": dtype, "output_loading_info": True, "state_dict": state}
    if isinstance(device, dict):
        kwargs["device_map"] = device
    try:
        backbone, info = Qwen3_5TextModel.from_pretrained(None, **kwargs)
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{export_dir}: cannot load the FP8 backbone weights: {exc}") from exc
    missing = [k for k in info.get("missing_keys", []) if not k.endswith("inv_freq")]
    unexpected = list(info.get("unexpected_keys", []))
    if missing or unexpected:
        raise CheckpointError(f"{export_dir}: the FP8 weights do not fit the model: {len(missing)} missing (e.g. "
                              f"{sorted(missing)[:3]}), {len(unexpected)} unexpected (e.g. {sorted(unexpected)[:3]})")
    attach_fp8_source(backbone, export_dir, read_fp8_quantization(export_dir).modules)
    return backbone.eval()


def _check_weight_shapes(weights_dir: Path, text_config) -> None:
    """Compare the safetensors headers with the shapes ``config.json`` implies (names say which tensor is off)."""

    expected = expected_backbone_shapes(text_config)
    for path in base_weight_files(weights_dir):
        for key, (shape, _) in read_safetensors_headers(path).items():
            name = text_key(key)
            if name in expected and shape != expected[name]:
                raise CheckpointError(
                    f"{path}: tensor {key} has shape {shape} but config.json implies {expected[name]}; "
                    "the weights and config.json do not match"
                )


def _make_head(weight, bias, device) -> nn.Linear:
    weight = torch.as_tensor(weight, dtype=torch.float32).reshape(1, -1)
    head = nn.Linear(weight.shape[1], 1, bias=True, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(torch.as_tensor(bias, dtype=torch.float32).reshape(1))
    if device is not None and not isinstance(device, dict):
        head = head.to(device)
    return head.requires_grad_(False)



def load_export(export_dir: str | Path, *, dtype="auto", device=None, fp8: str = "off",
                manifest: ExportManifest | None = None) -> JevModel:
    """Load a merged export directory (checkpoints.md) into a :class:`JevModel`.

    ``dtype`` is the backbone's dtype (default bfloat16); the head is always fp32. An FP8 export is loaded with
    its e4m3 weights dequantized to ``dtype`` (``model.quantization`` holds its manifest entry); the fast path
    runs FP8 projections only with its ``fp8`` option (opt-in).

    ``fp8`` (``"off"``, ``"all"``, ``"no-gdn"``: the fast path's option,
    :attr:`~hf_openjev.fast_options.FastPathOptions.fp8`) sets the FP8 projections up while loading, so that
    ``device`` never holds the bf16 weights (27B: 26.9 GB on the GPU instead of 51.2): the model is built on the
    CPU, its targeted projections are swapped for ``Fp8Linear`` there, module by module
    (:func:`~hf_openjev.patches.fp8_swap.quantize_model_fp8`: an FP8 export's own e4m3 bits, a bf16 export's
    weights quantized per channel, the bits ``hf-openjev quantize`` writes), and only then is the model moved to
    ``device``. The host holds the bf16 weights meanwhile (RAM the size of the bf16 model), and loading takes
    longer (the CPU dequantizes and checks). Serve it with the same ``fp8`` mode: ``apply_patches`` then swaps
    nothing more (a narrower mode is refused: the bf16 weights are gone). A ``device_map`` dict is refused with
    ``fp8``: the model goes to one device. A :class:`UsageError` (a ``ValueError``) for a bad ``fp8``, before
    anything is read. ``manifest``: the manifest to load with instead of the directory's (the export command's
    verification, before it writes one).
    """
    check_device(device)
    fp8 = _check_load_fp8(fp8, device)
    export_dir = Path(export_dir)
    manifest = read_manifest(export_dir) if manifest is None else manifest
    text_config = _read_export_config(export_dir, fp8=manifest.quantization is not None)
    if len(manifest.head_weight) != text_config.hidden_size:
        raise CheckpointError(
            f"{export_dir}: the head has {len(manifest.head_weight)} inputs but hidden_size is "
            f"{text_config.hidden_size}; the manifest and the weights come from different models"
        )
    tokenizer = load_tokenizer(export_dir)
    load = _load_backbone if manifest.quantization is None else _load_fp8_backbone
    build_on = device if fp8 == "off" else "cpu"  # FP8: the bf16 weights stay on the host
    backbone = load(export_dir, text_config, dtype=resolve_dtype(dtype), device=build_on)
    head = _make_head(manifest.head_weight, manifest.head_bias, build_on)
    model = JevModel(backbone, head, tokenizer, manifest, method="merged")
    if fp8 != "off":
        _swap_fp8_then_move(model, fp8, device)
    return model


def _check_load_fp8(fp8, device) -> str:
    """``fp8`` if it is a mode :func:`load_export` can set up on ``device``; else a one-line :class:`UsageError`."""
    from .fp8_option import check_fp8_mode

    check_fp8_mode(fp8)
    if fp8 != "off" and isinstance(device, dict):
        raise UsageError(f"fp8={fp8!r} loads the model onto one device (built and quantized on the CPU, then moved); "
                         "pass device='cuda:N' instead of a device_map, or leave fp8 'off'")
    return fp8


def _swap_fp8_then_move(model: JevModel, fp8: str, device) -> None:
    """On the CPU, swap ``model``'s projections of mode ``fp8`` for ``Fp8Linear`` (each bf16 weight is freed as its
    FP8 module takes its place), then move the model to ``device`` (None: it stays on the CPU)."""
    from .patches.fp8_swap import quantize_model_fp8

    quantize_model_fp8(model, fp8)
    if device is not None:
        model.to(_torch_device(device))


def _torch_device(device) -> torch.device:
    """What :func:`check_device` accepts (but a dict) as a ``torch.device``: a GPU ordinal is ``cuda:N``, -1 the CPU."""
    if isinstance(device, int):
        return torch.device("cpu") if device < 0 else torch.device(f"cuda:{device}")
    return torch.device(device)


def _read_export_config(export_dir: Path, *, fp8: bool = False):
    """The export's text config; an FP8 export's without its ``quantization_config`` (its weights are dequantized
    here: Transformers must not hand them to compressed-tensors)."""
    from transformers import Qwen3_5TextConfig

    path = export_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; the export is incomplete")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if data.get("model_type") != "qwen3_5_text":
        raise CheckpointError(
            f"{path}: unsupported config model_type {data.get('model_type')!r}; a merged export holds a "
            "qwen3_5_text config"
        )
    try:
        config = Qwen3_5TextConfig.from_pretrained(str(export_dir))
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{path} is not a valid Qwen3.5 text config: {exc}") from exc
    check_text_config(config, where=str(path))
    if getattr(config, "quantization_config", None) is not None:
        if not fp8:
            raise CheckpointError(f"{path} has a quantization_config but the manifest's format is a bf16 export's; "
                                  "the export is inconsistent, re-run `hf-openjev export`")
        del config.quantization_config
    return config


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


def load_reference(base_dir: str | Path, package_dir: str | Path, *, dtype="auto", device=None,
                   max_length: int | None = None) -> JevModel:
    """The published package + base directory as the unmerged PEFT reference model (fp32 adapter on the backbone)."""
    from .chat import render_chat_halves
    from .manifest import check_max_length

    check_device(device)
    base_dir = Path(base_dir)
    package = read_package(package_dir)
    text_config = read_base_text_config(base_dir)
    if package.head_weight.shape[1] != text_config.hidden_size:
        raise CheckpointError(
            f"the head has {package.head_weight.shape[1]} inputs but the base hidden size is {text_config.hidden_size}"
        )
    tokenizer = load_tokenizer(base_dir)
    chat_prefix, chat_suffix = render_chat_halves(tokenizer)
    if max_length is None:
        max_length = int(package.model_info.get("max_length", 4096))
    manifest = ExportManifest(
        model_id=package.model_id,
        base_revision=str(package.model_info.get("base_revision", "")),
        checkpoint_revision=package.revision,
        temperature=package.temperature,
        max_length=check_max_length(max_length),
        chat_prefix=chat_prefix,
        chat_suffix=chat_suffix,
        head_weight=tuple(package.head_weight.flatten().tolist()),
        head_bias=float(package.head_bias[0]),
    )
    backbone = _load_backbone(base_dir, text_config, dtype=resolve_dtype(dtype), device=device)
    peft_backbone = apply_lora_unmerged(backbone, package).eval()
    head = _make_head(package.head_weight, package.head_bias, device)
    return JevModel(peft_backbone, head, tokenizer, manifest, method="peft-unmerged")

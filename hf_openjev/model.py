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

from pathlib import Path

import torch
from torch import nn

from .checkpoint.backbone import load_backbone, make_head, read_export_config
from .checkpoint.files import load_tokenizer
from .checkpoint.manifest import ExportManifest, read_manifest
from .checkpoint.package import read_base_text_config, read_package
from .checkpoint.unmerged_lora import apply_lora_unmerged
from .devices import check_device
from .dtypes import resolve_dtype
from .errors import CheckpointError
from .family import check_family_member, is_test_package, package_names
from .tokenizer.tokenizer_analysis import direct_backend

SERVED_ALIASES = ("open-jev", "jev-latest")


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
        """Names a request's ``model`` field may carry (docs/contract.md §1)."""
        return (self.model_id, *SERVED_ALIASES, *self.aliases)

    @property
    def quantization(self) -> dict | None:
        """The FP8 export's ``quantization`` entry (scheme, layout, modules) when loaded from one, else None. The
        weights are then the export's dequantized ones until the fast path's ``fp8`` option swaps in FP8 modules
        (``hf_openjev.fp8.swap.fp8_modules`` says which are)."""
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
        """Token ids of ``text`` with no special tokens added (no BOS): ``tokenizer(text, add_special_tokens=False)``'s,
        read from its Rust backend directly where that gives the same ids
        (:func:`~hf_openjev.tokenizer.tokenizer_analysis.direct_backend`)."""
        backend = direct_backend(self.tokenizer)
        if backend is not None:  # the batch call without offsets: the same ids, less work (recipes/RESULTS.md, s18)
            return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, as :meth:`encode` gives them, in one batch call (a fast tokenizer runs a batch on
        several threads)."""
        backend = direct_backend(self.tokenizer)
        if backend is not None:
            return [encoding.ids for encoding in backend.encode_batch_fast(list(texts), add_special_tokens=False)]
        return self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]

    def to(self, *args, **kwargs):  # the head stays fp32 whatever dtype the backbone is moved to
        super().to(*args, **kwargs)
        self.head.float()
        return self

    @classmethod
    def from_pretrained(cls, path, *, dtype="auto", device=None, device_map=None, fp8="off",
                        allow_unknown_shape: bool = False, **_pipeline_kwargs) -> "JevModel":
        """Entry used by ``transformers.pipeline("jev-decision", model=<export dir>)`` (``fp8`` and
        ``allow_unknown_shape`` through its ``model_kwargs``: see :func:`load_export`). A bad ``dtype`` name raises
        :class:`~hf_openjev.errors.UnknownDtypeError` at once (a ``ValueError`` would make the pipeline retry in
        float32)."""
        from .errors import UnknownDtypeError

        try:
            resolve_dtype(dtype)  # first: a bad name is refused before anything is read
        except ValueError as exc:
            raise UnknownDtypeError(str(exc)) from None
        target = device if device is not None else device_map
        return load_export(path, dtype=dtype, device=target, fp8=fp8, allow_unknown_shape=allow_unknown_shape)


def load_export(export_dir: str | Path, *, dtype="auto", device=None, fp8: str = "off",
                allow_unknown_shape: bool = False, manifest: ExportManifest | None = None) -> JevModel:
    """Load a merged export directory (docs/checkpoints.md) into a :class:`JevModel`.

    ``dtype`` is the backbone's dtype (default bfloat16); the head is always fp32. An FP8 export is loaded with
    its e4m3 weights dequantized to ``dtype`` (``model.quantization`` holds its manifest entry); the fast path
    runs FP8 projections only with its ``fp8`` option (opt-in).

    ``fp8`` (``"off"``, ``"all"``, ``"no-gdn"``: the fast path's option,
    :attr:`~hf_openjev.fast_options.FastPathOptions.fp8`) sets the FP8 projections up while loading, so that
    ``device`` never holds the bf16 weights (about half of them in bytes; recipes/RESULTS.md): the model is built on the
    CPU, its targeted projections are swapped for ``Fp8Linear`` there, module by module
    (:func:`~hf_openjev.fp8.prepare.prepare_model_for_fp8`: an FP8 export's own e4m3 bits, a bf16 export's
    weights quantized per channel, the bits ``hf-openjev quantize`` writes), and only then is the model moved to
    ``device``. The host holds the bf16 weights meanwhile (RAM the size of the bf16 model), and loading takes
    longer (the CPU dequantizes and checks). Serve it with the same ``fp8`` mode: ``apply_patches`` then swaps
    nothing more (a narrower mode is refused: the bf16 weights are gone). A ``device_map`` dict is refused with
    ``fp8``: the model goes to one device. A :class:`UsageError` (a ``ValueError``) for a bad ``fp8``, before
    anything is read.

    ``manifest``: the manifest to load with instead of the directory's (the export command's verification,
    before it writes one).

    The export's shape must be an Open-Jev model's (:func:`hf_openjev.family.check_family_member`: a
    :class:`CheckpointError` naming the nearest one otherwise); ``allow_unknown_shape=True`` loads any shape.
    """
    from .fp8.prepare import check_fp8_target

    dtype = resolve_dtype(dtype)  # a bad name: one line, before anything is read
    check_device(device)
    fp8 = check_fp8_target(fp8, device)
    export_dir = Path(export_dir)
    manifest = read_manifest(export_dir) if manifest is None else manifest
    text_config = read_export_config(export_dir, fp8=manifest.quantization is not None)
    if len(manifest.head_weight) != text_config.hidden_size:
        raise CheckpointError(
            f"{export_dir}: the head has {len(manifest.head_weight)} inputs but hidden_size is "
            f"{text_config.hidden_size}; the manifest and the weights come from different models"
        )
    check_family_member(text_config, temperature=manifest.temperature, names=[manifest.model_id],
                        test_checkpoint=manifest.test_checkpoint, allow_unknown=allow_unknown_shape,
                        where=str(export_dir))
    tokenizer = load_tokenizer(export_dir)
    build_on = device if fp8 == "off" else "cpu"  # FP8: the bf16 weights stay on the host
    backbone = _load_export_backbone(export_dir, text_config, manifest, dtype=dtype, device=build_on)
    head = make_head(manifest.head_weight, manifest.head_bias, build_on)
    model = JevModel(backbone, head, tokenizer, manifest, method="merged")
    if fp8 != "off":
        from .fp8.prepare import prepare_model_for_fp8

        prepare_model_for_fp8(model, fp8, device)  # swapped on the CPU, then moved
    return model


def _load_export_backbone(export_dir: Path, text_config, manifest: ExportManifest, *, dtype, device) -> nn.Module:
    """The export's backbone: a bf16 export's weights as stored, an FP8 export's dequantized to ``dtype``."""
    if manifest.quantization is None:
        return load_backbone(export_dir, text_config, dtype=dtype, device=device)
    from .fp8.loading import load_fp8_backbone

    return load_fp8_backbone(export_dir, text_config, dtype=dtype, device=device)


def load_reference(base_dir: str | Path, package_dir: str | Path, *, dtype="auto", device=None,
                   max_length: int | None = None, allow_unknown_shape: bool = False) -> JevModel:
    """The published package + base directory as the unmerged PEFT reference model (fp32 adapter on the backbone).
    The base's shape must be an Open-Jev model's, as for :func:`load_export`, unless ``allow_unknown_shape``."""
    from .checkpoint.manifest import check_max_length
    from .tokenizer.chat import render_chat_halves

    check_device(device)
    base_dir = Path(base_dir)
    package = read_package(package_dir)
    text_config = read_base_text_config(base_dir)
    if package.head_weight.shape[1] != text_config.hidden_size:
        raise CheckpointError(
            f"the head has {package.head_weight.shape[1]} inputs but the base hidden size is {text_config.hidden_size}"
        )
    check_family_member(text_config, temperature=package.temperature, names=package_names(package),
                        test_checkpoint=is_test_package(package), allow_unknown=allow_unknown_shape,
                        where=f"{base_dir} with {package_dir}")
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
        test_checkpoint=is_test_package(package),
    )
    backbone = load_backbone(base_dir, text_config, dtype=resolve_dtype(dtype), device=device)
    peft_backbone = apply_lora_unmerged(backbone, package).eval()
    head = make_head(package.head_weight, package.head_bias, device)
    return JevModel(peft_backbone, head, tokenizer, manifest, method="peft-unmerged")

"""``hf-openjev export``: merge the LoRA adapter into a merged checkpoint (``open-jev-text-merged/1``), streaming.

What :func:`merge_lora` writes (docs/checkpoints.md "Merged export"):

- every LoRA-targeted weight becomes ``bf16(W + scale * (B @ A))`` computed in fp32, ``scale = lora_alpha / r``
  (the same arithmetic as PEFT's ``merge_and_unload()`` on a bf16 base with an fp32 adapter);
- every other text-backbone tensor that is bf16 in the base is copied bit for bit. A backbone tensor stored in
  another float dtype (real Qwen3.5 checkpoints keep e.g. ``linear_attn.A_log`` in fp32) is **cast to bf16**,
  because every backbone tensor of an export is bf16 (the same rounding ``from_pretrained(dtype=bfloat16)``
  applies to the base); the report lists those tensors;
- the vision tower (``model.visual.*``), the MTP layers (``mtp.*``) and the LM head (``lm_head.*``) are dropped;
- tensor names carry no prefix (``layers.0.mlp.up_proj.weight``), which is what ``Qwen3_5TextModel`` loads;
- text ``config.json`` (``qwen3_5_text``), shards of at most 5 GB (+ ``model.safetensors.index.json``), the base
  tokenizer files byte for byte, and ``open_jev_export.json`` written last, after the verification (a directory
  without it is no export: no loader accepts an unverified or unfinished one).

Streaming: the base is read one tensor at a time (``safe_open``) and every output tensor is written straight into
its planned output shard (the safetensors header is known up front from the base headers;
:mod:`hf_openjev.export.shard_writer` plans and writes the shards), so the peak host
memory is about the largest single tensor (in fp32 for a merged one) plus the adapter, whatever the shard sizes.
See ``recipes/RESULTS.md`` (export peak host memory) for a measurement.

Safety: every check runs before the first byte is written (missing files, adapter targets/shapes against the
base's safetensors headers, rank/alpha, Qwen3.5 config, head shape and values, temperature, ``max_length``,
base weights against the config, disk space, and the base's identity against the base the package names:
:mod:`hf_openjev.export.identity`, refused on a mismatch unless ``allow_base_mismatch``; the manifest records the
base revision when known and always a fingerprint of the base weights; a ``--base`` holding
``open_jev_export.json``, an export already merged, is refused). The export is built in a temporary directory
beside the target and renamed at the end (:mod:`hf_openjev.checkpoint.publish`); on any failure, ``KeyboardInterrupt``
included, the temporary directory and any parent directories created for the target are removed, and a later run
removes the temporaries of runs that were killed. ``overwrite=True`` replaces only an export (its manifest present)
or an empty directory, and no ``out_dir`` on, above or inside the base or the package is accepted
(:mod:`hf_openjev.checkpoint.out_dir`); the replaced export stays in place until the new one is complete, and is
then exchanged with it in one step (or, where that is unavailable, kept aside until the new one is in place and put
back by the next run if the process dies in between: :mod:`hf_openjev.checkpoint.publish`).

Verification (``verify=True``, the default), before the rename:

a) every merged tensor is compared with PEFT's ``merge_and_unload()`` on the same inputs (per target module: a
   bf16 ``nn.Linear`` holding the base weight, wrapped with a PEFT LoRA holding the same fp32 A/B) and reported
   as bitwise identical or as the largest difference in bf16 ulps; more than one ulp fails the export;
b) the export's tokenizer must render the same chat halves as the base's;
c) score probe: the export (``load_export``) and the unmerged PEFT reference (``load_reference``) are loaded on
   CPU in fp32 and answer :data:`~hf_openjev.export.verify.PROBE_REQUESTS` with ``answer_requests(fast=False)``; max |Δscore| and max |Δp|
   are reported and a |Δp| above ``probe_tolerance`` fails the export. The probe holds two fp32 copies of the
   model, so with ``probe="auto"`` it is skipped (and says so) when the backbone has more than
   ``probe_max_params`` parameters.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.files import (
    FLOAT_DTYPES,
    base_weight_files,
    expected_backbone_shapes,
    load_tokenizer,
    read_safetensors_headers,
    text_key,
)
from ..checkpoint.manifest import MANIFEST_NAME, ExportManifest, check_max_length, write_manifest
from ..checkpoint.out_dir import (
    check_free_space,
    check_outside_inputs,
    check_replaceable,
    missing_parents,
    remove_empty,
)
from ..checkpoint.package import read_base_text_config, read_lora_pairs, read_package
from ..checkpoint.publish import claim_export_temp, put_back_interrupted_swap, put_in_place
from ..checkpoint.safetensors_stream import TORCH_DTYPE, TensorFileReader
from ..errors import GET_CHECKPOINT_DOCS, CheckpointError
from ..family import check_family_member, is_test_package, package_names
from .identity import BaseIdentity, check_base_identity
from .shard_writer import Shard, ShardWriter, check_written_shards, plan_shards, sync_directory
from .verify import ProbeCheck, TensorCheck, bf16_ulp_distance, peft_merge_and_unload, run_probe

MAX_SHARD_BYTES = 5 * 1000**3  # "shards of at most 5 GB" (docs/checkpoints.md); a file's total size, header included
DEFAULT_PROBE_MAX_PARAMS = 500_000_000  # two fp32 copies of the backbone: about 4 GB of host memory
DEFAULT_PROBE_TOLERANCE = 0.01  # max |Δp| between the bf16 export and the unmerged reference (both run in fp32)
PROBE_MODES = ("auto", "on", "off")

_TOKENIZER_FILES = re.compile(r"^(tokenizer.*|special_tokens_map\.json|vocab.*|merges\.txt|added_tokens\.json|"
                              r"chat_template.*)$")
_COPY_CHUNK_BYTES = 64 * 1024**2  # tensors that are copied or cast stream through in pieces of this size

# --------------------------------------------------------------------------------------------------------------
# Small helpers (public where the tests or other commands may want them)



def merge_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``bf16(W + scale * (B @ A))`` computed in fp32 (the same rounding as PEFT's ``merge_and_unload``).

    In place on the fp32 delta (fp32 addition commutes, and bf16 -> fp32 is exact), so the temporaries are one
    fp32 copy of the weight rather than three.
    """
    delta = b.float() @ a.float()
    delta.mul_(scale)
    delta.add_(weight)  # promotes weight to fp32 element-wise: the same value as weight.float() + delta
    return delta.to(torch.bfloat16)


# --------------------------------------------------------------------------------------------------------------
# The plan: everything checked and decided before anything is written


@dataclass(frozen=True)
class _Item:
    source_file: Path
    source_key: str
    name: str  # output name (no prefix)
    shape: tuple[int, ...]
    source_dtype: str  # safetensors dtype string of the base tensor
    module: str | None  # LoRA module merged into this weight, else None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 2  # bf16


@dataclass
class _Plan:
    base_dir: Path
    package_dir: Path
    out_dir: Path
    package: object
    text_config: object
    files: list[Path]
    pairs: dict
    items: list[_Item]
    shards: list[Shard]
    dropped: list[str]
    cast: list[str]
    manifest: ExportManifest
    tokenizer_files: list[Path]
    parameters: int
    identity: BaseIdentity


@dataclass
class ExportReport:
    """What :func:`merge_lora` did. ``os.fspath(report)`` is the export directory."""

    out_dir: Path
    shards: list[tuple[str, int]]  # (file name, bytes on disk)
    tensors: int
    merged: list[str]  # LoRA modules merged
    copied: int  # bf16 tensors copied bit for bit
    cast: list[str]  # non-bf16 base tensors cast to bf16
    dropped: int  # vision / MTP / LM-head tensors not exported
    parameters: int
    tensor_check: TensorCheck = field(default_factory=TensorCheck)
    probe: ProbeCheck = field(default_factory=ProbeCheck)
    verified: bool = False
    seconds: float = 0.0
    identity: BaseIdentity | None = None  # the base check and fingerprint (None: not made by merge_lora)

    def __fspath__(self) -> str:
        return str(self.out_dir)

    def lines(self) -> list[str]:
        total = sum(size for _, size in self.shards)
        out = [
            f"export: {self.out_dir} ({len(self.shards)} shard{'s' if len(self.shards) != 1 else ''}, "
            f"{total / 1e9:.3f} GB, {self.tensors} tensors, {self.parameters / 1e9:.3f} B parameters, "
            f"{self.seconds:.1f} s)",
            f"export: {len(self.merged)} LoRA modules merged, {self.copied} bf16 tensors copied bit for bit, "
            f"{len(self.cast)} non-bf16 tensors cast to bf16, {self.dropped} vision/MTP/LM-head tensors dropped",
        ]
        if self.cast:
            out.append(f"export: cast to bf16 (every backbone tensor of an export is bf16): "
                       f"{', '.join(self.cast[:4])}{' ...' if len(self.cast) > 4 else ''}")
        if self.identity is not None:
            out.extend(self.identity.lines())
        if self.verified:
            out.append(f"verify: {self.tensor_check.describe()}")
            out.extend(f"verify: {line}" for line in self.probe.describe())
        else:
            out.append("verify: off")
        warning = self.identity.warning() if self.identity is not None else None
        if warning:  # last, right under "bitwise identical": those figures say nothing about the base
            out.append(warning)
        return out



def _check_adapter_options(package) -> None:
    """Refuse LoRA variants whose merge is not ``W + alpha/r * B @ A``."""
    where = package.adapter_file.parent / "adapter_config.json"
    cfg = package.adapter_config
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise CheckpointError(f"{where}: peft_type {peft_type!r} is not supported; export merges plain LoRA adapters")
    for key, what in (("use_dora", "DoRA"), ("use_rslora", "rsLoRA scaling"), ("fan_in_fan_out", "fan_in_fan_out")):
        if cfg.get(key):
            raise CheckpointError(f"{where}: {key}=true ({what}) is not supported; Open-Jev adapters are plain LoRA "
                                  "(scale = lora_alpha / r)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise CheckpointError(f"{where}: a non-empty {key} is not supported; every module must use r and "
                                  "lora_alpha from adapter_config.json")
    if cfg.get("bias", "none") not in ("none", None) or cfg.get("lora_bias"):
        raise CheckpointError(f"{where}: LoRA biases are not supported (bias must be 'none')")


def _check_out_dir(out_dir: Path, overwrite: bool, protected: list[Path]) -> None:
    check_outside_inputs(out_dir, protected)
    check_replaceable(out_dir, overwrite)
    parent = out_dir.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise CheckpointError(f"cannot create {out_dir}: {parent} is not a writable directory")


def _check_adapter_against_base(package, pairs: dict, found: dict) -> None:
    """Every adapter module exists in the base, with shapes that fit, finite values, covered by target_modules."""
    adapter_cfg = package.adapter_file.parent / "adapter_config.json"
    targets = package.adapter_config.get("target_modules")
    for module, (a, b) in pairs.items():
        weight_name = f"{module}.weight"
        if weight_name not in found:
            raise CheckpointError(
                f"the adapter targets {module}, which the base model does not have (no {weight_name}); "
                "the adapter was trained on a different base model"
            )
        shape = found[weight_name][2]
        if len(shape) != 2 or a.shape[1] != shape[1] or b.shape[0] != shape[0]:
            raise CheckpointError(
                f"the adapter's {module} has A {list(a.shape)} / B {list(b.shape)} but the base weight is "
                f"{list(shape)} (need A [r, {shape[-1]}] and B [{shape[0]}, r]); the adapter and the base model do "
                "not match"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise CheckpointError(f"the adapter's {module} contains NaN or infinite values; the adapter is corrupt")
        if isinstance(targets, list) and targets:
            if not any(module == t or module.endswith("." + t) for t in targets if isinstance(t, str)):
                raise CheckpointError(f"{adapter_cfg}: target_modules {targets} does not cover {module}, which the "
                                      "adapter weights adapt; the adapter config and weights do not match")


def _check_index(base_dir: Path, headers: dict) -> None:
    """The base's shard index, when it has one, names the shard that holds each tensor."""
    index = base_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        wrong = [k for k, f in weight_map.items() if k not in headers[base_dir / f]]
        if wrong:
            raise CheckpointError(f"{index}: tensors not found in the shard it names, e.g. {wrong[:3]}; "
                                  "the base download is inconsistent")


def _backbone_tensors(base_dir: Path, files: list[Path], headers: dict, expected: dict) -> tuple[dict, list[str]]:
    """``({backbone name: (shard, stored key, shape, dtype)}, stored keys that are not the backbone's)``: exactly
    the backbone ``config.json`` describes, every tensor a float one, no name twice."""
    seen: dict[str, str] = {}
    found: dict[str, tuple[Path, str, tuple[int, ...], str]] = {}
    dropped: list[str] = []
    for path in files:
        for key, (shape, dtype) in headers[path].items():
            name = text_key(key)
            if name is None:
                dropped.append(key)
                continue
            if name in seen:
                raise CheckpointError(f"{base_dir}: tensors {seen[name]!r} and {key!r} both map to backbone weight "
                                      f"{name!r}; the base checkpoint is ambiguous")
            seen[name] = key
            found[name] = (path, key, shape, dtype)
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(f"{base_dir}: {len(missing)} backbone weights required by config.json are missing "
                              f"(e.g. {missing[:3]}); the base weights are incomplete or do not match config.json")
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise CheckpointError(f"{base_dir}: tensors that are not part of the Qwen3.5 text backbone described by "
                              f"config.json: {unexpected[:3]}; the base weights and config.json do not match")
    bad_shapes = [f"{n}: {list(found[n][2])} vs config {list(expected[n])}" for n in expected
                  if found[n][2] != expected[n]]
    if bad_shapes:
        raise CheckpointError(f"{base_dir}: base weights whose shapes do not match config.json: {bad_shapes[:3]}")
    not_float = [f"{n} ({found[n][3]})" for n in found if found[n][3] not in FLOAT_DTYPES]
    if not_float:
        raise CheckpointError(f"{base_dir}: backbone tensors with a non-float dtype cannot be exported: {not_float[:3]}")
    return found, dropped


def _tokenizer_files(base_dir: Path) -> list[Path]:
    """The base's tokenizer files; a :class:`CheckpointError` when it has no tokenizer."""
    tokenizer_files = sorted(p for p in base_dir.iterdir() if p.is_file() and _TOKENIZER_FILES.match(p.name))
    names = {p.name for p in tokenizer_files}
    if "tokenizer.json" not in names and not {"vocab.json", "merges.txt"} <= names:
        raise CheckpointError(f"{base_dir} has no tokenizer (tokenizer.json, or vocab.json + merges.txt, is missing); "
                              "download the base model's tokenizer files")
    return tokenizer_files


def _plan_items(files: list[Path], headers: dict, found: dict, pairs: dict) -> list[_Item]:
    """One item per backbone tensor, in the base's order, with its LoRA module when the adapter targets it."""
    items: list[_Item] = []
    for path in files:
        for key in headers[path]:
            name = text_key(key)
            if name is None:
                continue
            _, _, shape, dtype = found[name]
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            items.append(_Item(path, key, name, shape, dtype, module if module in pairs else None))
    return items
def _check_family(base_dir, package_dir, package, text_config, identity: BaseIdentity, allow_unknown: bool) -> None:
    """The base's shape against the Open-Jev family (:mod:`hf_openjev.family`), with every name the package and the
    base directory give (model id, PEFT's base, ``model.json``'s base, the base's own repo id)."""
    names = package_names(package) + [claim.value for claim in identity.package_names]
    names += [identity.base_name.value] if identity.base_name is not None else []
    check_family_member(text_config, temperature=package.temperature, names=names,
                        test_checkpoint=is_test_package(package), allow_unknown=allow_unknown,
                        where=f"{base_dir} with {package_dir}")


def plan_export(base_dir, package_dir, out_dir, *, max_length: int = 4096, overwrite: bool = False,
                max_shard_bytes: int = MAX_SHARD_BYTES, allow_base_mismatch: bool = False,
                allow_unknown_shape: bool = False) -> _Plan:
    """Every check of the export, without writing anything. Raises :class:`CheckpointError` saying what to fix.

    The base must be the one the package names, where both sides can be read (:mod:`.identity`); a mismatch is
    refused unless ``allow_base_mismatch``. The base's shape must be an Open-Jev model's, consistent with the
    names and temperature the package carries (:mod:`hf_openjev.family`), unless ``allow_unknown_shape``.
    """
    from ..tokenizer.chat import render_chat_halves

    base_dir, package_dir, out_dir = Path(base_dir), Path(package_dir), Path(out_dir)
    check_max_length(max_length)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or not 0 < max_shard_bytes <= MAX_SHARD_BYTES:
        raise CheckpointError(f"the shard size limit must be 1..{MAX_SHARD_BYTES} bytes (5 GB), got {max_shard_bytes!r}")
    if not base_dir.is_dir():
        raise CheckpointError(f"base directory {base_dir} does not exist; pass the Qwen3.5 base model directory "
                              f"the package names ({GET_CHECKPOINT_DOCS})")
    if (base_dir / MANIFEST_NAME).exists():
        raise CheckpointError(f"--base {base_dir} holds {MANIFEST_NAME}: it is a merged export (merging again "
                              "would add the LoRA twice); pass the Qwen3.5 base model directory the package names")
    _check_out_dir(out_dir, overwrite, [base_dir, package_dir])

    package = read_package(package_dir)  # model.json, adapter files, rank/alpha, head shape/values, temperature
    _check_adapter_options(package)
    text_config = read_base_text_config(base_dir)  # Qwen3.5 config
    files = base_weight_files(base_dir)
    identity = check_base_identity(base_dir, package, files, allow_mismatch=allow_base_mismatch)
    hidden = text_config.hidden_size
    if tuple(package.head_weight.shape) != (1, hidden):
        raise CheckpointError(
            f"{package.checkpoint_dir / 'head.pt'}: head weight has shape {list(package.head_weight.shape)} but the "
            f"base's hidden size is {hidden} (need [1, {hidden}]); the package and the base model do not match"
        )
    _check_family(base_dir, package_dir, package, text_config, identity, allow_unknown_shape)

    headers = {path: read_safetensors_headers(path) for path in files}
    _check_index(base_dir, headers)
    found, dropped = _backbone_tensors(base_dir, files, headers, expected_backbone_shapes(text_config))

    pairs = read_lora_pairs(package)  # A/B present, shapes match r
    _check_adapter_against_base(package, pairs, found)

    tokenizer_files = _tokenizer_files(base_dir)
    tokenizer = load_tokenizer(base_dir)
    chat_prefix, chat_suffix = render_chat_halves(tokenizer)

    items = _plan_items(files, headers, found, pairs)
    shards = plan_shards(items, max_shard_bytes)

    check_free_space(out_dir, sum(item.nbytes for item in items), "the export")

    manifest = ExportManifest(
        model_id=package.model_id,
        base_revision=identity.revision,
        base_fingerprint=identity.fingerprint,
        checkpoint_revision=package.revision,
        temperature=package.temperature,
        max_length=max_length,
        chat_prefix=chat_prefix,
        chat_suffix=chat_suffix,
        head_weight=tuple(float(v) for v in package.head_weight.flatten().tolist()),
        head_bias=float(package.head_bias[0]),
        test_checkpoint=is_test_package(package),
    )
    return _Plan(base_dir=base_dir, package_dir=package_dir, out_dir=out_dir, package=package,
                 text_config=text_config, files=files, pairs=pairs, items=items, shards=shards, dropped=dropped,
                 cast=[item.name for item in items if item.module is None and item.source_dtype != "BF16"],
                 manifest=manifest, tokenizer_files=tokenizer_files,
                 parameters=sum(math.prod(item.shape) for item in items), identity=identity)


# --------------------------------------------------------------------------------------------------------------
# Writing: the merge streamed into the shard writer (:mod:`.shard_writer` writes the files)


def _bf16_pieces(reader: TensorFileReader, key: str):
    """Tensor ``key`` as flat bf16 pieces of at most ``_COPY_CHUNK_BYTES`` read at a time (bf16 data is not
    converted, so it is copied bit for bit; other float dtypes are cast element by element)."""
    dtype = TORCH_DTYPE[reader.entries[key][0]]
    for piece in reader.pieces(key, _COPY_CHUNK_BYTES):
        yield piece.view(dtype) if dtype == torch.bfloat16 else piece.view(dtype).to(torch.bfloat16)


def _stream_file(path: Path, items: list[_Item], plan: _Plan, writer: ShardWriter,
                 check: TensorCheck | None) -> None:
    """Merge / copy / cast the planned tensors of one base shard into the writer.

    A LoRA target is read whole (the merge needs the whole matrix); every other tensor streams through in
    pieces of at most ``_COPY_CHUNK_BYTES``, so the peak memory is set by the largest merged weight, not by the
    embedding or the shard.
    """
    package = plan.package
    with TensorFileReader(path) as reader:  # plain reads: a memory map would keep every touched page resident
        for item in items:
            if item.module is None:
                writer.write(item.name, _bf16_pieces(reader, item.source_key))
                continue
            weight = reader.tensor(item.source_key)
            a, b = plan.pairs[item.module]
            merged = merge_weight(weight, a, b, package.lora_scale)
            if not torch.isfinite(merged).all():
                raise CheckpointError(f"merging {item.module} produced NaN or infinite values; the base weight "
                                      "or the adapter is corrupt")
            if check is not None:
                reference = peft_merge_and_unload(weight, a, b, rank=package.lora_rank,
                                                  alpha=package.lora_alpha).to(torch.bfloat16)
                ulp = bf16_ulp_distance(merged, reference)
                check.modules += 1
                check.bitwise += ulp == 0
                if ulp > check.max_ulp:
                    check.max_ulp, check.worst_module = ulp, item.module
                del reference
            del weight
            writer.write(item.name, merged)
            del merged


def _write_text_files(plan: _Plan, tmp: Path) -> None:
    config = plan.text_config
    config.architectures = ["Qwen3_5TextModel"]
    config.dtype = torch.bfloat16
    config.to_json_file(str(tmp / "config.json"))
    for path in plan.tokenizer_files:
        shutil.copyfile(path, tmp / path.name)


def _check_tokenizer(plan: _Plan, tmp: Path) -> None:
    from ..tokenizer.chat import render_chat_halves

    halves = render_chat_halves(load_tokenizer(tmp))
    if halves != (plan.manifest.chat_prefix, plan.manifest.chat_suffix):
        raise CheckpointError("verification failed: the exported tokenizer renders different chat halves than the base")


def _stream_shards(plan: _Plan, writer: ShardWriter, check, progress: bool) -> None:
    """Every base shard, in order, through the merge into ``writer`` (``check``: each merged tensor against PEFT's
    merge, or None)."""
    by_file: dict[Path, list[_Item]] = {}
    for item in plan.items:
        by_file.setdefault(item.source_file, []).append(item)
    from tqdm import tqdm

    with tqdm(plan.files, desc="export: merging shards", unit="shard", disable=not progress,
              file=sys.stderr) as bar:
        for path in bar:
            bar.set_postfix_str(path.name)
            _stream_file(path, by_file.get(path, []), plan, writer, check)


def _probe_check(plan: _Plan, tmp: Path, probe: str, probe_max_params: int, probe_tolerance: float,
                 say: Callable[[str], None]) -> ProbeCheck:
    """The score probe of the export written at ``tmp`` (or why it was skipped); a :class:`CheckpointError` when
    it fails."""
    if probe == "off":
        return ProbeCheck(skipped_reason="turned off (--probe off)")
    if probe == "auto" and plan.parameters > probe_max_params:
        need = 2 * 4 * plan.parameters / 1e9
        return ProbeCheck(skipped_reason=(
            f"the backbone has {plan.parameters / 1e9:.2f} B parameters, more than the "
            f"{probe_max_params / 1e9:.2f} B limit of the CPU fp32 probe (it would hold two fp32 copies, "
            f"about {need:.1f} GB); pass --probe on to run it anyway, or compare the export with the "
            "reference on a GPU"))
    say("verify: score probe: loading the export and the unmerged reference on CPU in fp32 ...")
    try:
        probe_check = run_probe(tmp, plan.base_dir, plan.package_dir, manifest=plan.manifest)
    except CheckpointError as exc:
        raise CheckpointError(f"verification failed: the score probe could not load a model: {exc}") from exc
    except Exception as exc:  # report any probe failure as a failed verification
        raise CheckpointError(f"verification failed: the score probe raised {type(exc).__name__}: {exc}; "
                              "rerun with --probe off to export without it") from exc
    if not probe_check.same_tokens_max_abs_dp <= probe_tolerance:
        raise CheckpointError(
            f"verification failed: on the same token ids the export's probabilities differ from the "
            f"unmerged reference by {probe_check.same_tokens_max_abs_dp:.3e} (> {probe_tolerance}); "
            "the merged weights are wrong")
    return probe_check


def merge_lora(base_dir, package_dir, out_dir, *, max_length: int = 4096, overwrite: bool = False,
               verify: bool = True, probe: str = "auto", probe_max_params: int = DEFAULT_PROBE_MAX_PARAMS,
               probe_tolerance: float = DEFAULT_PROBE_TOLERANCE, progress: bool = True,
               max_shard_bytes: int = MAX_SHARD_BYTES, log: Callable[[str], None] | None = None,
               allow_base_mismatch: bool = False, allow_unknown_shape: bool = False) -> ExportReport:
    """Merge the package's LoRA adapter into the base and write a merged export at ``out_dir``.

    See the module docstring for what is written, checked and verified. ``probe`` is ``"auto"`` (run the score
    probe when the backbone has at most ``probe_max_params`` parameters), ``"on"`` or ``"off"``; it only applies
    with ``verify=True``. ``allow_base_mismatch`` exports even when the package names another base than
    ``base_dir`` (:mod:`.identity`; the report then warns). ``allow_unknown_shape`` exports a shape that is no
    Open-Jev model's (:mod:`hf_openjev.family`). ``log`` receives progress notes (e.g. ``print``).
    The export directory gets the usual permissions (``0o777`` minus the umask). Returns an :class:`ExportReport`
    (``os.fspath(report)`` is ``out_dir``). Raises :class:`CheckpointError` on bad inputs (nothing is written)
    and on a failed verification (nothing is left behind).
    """
    if probe not in PROBE_MODES:
        raise CheckpointError(f"probe must be one of {', '.join(PROBE_MODES)}, got {probe!r}")
    say = log or (lambda _message: None)
    start = time.perf_counter()
    put_back_interrupted_swap(Path(out_dir), say=say, what="export")  # a killed --overwrite's old export, first
    plan = plan_export(base_dir, package_dir, out_dir, max_length=max_length, overwrite=overwrite,
                       max_shard_bytes=max_shard_bytes, allow_base_mismatch=allow_base_mismatch,
                       allow_unknown_shape=allow_unknown_shape)
    out_dir = plan.out_dir
    report = ExportReport(out_dir=out_dir, shards=[], tensors=len(plan.items), merged=sorted(plan.pairs),
                          copied=sum(1 for i in plan.items if i.module is None and i.source_dtype == "BF16"),
                          cast=plan.cast, dropped=len(plan.dropped), parameters=plan.parameters, verified=verify,
                          identity=plan.identity)
    if plan.identity.warning():
        say(plan.identity.warning())

    created = missing_parents(out_dir)
    claim = None
    finished = False
    writer = None
    try:
        claim = claim_export_temp(out_dir, say=say, what="export")
        tmp = claim.path
        writer = ShardWriter(tmp, plan.shards)
        check = report.tensor_check
        say(f"export: {len(plan.items)} tensors from {len(plan.files)} base shard(s) into {len(plan.shards)} "
            f"output shard(s) in {tmp}" + (" (each merged tensor checked against PEFT)" if verify else ""))
        _stream_shards(plan, writer, check if verify else None, progress)
        report.shards = writer.finish()
        if verify and check.max_ulp > 1:
            raise CheckpointError(f"verification failed: merged {check.worst_module} differs from PEFT's "
                                  f"merge_and_unload() by {check.max_ulp} bf16 ulp (at most 1 is accepted)")
        _write_text_files(plan, tmp)
        check_written_shards(plan.shards, tmp, max_shard_bytes)
        sync_directory(tmp)

        if verify:
            _check_tokenizer(plan, tmp)
            report.probe = _probe_check(plan, tmp, probe, probe_max_params, probe_tolerance, say)

        write_manifest(tmp, plan.manifest)  # only now, verified: an unfinished directory is no export
        sync_directory(tmp)
        put_in_place(claim, out_dir, overwrite=overwrite, refuse=lambda: CheckpointError(
            f"{out_dir} appeared while exporting; pass --overwrite to replace it"))
        finished = True
        sync_directory(out_dir.parent)
    except BaseException:
        if writer is not None:
            writer.abort()
        if not finished and claim is not None:
            claim.discard()
        if not finished:
            remove_empty(created)
        raise
    report.seconds = time.perf_counter() - start
    return report

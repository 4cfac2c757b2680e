"""The FP8 export scheme: which modules are quantized, the format string, and the two JSON blocks an FP8 export
carries (``quantization_config`` in ``config.json``, ``quantization`` in ``open_jev_export.json``).

An FP8 export (``open-jev-text-merged-fp8/1``, written by :func:`hf_openjev.fp8.quantize.quantize_export`) is a merged
export whose large projections are stored in compressed-tensors' FP8 "dynamic" layout:

    <module>.weight        F8_E4M3 [N, K]   (float8_e4m3fn)
    <module>.weight_scale  F32     [N, 1]   one scale per output channel: weight ~= weight.float() * weight_scale
    activations            quantized at run time, one e4m3 scale per token (``hf_openjev.ops.fp8_linear``)

Every other tensor is the source export's, bit for bit (bf16). The head, embeddings, norms, the Gated DeltaNet's
small projections (``in_proj_a``, ``in_proj_b``), conv1d, ``A_log`` and ``dt_bias`` are never quantized
(docs/design.md). The manifest's format differs from ``open-jev-text-merged/1`` on purpose: that format promises bf16
weights, so a reader that does not know FP8 (an older ``read_manifest``, the native server) refuses the directory
instead of misreading it.

Leaf module (json, re, pathlib; errors and json_files): the export writes these blocks, the loaders read them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

FP8_EXPORT_FORMAT = "open-jev-text-merged-fp8/1"
SOURCE_FORMAT = "open-jev-text-merged/1"
FP8_SCHEME = "fp8-dynamic"  # e4m3 weights with per-channel fp32 scales; e4m3 activations, per token, dynamic
FP8_LAYOUT = "compressed-tensors/float-quantized"

# module-name suffixes, by group; a target is a group name or one of these suffixes
TARGET_GROUPS: dict[str, tuple[str, ...]] = {
    "mlp": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "gdn": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"),
}
ALL_TARGETS = ("mlp", "attention", "gdn")  # every projection the scheme allows
GDN_IN_BF16 = ("mlp", "attention")  # the Gated DeltaNet's projections kept in bf16
QUANTIZABLE = tuple(s for group in TARGET_GROUPS.values() for s in group)
# the fast path's ``fp8`` option (FastPathOptions.fp8): which groups its FP8 modules cover; "off": none
FP8_MODES: dict[str, tuple[str, ...]] = {"off": (), "all": ALL_TARGETS, "no-gdn": GDN_IN_BF16}
NEVER_QUANTIZED_LINEARS = ("linear_attn.in_proj_a", "linear_attn.in_proj_b")  # Linear modules that stay bf16

_WEIGHT_ARGS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
                "group_size": None, "block_structure": None, "actorder": None}
_INPUT_ARGS = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True,
               "group_size": None, "block_structure": None, "actorder": None}


def resolve_targets(targets: Iterable[str] | str) -> tuple[str, ...]:
    """Group names (``mlp``, ``attention``, ``gdn``) and/or module suffixes (``mlp.down_proj``) -> the module
    suffixes to quantize, in :data:`QUANTIZABLE` order. Raises :class:`CheckpointError` for anything else."""
    if isinstance(targets, str):
        targets = (targets,)
    chosen: set[str] = set()
    for target in targets:
        if target in TARGET_GROUPS:
            chosen.update(TARGET_GROUPS[target])
        elif target in QUANTIZABLE:
            chosen.add(target)
        elif any(target == s or target.endswith("." + s) or s.endswith("." + target)
                 for s in NEVER_QUANTIZED_LINEARS):
            raise CheckpointError(f"FP8 target {target!r}: the Gated DeltaNet's small projections (in_proj_a, in_proj_b) "
                                  "stay in bf16, as the head, embeddings, norms and conv do (docs/design.md)")
        else:
            raise CheckpointError(f"unknown FP8 target {target!r}; use groups {', '.join(TARGET_GROUPS)} or module "
                                  f"names {', '.join(QUANTIZABLE)}")
    if not chosen:
        raise CheckpointError("no FP8 targets given; e.g. targets=('mlp', 'attention', 'gdn')")
    return tuple(s for s in QUANTIZABLE if s in chosen)


def resolve_fp8_targets(targets: Iterable[str] | str) -> tuple[str, ...]:
    """Like :func:`resolve_targets`, and a mode of :data:`FP8_MODES` (``"all"``, ``"no-gdn"``) stands for its
    groups; ``"off"`` -> ``()``."""
    if isinstance(targets, str) and targets in FP8_MODES:
        return resolve_targets(FP8_MODES[targets]) if FP8_MODES[targets] else ()
    return resolve_targets(targets)


def target_of(tensor_name: str, modules: Iterable[str]) -> str | None:
    """The suffix in ``modules`` whose ``.weight`` ``tensor_name`` is (any prefix: ``layers.0.``,
    ``model.language_model.layers.0.``), else None."""
    if not tensor_name.endswith(".weight"):
        return None
    module = tensor_name[: -len(".weight")]
    return next((s for s in modules if module == s or module.endswith("." + s)), None)


def _regex(suffix: str) -> str:
    """compressed-tensors matches ``re:`` targets with ``re.match`` against module names (any prefix)."""
    return "re:.*" + re.escape("." + suffix) + "$"


def quantization_config(modules: Iterable[str]) -> dict:
    """The ``quantization_config`` block of ``config.json`` (compressed-tensors, FP8 dynamic, one config group):
    targets = a regex per quantized module kind; ignore = the Linear modules left in bf16 (vLLM needs every Linear
    either targeted or ignored)."""
    modules = tuple(modules)
    kept = [s for s in QUANTIZABLE if s not in modules] + list(NEVER_QUANTIZED_LINEARS)
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": [_regex(s) for s in modules], "weights": dict(_WEIGHT_ARGS),
                                      "input_activations": dict(_INPUT_ARGS), "output_activations": None,
                                      "format": "float-quantized"}},
        "ignore": [_regex(s) for s in kept],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def manifest_block(modules: Iterable[str], quantized_weights: int) -> dict:
    """The ``quantization`` entry of an FP8 export's manifest."""
    return {"scheme": FP8_SCHEME, "layout": FP8_LAYOUT, "modules": list(modules),
            "quantized_weights": int(quantized_weights), "source_format": SOURCE_FORMAT}


@dataclass(frozen=True)
class Fp8Quantization:
    """What an FP8 export says about itself (manifest ``quantization`` + ``config.json`` ``quantization_config``)."""

    modules: tuple[str, ...]  # quantized module suffixes, e.g. ("mlp.gate_proj", ...)
    quantized_weights: int  # how many ``<module>.weight`` tensors are e4m3
    config: dict  # config.json's quantization_config, as written


def manifest_format(export_dir: str | Path) -> str | None:
    """The ``format`` of ``<export_dir>/open_jev_export.json``, or None when there is no readable manifest."""
    try:
        data = json.loads((Path(export_dir) / "open_jev_export.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get("format") if isinstance(data, dict) else None


def read_fp8_quantization(export_dir: str | Path) -> Fp8Quantization:
    """Read and cross-check an FP8 export's two blocks. Raises :class:`CheckpointError` saying what is wrong."""
    from ..json_files import read_json_object

    export_dir = Path(export_dir)
    manifest = read_json_object(export_dir / "open_jev_export.json", "the export manifest")
    if manifest.get("format") != FP8_EXPORT_FORMAT:
        raise CheckpointError(f"{export_dir} is not an FP8 export (manifest format {manifest.get('format')!r}, "
                              f"not {FP8_EXPORT_FORMAT!r})")
    block = manifest.get("quantization")
    if not isinstance(block, dict) or block.get("scheme") != FP8_SCHEME or block.get("layout") != FP8_LAYOUT:
        raise CheckpointError(f"{export_dir}: the manifest's quantization entry is missing or not {FP8_SCHEME!r} in "
                              f"the {FP8_LAYOUT!r} layout; re-run the FP8 export")
    modules = resolve_targets(block.get("modules") or ())
    if list(modules) != list(block["modules"]):
        raise CheckpointError(f"{export_dir}: the manifest's quantized modules {block['modules']} are not in "
                              "canonical order; the manifest was edited")
    config = read_json_object(export_dir / "config.json", "the model config").get("quantization_config")
    if config != quantization_config(modules):
        raise CheckpointError(f"{export_dir}: config.json's quantization_config does not match the manifest's "
                              f"modules {list(modules)}; the export is inconsistent, re-run the FP8 export")
    count = block.get("quantized_weights")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise CheckpointError(f"{export_dir}: the manifest's quantized_weights must be a positive integer")
    return Fp8Quantization(modules=modules, quantized_weights=count, config=config)

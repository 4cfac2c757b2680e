"""The configurations ``hf-openjev fidelity`` judges: named fast-path setups or FastPathOptions JSON files.

``B`` (the reference path in bf16, the gate's yardstick) always runs. Names: ``default`` (the fast path's
defaults for the model judged: its family member's, :func:`~hf_openjev.fast_options.options_for`), ``packed`` (at
2B, candidates packed: the package's defaults, which the 2B's own replace), ``aligned`` (prefixes shared only up to
a multiple of 64 tokens), ``fp8-all`` and ``fp8-no-gdn`` (FP8 projections), and ``B1``: the reference path again,
one candidate per forward (no padding). B1 is no fast-path configuration but a measure of the gate itself: it
differs from B only in how bf16 rounds (other GEMM shapes), so its flips against B's say how many flips rounding
alone moves on these weights. A path ending in ``.json`` holds one object of
:class:`~hf_openjev.fast_options.FastPathOptions` names and values; the configuration is named after the file's
stem. Each configuration's options are changes over the model's defaults (:func:`options_of`, once it has loaded).
Pure Python: checked before anything loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..fast_options import PACKED_2B, FastPathOptions, options_for

REFERENCE = "B"
REFERENCE_ONE_BY_ONE = "B1"  # the reference path, one candidate per forward: parsed to None (no fast-path options)
NAMED_CONFIGS = {"default": {}, "packed": PACKED_2B, "aligned": {"share_tails": False}, "fp8-all": {"fp8": "all"},
                 "fp8-no-gdn": {"fp8": "no-gdn"}}


def parse_configs(spec: str | list[str]) -> dict[str, dict | None]:
    """``"default,aligned,opts.json"`` (or a list of those) -> {name: the options it changes (a mapping, checked), or
    None for ``B1``}, in the order given; a one-line ValueError for an unknown name, an unreadable file or a bad
    option. :func:`options_of` makes them a model's options."""
    parts = [p.strip() for p in (spec.split(",") if isinstance(spec, str) else spec) if p and p.strip()]
    configs: dict[str, dict | None] = {}
    for part in parts:
        if part.endswith(".json"):
            name, options = _read_options_file(Path(part))
        elif part in NAMED_CONFIGS:
            name, options = part, dict(NAMED_CONFIGS[part])
        elif part == REFERENCE_ONE_BY_ONE:
            name, options = part, None
        else:
            raise ValueError(f"unknown configuration {part!r}: use {', '.join(NAMED_CONFIGS)}, "
                             f"{REFERENCE_ONE_BY_ONE} or a FastPathOptions .json file")
        if name == REFERENCE or name in configs:
            why = "reserved for the reference path" if name == REFERENCE else "given twice"
            raise ValueError(f"configuration name {name!r} is {why}; rename the file")
        configs[name] = options
    return configs


def options_of(changes: dict | None, config) -> FastPathOptions | None:
    """A parsed configuration's options for the model of ``config``: ``changes`` over its defaults (None: ``B1``)."""
    return None if changes is None else options_for(config, changes)


def _read_options_file(path: Path) -> tuple[str, dict]:
    try:
        mapping = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such options file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON object of fast-path options ({exc})") from None
    try:
        FastPathOptions.from_mapping(mapping)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return path.stem, dict(mapping)


def fp8_mode(options: FastPathOptions | None) -> str:
    """The FP8 mode a configuration needs its model loaded with ("off": the bf16 model serves it)."""
    return "off" if options is None else options.fp8


def describe_options(options: FastPathOptions | None) -> dict:
    """What the report records of a configuration: its options that differ from the defaults (B1: the reference
    path's batch)."""
    return {"reference_path": "one candidate per forward"} if options is None else options.to_dict(changed_only=True)

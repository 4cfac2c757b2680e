"""Tests for hf_openjev.export / hf_openjev.export.cli (issue 3) on tiny checkpoints built in the test.

The base and the published-style package come from ``write_tiny_base_and_package`` (a full Qwen3.5-style base with
weights under ``model.language_model.``, a vision tensor, an MTP tensor and ``lm_head``; a random fp32 LoRA on the
published target modules; a random head). Expected values are computed here from the raw files, not through the
export code.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hf_openjev.checkpoint.publish as publish
import hf_openjev.export.merge as export_mod
import hf_openjev.export.shard_writer as shard_writer
from hf_openjev.checkpoint.tiny import TINY_MODEL_ID, write_tiny_base_and_package
from hf_openjev.errors import CheckpointError
from hf_openjev.export.merge import merge_lora
from hf_openjev.export.verify import PROBE_REQUESTS, bf16_ulp_distance

PUBLISHED = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "linear_attn": ("in_proj_qkv", "out_proj")}
PREFIX = "<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
FIGURES = re.compile(r"max \|Δscore\| = ([0-9.e+-]+|nan), max \|Δp\| = ([0-9.e+-]+|nan)")


# ---------------------------------------------------------------------------------------------------------------
# fixtures and helpers


class Src:
    def __init__(self, root: Path):
        self.root = root
        self.base = root / "base"
        self.package = root / "package"
        self.ckpt = self.package / "checkpoint"
        self.adapter = self.ckpt / "adapter" / "adapter_model.safetensors"
        self.adapter_config = self.ckpt / "adapter" / "adapter_config.json"


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Src:
    root = tmp_path_factory.mktemp("export_src")
    write_tiny_base_and_package(root, seed=7)
    return Src(root)


@pytest.fixture(scope="module")
def exported(src, tmp_path_factory):
    """The default export (one shard, verification with the score probe)."""
    out = tmp_path_factory.mktemp("export_out") / "export"
    report = merge_lora(src.base, src.package, out, progress=False)
    return out, report


@pytest.fixture(scope="module")
def sharded(src, tmp_path_factory):
    """The same export split into many small shards, copying through odd-sized pieces (no verification)."""
    out = tmp_path_factory.mktemp("export_sharded") / "export"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export_mod, "_COPY_CHUNK_BYTES", 998)  # 499 bf16 values: most tensors take several reads
        report = merge_lora(src.base, src.package, out, progress=False, verify=False, max_shard_bytes=20_000)
    return out, report


def read_dir_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                assert key not in out, f"{key} is stored twice"
                out[key] = handle.get_tensor(key)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype == torch.bfloat16, t.dtype
    return t.contiguous().view(torch.int16)


def lora_modules(src: Src) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"layers.3.self_attn.q_proj": (A, B)}`` read straight from the adapter file."""
    raw = load_file(str(src.adapter))
    out = {}
    for key, value in raw.items():
        module, half = re.match(r"base_model\.model\.model\.language_model\.(.+)\.lora_([AB])\.weight$", key).groups()
        out.setdefault(module, {})[half] = value
    return {m: (ab["A"], ab["B"]) for m, ab in out.items()}


def no_leftovers(parent: Path, expected: set[str]) -> None:
    assert set(os.listdir(parent)) == expected, f"left behind: {set(os.listdir(parent)) - expected}"


# ---------------------------------------------------------------------------------------------------------------
# what the export writes


def test_merged_tensors_equal_an_independent_fp32_computation(src, exported):
    out, report = exported
    base = load_file(str(src.base / "model.safetensors"))
    cfg = json.loads(src.adapter_config.read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    assert scale == 2.0
    modules = lora_modules(src)
    text_config = json.loads((src.base / "config.json").read_text())["text_config"]
    expected_modules = set()
    for i, kind in enumerate(text_config["layer_types"]):
        block = "self_attn" if kind == "full_attention" else "linear_attn"
        expected_modules |= {f"layers.{i}.{block}.{leaf}" for leaf in PUBLISHED[block]}
    assert set(modules) == expected_modules and len(modules) == 10
    assert sorted(report.merged) == sorted(modules)
    merged = read_dir_tensors(out)
    for module, (a, b) in modules.items():
        w = base[f"model.language_model.{module}.weight"]
        want = (w.to(torch.float32) + torch.matmul(b.double(), a.double()).float() * scale).to(torch.bfloat16)
        got = merged[f"{module}.weight"]
        # Float64 B@A rounds to the fp32 product except in rare last-bit cases; allow that one bf16 ulp there only.
        assert bf16_ulp_distance(got, want) <= 1, module
        exact = (w.float() + (b.float() @ a.float()) * scale).to(torch.bfloat16)
        assert torch.equal(bits(got), bits(exact)), module
        assert not torch.equal(bits(got), bits(w)), f"{module} was not changed by the merge"


def test_merged_tensors_equal_peft_merge_and_unload_on_the_whole_model(src, exported):
    """PEFT's own merge of the reference model (bf16 base + fp32 adapter) gives the export's tensors."""
    from hf_openjev.model import load_reference

    out, report = exported
    reference = load_reference(src.base, src.package, dtype="bfloat16", device="cpu")
    peft_merged = reference.backbone.merge_and_unload().state_dict()
    exported_tensors = read_dir_tensors(out)
    assert set(peft_merged) == set(exported_tensors)
    worst = max(bf16_ulp_distance(exported_tensors[k], v) for k, v in peft_merged.items())
    assert worst == 0, f"export differs from PEFT merge_and_unload by {worst} bf16 ulp"
    check = report.tensor_check
    assert (check.modules, check.bitwise, check.max_ulp) == (10, 10, 0)
    assert "bitwise identical" in check.describe()


def test_other_tensors_copied_bit_for_bit_and_dropped_keys_absent(src, exported):
    out, report = exported
    base = load_file(str(src.base / "model.safetensors"))
    merged = read_dir_tensors(out)
    targets = {f"{m}.weight" for m in lora_modules(src)}
    text = {k[len("model.language_model."):]: v for k, v in base.items() if k.startswith("model.language_model.")}
    assert set(merged) == set(text), "export keys must be the unprefixed backbone names"
    for name, value in text.items():
        assert merged[name].dtype == torch.bfloat16
        if name not in targets:
            assert torch.equal(bits(merged[name]), bits(value)), name
    dropped = {k for k in base if not k.startswith("model.language_model.")}
    assert dropped == {"model.visual.patch_embed.proj.weight", "mtp.fc.weight", "lm_head.weight"}
    assert not any(k.startswith(("visual", "model.", "mtp", "lm_head")) for k in merged)
    assert report.dropped == 3 and report.copied == len(text) - 10 and report.cast == []


def test_manifest_fields_and_written_last(src, exported):
    out, _ = exported
    manifest = json.loads((out / "open_jev_export.json").read_text(encoding="utf-8"))
    model_info = json.loads((src.ckpt / "model.json").read_text())
    head = torch.load(src.ckpt / "head.pt", weights_only=True)
    assert manifest["format"] == "open-jev-text-merged/1"
    assert manifest["model_id"] == model_info["model_id"] == TINY_MODEL_ID
    assert manifest["checkpoint_revision"] == model_info["revision"] == "tiny-seed7"
    assert manifest["base_revision"] == ""
    assert manifest["temperature"] == json.loads((src.ckpt / "temperature.json").read_text())["temperature"]
    assert isinstance(manifest["temperature"], float)
    assert manifest["max_length"] == 4096
    assert manifest["chat_prefix"] == PREFIX
    assert manifest["chat_suffix"] == SUFFIX
    assert manifest["head_weight"] == head["weight"].flatten().tolist() and len(manifest["head_weight"]) == 64
    assert manifest["head_bias"] == float(head["bias"][0])
    last = (out / "open_jev_export.json").stat().st_mtime_ns
    assert all(p.stat().st_mtime_ns <= last for p in out.iterdir())


def test_manifest_is_the_last_file_written(src, tmp_path, monkeypatch):
    original = export_mod.write_manifest
    listing = []

    def spy(directory, manifest):
        listing.append(sorted(os.listdir(directory)))
        return original(directory, manifest)

    monkeypatch.setattr(export_mod, "write_manifest", spy)
    out = tmp_path / "export"
    merge_lora(src.base, src.package, out, progress=False, verify=False, max_shard_bytes=50_000)
    assert len(listing) == 1
    before = listing[0]
    assert "config.json" in before and "tokenizer.json" in before and "model.safetensors.index.json" in before
    assert sorted(os.listdir(out)) == sorted(before + ["open_jev_export.json"])


def test_config_and_tokenizer_files(src, exported):
    out, _ = exported
    config = json.loads((out / "config.json").read_text())
    base_text = json.loads((src.base / "config.json").read_text())["text_config"]
    assert config["model_type"] == "qwen3_5_text"
    assert config["architectures"] == ["Qwen3_5TextModel"]
    assert config["dtype"] == "bfloat16"
    for key in ("hidden_size", "num_hidden_layers", "layer_types", "vocab_size", "linear_num_value_heads", "head_dim"):
        assert config[key] == base_text[key], key
    tokenizer_files = [p for p in src.base.iterdir() if p.name.startswith(("tokenizer", "chat_template"))]
    assert {p.name for p in tokenizer_files} >= {"tokenizer.json", "tokenizer_config.json"}
    for path in tokenizer_files:
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "open_jev_export.json"] + [p.name for p in tokenizer_files])


def test_verification_report_figures(exported):
    _, report = exported
    probe = report.probe
    assert report.verified and probe.ran
    assert probe.requests == len(PROBE_REQUESTS) and probe.candidates == 14
    # The export rounds W + scale*B@A to bf16 while the reference keeps the fp32 adapter unmerged: small, not zero.
    assert 0 < probe.same_tokens_max_abs_dscore < 0.1
    assert 0 < probe.same_tokens_max_abs_dp <= export_mod.DEFAULT_PROBE_TOLERANCE
    assert math.isfinite(probe.max_abs_dscore) and math.isfinite(probe.max_abs_dp)
    text = "\n".join(report.lines())
    assert FIGURES.search(text) and "bitwise identical" in text


def test_multi_shard_export_loads_and_scores_the_same(exported, sharded):
    from hf_openjev.model import load_export
    from hf_openjev.scoring import answer_requests

    single, _ = exported
    out, report = sharded
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) == len(report.shards) > 3 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = read_dir_tensors(out)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            count = len(list(handle.keys()))
        assert shard.stat().st_size <= 20_000 or count == 1, shard.name
        assert all(index["weight_map"][k] == shard.name for k in safe_open(str(shard), framework="pt").keys())
    reference = read_dir_tensors(single)
    assert all(torch.equal(bits(tensors[k]), bits(reference[k])) for k in reference)
    a = answer_requests(load_export(single, dtype="float32", device="cpu"), PROBE_REQUESTS[:2], fast=False)
    b = answer_requests(load_export(out, dtype="float32", device="cpu"), PROBE_REQUESTS[:2], fast=False)
    assert [r["answers"] for r in a] == [r["answers"] for r in b]


def test_the_pipeline_serves_the_export(exported):
    from transformers import pipeline

    import hf_openjev  # noqa: F401 - registers jev-decision
    from hf_openjev.model import load_export
    from hf_openjev.scoring import answer_requests

    out, _ = exported
    jev = pipeline("jev-decision", model=str(out), device="cpu", dtype="float32")
    response = jev(PROBE_REQUESTS[0], fast=False)
    assert response["model"] == TINY_MODEL_ID
    assert set(response["answers"]) == {"intent", "urgency", "late"}
    assert response["metadata"]["max_length"] == 4096
    direct = answer_requests(load_export(out, dtype="float32", device="cpu"), [PROBE_REQUESTS[0]], fast=False)[0]
    assert response["answers"] == direct["answers"]


def test_export_tokenizes_like_the_base(src, exported):
    from hf_openjev.checkpoint.files import load_tokenizer

    out, report = exported
    base_tok, export_tok = load_tokenizer(src.base), load_tokenizer(out)
    for text in ("Über naïve café — 日本語のテキスト, emoji 🙂 and numbers 0123456789.", "plain ascii words"):
        assert base_tok(text, add_special_tokens=False)["input_ids"] == export_tok(text, add_special_tokens=False)["input_ids"]
    assert report.probe.token_mismatches == 0


# ---------------------------------------------------------------------------------------------------------------
# other base layouts and dtypes


def test_sharded_text_only_base_with_fp32_tensors(src, tmp_path, monkeypatch):
    """A text-only base (``model.`` prefix, two shards + index) with fp32 A_log and one fp32 target weight."""
    base = tmp_path / "base"
    base.mkdir()
    for path in src.base.iterdir():
        if path.name not in ("config.json", "model.safetensors"):
            shutil.copy(path, base / path.name)
    full = json.loads((src.base / "config.json").read_text())
    text_config = dict(full["text_config"], model_type="qwen3_5_text")
    (base / "config.json").write_text(json.dumps(text_config))
    raw = load_file(str(src.base / "model.safetensors"))
    tensors = {}
    for key, value in raw.items():
        if key.startswith("model.language_model."):
            tensors["model." + key[len("model.language_model."):]] = value
    tensors["lm_head.weight"] = raw["lm_head.weight"]
    fp32_norm = "model.layers.0.linear_attn.A_log"
    fp32_target = "model.layers.3.self_attn.q_proj.weight"
    g = torch.Generator().manual_seed(3)
    tensors[fp32_norm] = torch.randn(tensors[fp32_norm].shape, generator=g)
    tensors[fp32_target] = torch.randn(tensors[fp32_target].shape, generator=g) * 0.05
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for filename, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(base / filename))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (base / "model.safetensors.index.json").write_text(json.dumps(index))

    out = tmp_path / "export"
    monkeypatch.setattr(export_mod, "_COPY_CHUNK_BYTES", 10)  # fp32 A_log (6 values) is cast 2 values at a time
    report = merge_lora(base, src.package, out, progress=False, probe_max_params=1000)
    merged = read_dir_tensors(out)
    assert set(merged) == {k[len("model."):] for k in tensors if k.startswith("model.")}
    assert merged["layers.0.linear_attn.A_log"].dtype == torch.bfloat16
    assert torch.equal(bits(merged["layers.0.linear_attn.A_log"]), bits(tensors[fp32_norm].to(torch.bfloat16)))
    assert report.cast == ["layers.0.linear_attn.A_log"]
    assert "non-bf16 tensors cast to bf16" in "\n".join(report.lines())
    a, b = lora_modules(src)["layers.3.self_attn.q_proj"]
    want = (tensors[fp32_target] + (b @ a) * 2.0).to(torch.bfloat16)
    assert torch.equal(bits(merged["layers.3.self_attn.q_proj.weight"]), bits(want))
    assert report.tensor_check.modules == 10 and report.tensor_check.max_ulp == 0
    assert not report.probe.ran and "--probe on" in report.probe.skipped_reason
    assert "score probe skipped" in "\n".join(report.lines())


def test_bf16_ulp_distance():
    x = torch.tensor([1.0, -2.0, 0.0, 3.5], dtype=torch.bfloat16)
    up = torch.nextafter(x.float(), torch.tensor(float("inf"))).to(torch.bfloat16)  # fp32 step rounds back
    assert bf16_ulp_distance(x, up) == 0
    step = (x.view(torch.int16) + 1).view(torch.bfloat16)  # one bf16 ulp away from zero for each sign
    assert bf16_ulp_distance(x, step) == 1
    assert bf16_ulp_distance(torch.tensor([0.0]).bfloat16(), torch.tensor([-0.0]).bfloat16()) == 0
    assert bf16_ulp_distance(torch.tensor([1.0]).bfloat16(), torch.tensor([1.0078125 * 1.0078125]).bfloat16()) == 2


# ---------------------------------------------------------------------------------------------------------------
# bad inputs: a CheckpointError that says what to fix, and nothing written


def _edit_json(path: Path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is KeyError:
            data.pop(key)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _edit_adapter(s: Src, fn):
    tensors = load_file(str(s.adapter))
    fn(tensors)
    save_file(tensors, str(s.adapter))


def _rename_module(tensors, old, new):
    for half in "AB":
        tensors[f"base_model.model.model.language_model.{new}.lora_{half}.weight"] = tensors.pop(
            f"base_model.model.model.language_model.{old}.lora_{half}.weight")


def _widen_a(tensors):
    key = "base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_A.weight"
    tensors[key] = torch.randn(8, 65)


def _nan_adapter(tensors):
    key = "base_model.model.model.language_model.layers.0.linear_attn.out_proj.lora_B.weight"
    tensors[key][0, 0] = float("nan")


def _head(s: Src, weight=None, bias=None):
    head = torch.load(s.ckpt / "head.pt", weights_only=True)
    if weight is not None:
        head["weight"] = weight(head["weight"])
    if bias is not None:
        head["bias"] = bias
    torch.save(head, s.ckpt / "head.pt")


def _drop_base_tensor(s: Src):
    tensors = load_file(str(s.base / "model.safetensors"))
    del tensors["model.language_model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, str(s.base / "model.safetensors"))


def _extra_base_tensor(s: Src):
    tensors = load_file(str(s.base / "model.safetensors"))
    tensors["model.language_model.layers.1.extra.weight"] = torch.zeros(4, dtype=torch.bfloat16)
    save_file(tensors, str(s.base / "model.safetensors"))


def _missing_shard(s: Src):
    (s.base / "model.safetensors").rename(s.base / "model-00001-of-00002.safetensors")
    keys = list(safe_open(str(s.base / "model-00001-of-00002.safetensors"), framework="pt").keys())
    weight_map = {k: "model-00001-of-00002.safetensors" for k in keys}
    weight_map["model.language_model.norm.weight"] = "model-00002-of-00002.safetensors"
    (s.base / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _no_tokenizer(s: Src):
    for path in s.base.iterdir():
        if path.name.startswith(("tokenizer", "chat_template")):
            path.unlink()


def _edit_text_config(s: Src, **changes):
    data = json.loads((s.base / "config.json").read_text())
    data["text_config"].update(changes)
    (s.base / "config.json").write_text(json.dumps(data))


BAD_INPUTS = {
    # missing files
    "base config missing": (lambda s: (s.base / "config.json").unlink(), r"config\.json is missing"),
    "base weights missing": (lambda s: (s.base / "model.safetensors").unlink(), r"no model\.safetensors"),
    "base shard missing": (_missing_shard, r"model-00002-of-00002\.safetensors.*missing|missing.*00002"),
    "base tokenizer missing": (_no_tokenizer, r"has no tokenizer"),
    "base shard truncated": (lambda s: os.truncate(s.base / "model.safetensors", (s.base / "model.safetensors").stat().st_size - 100),
                             r"model\.safetensors is not a readable safetensors file"),
    "package missing": (lambda s: shutil.rmtree(s.package), r"package directory .* does not exist"),
    "model.json missing": (lambda s: (s.ckpt / "model.json").unlink(), r"model\.json is missing"),
    "adapter config missing": (lambda s: s.adapter_config.unlink(), r"adapter_config\.json is missing"),
    "adapter weights missing": (lambda s: s.adapter.unlink(), r"adapter_model\.safetensors is missing"),
    "head missing": (lambda s: (s.ckpt / "head.pt").unlink(), r"head\.pt is missing"),
    "temperature missing": (lambda s: (s.ckpt / "temperature.json").unlink(), r"temperature\.json is missing"),
    # adapter vs base
    "adapter targets a missing layer": (
        lambda s: _edit_adapter(s, lambda t: _rename_module(t, "layers.3.self_attn.q_proj", "layers.9.self_attn.q_proj")),
        r"targets layers\.9\.self_attn\.q_proj, which the base model does not have"),
    "adapter targets a missing module": (
        lambda s: _edit_adapter(s, lambda t: _rename_module(t, "layers.0.linear_attn.out_proj", "layers.0.linear_attn.o_proj")),
        r"targets layers\.0\.linear_attn\.o_proj, which the base model does not have"),
    "adapter shape mismatch": (lambda s: _edit_adapter(s, _widen_a),
                               r"layers\.3\.self_attn\.q_proj has A \[8, 65\].*base weight is \[256, 64\]"),
    "adapter non-finite": (lambda s: _edit_adapter(s, _nan_adapter), r"out_proj contains NaN"),
    "adapter rank does not match tensors": (lambda s: _edit_json(s.adapter_config, r=4), r"do not match rank r=4"),
    "rank missing": (lambda s: _edit_json(s.adapter_config, r=KeyError), r"LoRA rank 'r' is missing"),
    "alpha missing": (lambda s: _edit_json(s.adapter_config, lora_alpha=KeyError), r"'lora_alpha' is missing"),
    "DoRA adapter": (lambda s: _edit_json(s.adapter_config, use_dora=True), r"use_dora=true \(DoRA\) is not supported"),
    "target_modules mismatch": (lambda s: _edit_json(s.adapter_config, target_modules=["q_proj"]),
                                r"target_modules \['q_proj'\] does not cover"),
    # base config and weights
    "base config not Qwen3.5": (lambda s: _edit_json(s.base / "config.json", model_type="llama"),
                                r"model_type 'llama' is not a Qwen3\.5 model"),
    "base weights do not match config": (lambda s: _edit_text_config(s, intermediate_size=96),
                                         r"shapes do not match config\.json"),
    "base lacks a backbone weight": (_drop_base_tensor, r"1 backbone weights required by config\.json are missing"),
    "base has an unknown tensor": (_extra_base_tensor, r"not part of the Qwen3\.5 text backbone.*layers\.1\.extra"),
    # head and temperature
    "head not [1, hidden]": (lambda s: _head(s, weight=lambda w: w.repeat(2, 1)), r"shape \[1, hidden\]"),
    "head hidden mismatch": (lambda s: _head(s, weight=lambda w: torch.cat([w, w[:, :1]], 1)),
                             r"\[1, 65\].*hidden size is 64"),
    "head NaN": (lambda s: _head(s, weight=lambda w: w.index_fill(1, torch.tensor([3]), float("nan"))),
                 r"non-finite"),
    "head bias infinite": (lambda s: _head(s, bias=torch.tensor([float("inf")])), r"head_bias must be a finite"),
    "temperature NaN": (lambda s: (s.ckpt / "temperature.json").write_text('{"temperature": NaN}'),
                        r"temperature must be finite and positive"),
    "temperature infinite": (lambda s: (s.ckpt / "temperature.json").write_text('{"temperature": Infinity}'),
                             r"temperature must be finite and positive"),
    "temperature zero": (lambda s: _edit_json(s.ckpt / "temperature.json", temperature=0),
                         r"temperature must be finite and positive"),
}


@pytest.fixture
def fresh(src, tmp_path) -> Src:
    copy = Src(tmp_path)
    shutil.copytree(src.base, copy.base)
    shutil.copytree(src.package, copy.package)
    return copy


@pytest.fixture
def no_writes(monkeypatch):
    """Fail the test if the export creates its temporary directory (all checks must come first)."""
    def refuse(*args, **kwargs):
        raise AssertionError("merge_lora started writing before its checks finished")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    monkeypatch.setattr(publish, "claim_temp_dir", refuse)  # what claim_export_temp, merge_lora's, calls


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_fail_before_writing(case, fresh, no_writes):
    mutate, message = BAD_INPUTS[case]
    before = set(os.listdir(fresh.root))
    mutate(fresh)
    out = fresh.root / "new" / "export"
    with pytest.raises(CheckpointError, match=message):
        merge_lora(fresh.base, fresh.package, out, progress=False)
    assert not (fresh.root / "new").exists()
    assert set(os.listdir(fresh.root)) <= before


@pytest.mark.parametrize("max_length", [0, -1, 16385, "4096", True, 4096.0, None])
def test_max_length_outside_range(max_length, src, tmp_path, no_writes):
    with pytest.raises(CheckpointError, match=r"max_length must be an integer in 1\.\.16384"):
        merge_lora(src.base, src.package, tmp_path / "export", max_length=max_length, progress=False)
    no_leftovers(tmp_path, set())


def test_max_length_is_recorded(src, tmp_path):
    report = merge_lora(src.base, src.package, tmp_path / "export", max_length=16384, verify=False, progress=False)
    assert json.loads((Path(os.fspath(report)) / "open_jev_export.json").read_text())["max_length"] == 16384


def test_output_over_an_input_is_refused(fresh, no_writes):
    with pytest.raises(CheckpointError, match="would replace the input directory"):
        merge_lora(fresh.base, fresh.package, fresh.base, overwrite=True, progress=False)
    with pytest.raises(CheckpointError, match="would replace the input directory"):
        merge_lora(fresh.base, fresh.package, fresh.root, overwrite=True, progress=False)
    assert (fresh.base / "model.safetensors").is_file()


def test_shard_limit_above_5gb_is_refused(src, tmp_path, no_writes):
    with pytest.raises(CheckpointError, match=r"5 GB"):
        merge_lora(src.base, src.package, tmp_path / "export", max_shard_bytes=5 * 1000**3 + 1, progress=False)


def test_existing_target_refused_then_replaced_with_overwrite(src, tmp_path, exported):
    out = tmp_path / "export"
    shutil.copytree(exported[0], out)  # an export: --overwrite may replace it
    (out / "marker").write_text("old")
    with pytest.raises(CheckpointError, match="already exists; pass --overwrite"):
        merge_lora(src.base, src.package, out, progress=False, verify=False)
    assert (out / "marker").read_text() == "old"
    merge_lora(src.base, src.package, out, overwrite=True, progress=False, verify=False)
    assert not (out / "marker").exists() and (out / "open_jev_export.json").is_file()
    no_leftovers(tmp_path, {"export"})
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        merge_lora(src.base, src.package, tmp_path / "file", overwrite=True, progress=False, verify=False)


# ---------------------------------------------------------------------------------------------------------------
# failures while writing or verifying leave nothing behind


def _interrupt_after(monkeypatch, calls: int):
    original = shard_writer.ShardWriter.write
    seen = []

    def write(self, name, tensor):
        seen.append(name)
        if len(seen) == calls:
            raise KeyboardInterrupt
        return original(self, name, tensor)

    monkeypatch.setattr(shard_writer.ShardWriter, "write", write)
    return seen


def test_interrupt_while_writing_leaves_nothing(src, tmp_path, monkeypatch):
    seen = _interrupt_after(monkeypatch, 30)
    with pytest.raises(KeyboardInterrupt):
        merge_lora(src.base, src.package, tmp_path / "a" / "b" / "export", progress=False, verify=False,
                   max_shard_bytes=20_000)
    assert len(seen) == 30  # several shards had been written when the interrupt came
    no_leftovers(tmp_path, set())


def test_interrupt_keeps_an_existing_target(src, tmp_path, monkeypatch, exported):
    out = tmp_path / "export"
    shutil.copytree(exported[0], out)
    (out / "marker").write_text("old")
    before = sorted(os.listdir(out))
    _interrupt_after(monkeypatch, 5)
    with pytest.raises(KeyboardInterrupt):
        merge_lora(src.base, src.package, out, overwrite=True, progress=False, verify=False)
    assert sorted(os.listdir(out)) == before
    no_leftovers(tmp_path, {"export"})


def test_interrupt_during_verification_leaves_nothing(src, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        assert any(p.name.startswith(".export.tmp-") for p in tmp_path.iterdir())
        # the manifest comes only after the verification: a directory killed here is no export
        assert not (next(tmp_path.glob(".export.tmp-*[!k]")) / "open_jev_export.json").exists()
        raise KeyboardInterrupt

    monkeypatch.setattr(export_mod, "run_probe", interrupted)
    with pytest.raises(KeyboardInterrupt):
        merge_lora(src.base, src.package, tmp_path / "export", progress=False)
    no_leftovers(tmp_path, set())


def test_a_target_that_appears_during_the_export_is_not_replaced(src, tmp_path, monkeypatch):
    out = tmp_path / "export"
    original = export_mod._write_text_files

    def racing(plan, tmp):
        out.mkdir()
        (out / "theirs").write_text("x")
        return original(plan, tmp)

    monkeypatch.setattr(export_mod, "_write_text_files", racing)
    with pytest.raises(CheckpointError, match="appeared while exporting; pass --overwrite"):
        merge_lora(src.base, src.package, out, progress=False, verify=False)
    assert os.listdir(out) == ["theirs"]
    no_leftovers(tmp_path, {"export"})


def test_a_crashing_probe_is_a_failed_verification(src, tmp_path, monkeypatch):
    monkeypatch.setattr(export_mod, "run_probe", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(CheckpointError, match=r"score probe raised ZeroDivisionError.*--probe off"):
        merge_lora(src.base, src.package, tmp_path / "export", progress=False)
    no_leftovers(tmp_path, set())
    report = merge_lora(src.base, src.package, tmp_path / "export", progress=False, probe="off")
    assert not report.probe.ran and "--probe off" in report.probe.skipped_reason


def test_merge_that_disagrees_with_peft_fails_verification(src, tmp_path, monkeypatch):
    original = export_mod.merge_weight

    def off_by_two_ulps(weight, a, b, scale):
        merged = original(weight, a, b, scale)
        return (merged.view(torch.int16) + 2).view(torch.bfloat16)

    monkeypatch.setattr(export_mod, "merge_weight", off_by_two_ulps)
    with pytest.raises(CheckpointError, match=r"verification failed: merged .* by 2 bf16 ulp"):
        merge_lora(src.base, src.package, tmp_path / "export", progress=False)
    no_leftovers(tmp_path, set())


def test_wrong_merge_is_caught_by_the_score_probe(src, tmp_path, monkeypatch):
    """A merge with the wrong scale, where the PEFT comparison is fooled too: the probe must catch it."""
    original = export_mod.merge_weight
    monkeypatch.setattr(export_mod, "merge_weight", lambda w, a, b, scale: original(w, a, b, 3 * scale))
    monkeypatch.setattr(export_mod, "peft_merge_and_unload",
                        lambda w, a, b, rank, alpha: original(w, a, b, 3 * alpha / rank))
    with pytest.raises(CheckpointError, match=r"verification failed: on the same token ids .* differ"):
        merge_lora(src.base, src.package, tmp_path / "export", progress=False)
    no_leftovers(tmp_path, set())


# ---------------------------------------------------------------------------------------------------------------
# command line and progress bar


def _cli(monkeypatch, argv):
    import hf_openjev.cli as cli

    # Only the export subcommand: the other subcommands' modules are not this test's subject.
    monkeypatch.setattr(cli, "COMMANDS", {"export": cli.COMMANDS["export"]})
    return cli.main(argv)


def test_cli_exports_and_prints_the_verification_figures(src, tmp_path, monkeypatch, capsys):
    out = tmp_path / "cli" / "export"
    args = ["export", "--base", str(src.base), "--package", str(src.package), "--out", str(out)]
    assert _cli(monkeypatch, args + ["--max-length", "512"]) == 0
    captured = capsys.readouterr()
    figures = [(float(a), float(b)) for a, b in FIGURES.findall(captured.out)]
    assert figures, captured.out
    assert all(math.isfinite(dscore) and 0 <= dp <= 1 for dscore, dp in figures)
    # The last pair compares the weights on the same token ids (the only pair when the tokenizers agree).
    assert 0 < figures[-1][1] <= export_mod.DEFAULT_PROBE_TOLERANCE
    assert "10 modules, bitwise identical" in captured.out
    assert "export: merging shards" in captured.err and "1/1" in captured.err
    manifest = json.loads((out / "open_jev_export.json").read_text())
    assert manifest["max_length"] == 512

    assert _cli(monkeypatch, args) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert _cli(monkeypatch, args + ["--overwrite", "--max-length", "0"]) == 2
    assert "max_length must be an integer in 1..16384" in capsys.readouterr().err
    assert json.loads((out / "open_jev_export.json").read_text())["max_length"] == 512

    import hf_openjev.export.cli as export_cli

    monkeypatch.setattr(export_cli, "MIN_SHARD_BYTES", 1000)  # the tiny export is below the 1 MB floor
    rc = _cli(monkeypatch, args + ["--overwrite", "--no-verify", "--no-progress", "--max-shard-size", "30KB"])
    captured = capsys.readouterr()
    assert rc == 0 and "verify: off" in captured.out and "merging shards" not in captured.err
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    no_leftovers(tmp_path / "cli", {"export"})


def test_cli_bad_input_exits_2_and_leaves_nothing(fresh, monkeypatch, capsys):
    (fresh.ckpt / "head.pt").unlink()
    out = fresh.root / "out"
    rc = _cli(monkeypatch, ["export", "--base", str(fresh.base), "--package", str(fresh.package), "--out", str(out)])
    assert rc == 2
    assert re.search(r"hf-openjev export: error: .*head\.pt is missing", capsys.readouterr().err)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# the base's identity (issue 20): a package on a base with fitting shapes but another name/revision is refused

REV = "0123456789abcdef0123456789abcdef01234567"


def _in_hf_cache(s: Src, repo: str = "Qwen/Qwen3.5-2B", revision: str = REV) -> Path:
    """A copy of the base laid out as a Hugging Face cache snapshot (``models--ORG--NAME/snapshots/REV``)."""
    snapshot = s.root / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / revision
    shutil.copytree(s.base, snapshot)
    return snapshot


def test_a_base_other_than_the_one_the_package_names_is_refused(fresh, no_writes):
    base = _in_hf_cache(fresh)
    _edit_json(fresh.adapter_config, base_model_name_or_path="Qwen/Qwen3.5-9B")
    out = fresh.root / "out"
    with pytest.raises(CheckpointError) as info:
        merge_lora(base, fresh.package, out, progress=False)
    message = str(info.value)
    assert "is not the base model the package was trained on" in message
    assert "'Qwen/Qwen3.5-9B' (adapter_config.json base_model_name_or_path)" in message
    assert "'Qwen/Qwen3.5-2B' (its Hugging Face cache path)" in message
    assert "--allow-base-mismatch" in message and "hf download Qwen/Qwen3.5-9B" in message
    assert not out.exists()


def test_a_base_revision_other_than_the_one_the_package_names_is_refused(fresh, no_writes):
    base = _in_hf_cache(fresh)
    _edit_json(fresh.adapter_config, base_model_name_or_path="Qwen/Qwen3.5-2B")
    _edit_json(fresh.ckpt / "model.json", base_revision="fedcba9876543210fedcba9876543210fedcba98")
    with pytest.raises(CheckpointError, match=r"names base revision 'fedcba98.*' \(model\.json base_revision\) but "
                                              rf"--base is revision '{REV}'"):
        merge_lora(base, fresh.package, fresh.root / "out", progress=False)


def test_a_mismatch_allowed_exports_with_a_loud_warning(fresh):
    base = _in_hf_cache(fresh)
    _edit_json(fresh.adapter_config, base_model_name_or_path="Qwen/Qwen3.5-9B")
    out = fresh.root / "out"
    report = merge_lora(base, fresh.package, out, progress=False, probe="off", allow_base_mismatch=True)
    lines = report.lines()
    assert lines[-1].startswith("WARNING: base mismatch allowed (--allow-base-mismatch): the package names base "
                                "'Qwen/Qwen3.5-9B'")
    assert "bitwise identical" in "\n".join(lines)  # the merge is faithful: the warning says that is not enough
    manifest = json.loads((out / "open_jev_export.json").read_text())
    assert manifest["base_revision"] == REV  # what was really merged
    assert manifest["base_fingerprint"].startswith("sha256-sampled-v1:")


def test_a_matching_base_is_recorded_in_the_manifest(fresh):
    base = _in_hf_cache(fresh)
    _edit_json(fresh.adapter_config, base_model_name_or_path="qwen/qwen3.5-2b")  # repo ids compare case-blind
    _edit_json(fresh.ckpt / "model.json", base_revision=REV[:10])  # a short hash matches its long form
    report = merge_lora(base, fresh.package, fresh.root / "out", progress=False, verify=False)
    text = "\n".join(report.lines())
    assert f"base: Qwen/Qwen3.5-2B @ {REV} (from its Hugging Face cache path)" in text
    assert "adapter_config.json base_model_name_or_path names 'qwen/qwen3.5-2b': matches" in text
    assert f"model.json base_revision '{REV[:10]}': matches" in text
    assert "WARNING" not in text
    assert json.loads((fresh.root / "out" / "open_jev_export.json").read_text())["base_revision"] == REV


def test_unknown_identity_is_reported_and_the_fingerprint_always_recorded(src, exported):
    from hf_openjev.checkpoint.files import base_weight_files
    from hf_openjev.export.identity import base_fingerprint

    out, report = exported
    text = "\n".join(report.lines())
    assert "base: identity not checked: the package names no base model" in text
    manifest = json.loads((out / "open_jev_export.json").read_text())
    assert manifest["base_fingerprint"] == base_fingerprint(base_weight_files(src.base))
    assert f"base: fingerprint {manifest['base_fingerprint']} (recorded in open_jev_export.json)" in text


def test_the_fingerprint_tells_bases_with_the_same_shapes_apart(fresh):
    from hf_openjev.checkpoint.files import read_safetensors_headers
    from hf_openjev.export.identity import base_fingerprint

    path = fresh.base / "model.safetensors"
    before = base_fingerprint([path])
    assert before == base_fingerprint([path])  # deterministic
    headers = read_safetensors_headers(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor: same header, same shapes
    path.write_bytes(bytes(data))
    assert read_safetensors_headers(path) == headers
    assert base_fingerprint([path]) != before


def test_base_identity_from_git_and_hf_download_metadata(tmp_path):
    from hf_openjev.export.identity import base_dir_identity

    repo = tmp_path / "Qwen3.5-9B"
    (repo / ".git" / "refs" / "heads").mkdir(parents=True)
    (repo / ".git" / "config").write_text('[remote "origin"]\n\turl = https://huggingface.co/Qwen/Qwen3.5-9B\n')
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".git" / "refs" / "heads" / "main").write_text(REV + "\n")
    name, revision = base_dir_identity(repo)
    assert (name.value, name.source) == ("Qwen/Qwen3.5-9B", "its git remote")
    assert (revision.value, revision.source) == (REV, "its git HEAD")

    local = tmp_path / "local"
    (local / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (local / ".cache" / "huggingface" / "download" / "config.json.metadata").write_text(f"{REV}\netag\n1.0\n")
    (local / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen3.5-2B"}))
    name, revision = base_dir_identity(local)
    assert (name.value, revision.value) == ("Qwen/Qwen3.5-2B", REV)
    assert base_dir_identity(tmp_path / "nothing") == (None, None)


def test_export_directory_gets_ordinary_permissions(src, tmp_path):
    old = os.umask(0o022)
    try:
        merge_lora(src.base, src.package, tmp_path / "export", progress=False, verify=False)
    finally:
        os.umask(old)
    assert (tmp_path / "export").stat().st_mode & 0o777 == 0o755


def test_cli_base_mismatch_exits_2_then_exports_with_the_override(fresh, monkeypatch, capsys):
    base = _in_hf_cache(fresh)
    _edit_json(fresh.adapter_config, base_model_name_or_path="Qwen/Qwen3.5-9B")
    out = fresh.root / "out"
    args = ["export", "--base", str(base), "--package", str(fresh.package), "--out", str(out), "--no-progress"]
    assert _cli(monkeypatch, args) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-openjev export: error: --base ") and err.count("\n") == 1
    assert not out.exists()
    assert _cli(monkeypatch, args + ["--allow-base-mismatch", "--no-verify"]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1].startswith("WARNING: base mismatch allowed")


# ---------------------------------------------------------------------------------------------------------------
# killed exports (issue 28): no unverified export that loads, stale temporaries removed, --overwrite in one step

_KILLED_EXPORT = r'''
import os, sys
from pathlib import Path
import hf_openjev.export.merge as m
import hf_openjev.export.verify as v

where = sys.argv[4]
def die(*args, **kwargs):
    os._exit(9)  # as SIGKILL: no handler, no cleanup
if where == "probe":
    m.run_probe = die
elif where == "swap":  # the old export has just been moved away (or exchanged), the new one not yet in place
    real = Path.rename
    def rename(self, target):
        out = real(self, target)
        if Path(self).name == "export":
            os._exit(9)
        return out
    Path.rename = rename
    import hf_openjev.checkpoint.publish as p
    p.shutil.rmtree = die  # right after an exchange
m.merge_lora(sys.argv[1], sys.argv[2], sys.argv[3], progress=False, overwrite=True, probe="on")
'''


def _killed_export(src, out, where):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _KILLED_EXPORT, str(src.base), str(src.package), str(out), where],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 9, proc.stderr


def test_an_export_killed_during_verification_leaves_no_loadable_export_and_the_rerun_cleans_it(src, tmp_path):
    from hf_openjev.checkpoint.manifest import check_export_dir

    out = tmp_path / "export"
    _killed_export(src, out, "probe")
    left = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(left) == 1 and left[0].name.startswith(".export.tmp-")
    with pytest.raises(CheckpointError, match="open_jev_export.json is missing"):
        check_export_dir(left[0])  # what eval --model, serve and the pipeline check first
    from hf_openjev.checkpoint.publish import claim_temp_dir

    other = claim_temp_dir(tmp_path / "export")  # another export's, still running: its lock is held
    merge_lora(src.base, src.package, out, progress=False, verify=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["export", other.path.name, other.lock_path.name])
    other.release()
    other.path.rmdir()


def test_an_overwrite_killed_between_the_renames_leaves_an_export_that_loads(src, tmp_path, exported):
    from hf_openjev.model import load_export

    out = tmp_path / "export"
    shutil.copytree(exported[0], out)
    (out / "old-marker").write_text("old")
    _killed_export(src, out, "swap")
    model = load_export(out, dtype=torch.float32)  # old or new, it loads
    assert model.manifest.model_id == TINY_MODEL_ID
    merge_lora(src.base, src.package, out, progress=False, verify=False, overwrite=True)
    no_leftovers(tmp_path, {"export"})  # the killed run's temporaries are gone too


def test_an_already_merged_export_is_refused_as_base(src, exported, tmp_path, no_writes):
    with pytest.raises(CheckpointError, match=r"holds open_jev_export.json: it is a merged export"):
        merge_lora(exported[0], src.package, tmp_path / "twice", progress=False)
    no_leftovers(tmp_path, set())

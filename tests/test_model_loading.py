"""hf_openjev.model / manifest / package / chat: loading a merged export and the published package."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import QWEN_CHAT_PREFIX, QWEN_CHAT_SUFFIX
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hf_openjev
from hf_openjev import CheckpointError, JevModel, load_export, load_reference
from hf_openjev.checkpoint.manifest import MANIFEST_NAME
from hf_openjev.checkpoint.tiny import TINY_MODEL_ID, TINY_TEMPERATURE, build_tiny_tokenizer
from hf_openjev.reference import score_reference
from hf_openjev.tokenizer.chat import render_chat_halves

TEXTS = ["Context:\nhello\n\nQuestion: yes?\n", "a", "Über naïve café 🙂 " * 5]


def _sequences(model):
    return [model.encode(QWEN_CHAT_PREFIX + t + QWEN_CHAT_SUFFIX) for t in TEXTS]


def _copy_export(tiny_checkpoint, tmp_path) -> Path:
    dst = tmp_path / "export"
    shutil.copytree(tiny_checkpoint.export, dst)
    return dst


def _edit_manifest(export: Path, **changes) -> None:
    path = export / MANIFEST_NAME
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            del data[key]
        else:
            data[key] = value
    path.write_text(json.dumps(data))  # json writes NaN/Infinity as the bare literals


_DELETE = object()


def _load_error(path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        load_export(path, dtype="float32", device="cpu", **kwargs)
    return str(info.value)


# --- the merged export -------------------------------------------------------------------------------------------

def test_export_loads_into_one_jev_model(tiny_model, tiny_checkpoint):
    model = tiny_model
    assert isinstance(model, JevModel)
    assert model.method == "merged"
    assert model.model_id == TINY_MODEL_ID
    assert model.temperature == TINY_TEMPERATURE
    assert model.max_length == 4096
    assert model.chat_prefix == QWEN_CHAT_PREFIX
    assert model.chat_suffix == QWEN_CHAT_SUFFIX
    assert model.served_model_names == (TINY_MODEL_ID, "open-jev", "jev-latest")
    assert type(model.backbone).__name__ == "Qwen3_5TextModel"
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert model.dtype == torch.float32 and model.device == torch.device("cpu")
    assert not model.backbone.training

    manifest = json.loads((tiny_checkpoint.export / MANIFEST_NAME).read_text())
    assert model.head.weight.dtype == torch.float32 and model.head.bias.dtype == torch.float32
    assert model.head.weight.shape == (1, 64)
    assert model.head.weight.flatten().tolist() == manifest["head_weight"]
    assert model.head.bias.item() == manifest["head_bias"]

    # every backbone parameter is the export's tensor (nothing randomly initialised)
    with safe_open(str(tiny_checkpoint.export / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        params = dict(model.backbone.named_parameters())
        assert set(params) == names
        for name, param in params.items():
            assert torch.equal(param.detach(), handle.get_tensor(name).float()), name

    assert model.encode("<|im_start|>user\n")[0] == model.tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_dtype_and_device_are_chosen_by_the_caller(tiny_checkpoint):
    bf16 = load_export(tiny_checkpoint.export, dtype="bfloat16", device="cpu")
    assert bf16.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in bf16.backbone.parameters())
    assert bf16.head.weight.dtype == torch.float32
    auto = load_export(tiny_checkpoint.export)  # "auto": the checkpoint dtype, bf16
    assert auto.dtype == torch.bfloat16 and auto.device.type == "cpu"
    as_dtype = load_export(tiny_checkpoint.export, dtype=torch.float32)
    assert as_dtype.dtype == torch.float32
    # moving the model never changes the head's dtype
    bf16.to(torch.float16)
    assert bf16.dtype == torch.float16 and bf16.head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        load_export(tiny_checkpoint.export, dtype="float33")


@pytest.mark.parametrize("prefix", ["model.language_model.", "model.", ""])
def test_every_tensor_name_prefix_loads_identically(tiny_model, tiny_checkpoint, tmp_path, prefix):
    export = _copy_export(tiny_checkpoint, tmp_path)
    tensors = load_file(str(export / "model.safetensors"))
    assert not any(k.startswith("model.") for k in tensors)  # the export writes bare names
    save_file({prefix + k: v for k, v in tensors.items()}, str(export / "model.safetensors"), metadata={"format": "pt"})
    model = load_export(export, dtype="float32", device="cpu")
    ours, theirs = tiny_model.backbone.state_dict(), model.backbone.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    seqs = _sequences(tiny_model)
    assert score_reference(model, seqs) == score_reference(tiny_model, seqs)


def test_sharded_export_with_index_loads(tiny_model, tiny_checkpoint, tmp_path):
    export = _copy_export(tiny_checkpoint, tmp_path)
    tensors = load_file(str(export / "model.safetensors"))
    (export / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(export / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    (export / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = load_export(export, dtype="float32", device="cpu")
    seqs = _sequences(tiny_model)
    assert score_reference(model, seqs) == score_reference(tiny_model, seqs)


# --- clear errors --------------------------------------------------------------------------------------------------

def test_missing_manifest(tiny_checkpoint, tmp_path):
    export = _copy_export(tiny_checkpoint, tmp_path)
    (export / MANIFEST_NAME).unlink()
    message = _load_error(export)
    assert message.startswith(f"{export / MANIFEST_NAME} is missing: {export} is not a complete merged Open-Jev export")
    assert "hf-openjev export" in message


def test_not_a_directory(tmp_path):
    assert _load_error(tmp_path / "nope").startswith(f"{tmp_path / 'nope'} is not a directory")


def test_malformed_manifest_json(tiny_checkpoint, tmp_path):
    export = _copy_export(tiny_checkpoint, tmp_path)
    (export / MANIFEST_NAME).write_text('{"format": "open-jev-text-merged/1",')
    assert f"{export / MANIFEST_NAME} is not valid JSON" in _load_error(export)
    (export / MANIFEST_NAME).write_text('["open-jev-text-merged/1"]')
    assert _load_error(export) == f"{export / MANIFEST_NAME} must hold a JSON object"


@pytest.mark.parametrize("fmt", ["open-jev-text-merged/2", "open-jev-full/1", None])
def test_unknown_format(tiny_checkpoint, tmp_path, fmt):
    export = _copy_export(tiny_checkpoint, tmp_path)
    _edit_manifest(export, format=fmt if fmt is not None else _DELETE)
    assert _load_error(export) == (f"{export / MANIFEST_NAME}: unknown format {fmt!r}; this version reads "
                                   "'open-jev-text-merged/1' and 'open-jev-text-merged-fp8/1'")


def test_head_size_differs_from_hidden_size(tiny_checkpoint, tmp_path):
    export = _copy_export(tiny_checkpoint, tmp_path)
    weight = json.loads((export / MANIFEST_NAME).read_text())["head_weight"]
    _edit_manifest(export, head_weight=weight[:-1])
    message = _load_error(export)
    assert "the head has 63 inputs but hidden_size is 64" in message
    _edit_manifest(export, head_weight=weight + [0.5, 0.25])
    assert "the head has 66 inputs but hidden_size is 64" in _load_error(export)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_head_weight(tiny_checkpoint, tmp_path, bad):
    export = _copy_export(tiny_checkpoint, tmp_path)
    weight = json.loads((export / MANIFEST_NAME).read_text())["head_weight"]
    weight[7] = bad
    _edit_manifest(export, head_weight=weight)
    assert _load_error(export) == "head_weight contains non-finite values (NaN or infinity); the head is corrupt"


def test_non_finite_head_bias(tiny_checkpoint, tmp_path):
    export = _copy_export(tiny_checkpoint, tmp_path)
    _edit_manifest(export, head_bias=math.nan)
    assert _load_error(export) == "head_bias must be a finite number, got nan"


@pytest.mark.parametrize("changes, expected", [
    ({"max_length": 0}, "max_length must be an integer in 1..16384, got 0"),
    ({"max_length": 16385}, "max_length must be an integer in 1..16384, got 16385"),
    ({"max_length": 4096.0}, "max_length must be an integer in 1..16384, got 4096.0"),
    ({"temperature": 0}, "temperature must be finite and positive, got 0"),
    ({"temperature": "2.5"}, "temperature must be a number, got '2.5'"),
])
def test_invalid_manifest_values(tiny_checkpoint, tmp_path, changes, expected):
    export = _copy_export(tiny_checkpoint, tmp_path)
    _edit_manifest(export, **changes)
    assert _load_error(export) == expected


def test_missing_manifest_field(tiny_checkpoint, tmp_path):
    export = _copy_export(tiny_checkpoint, tmp_path)
    _edit_manifest(export, chat_suffix=_DELETE, temperature=_DELETE)
    assert _load_error(export) == f"{export / MANIFEST_NAME} lacks temperature, chat_suffix; re-run the export"


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5", "llama"])
def test_unsupported_config(tiny_checkpoint, tmp_path, model_type):
    export = _copy_export(tiny_checkpoint, tmp_path)
    config = json.loads((export / "config.json").read_text())
    config["model_type"] = model_type
    (export / "config.json").write_text(json.dumps(config))
    assert _load_error(export) == (f"{export / 'config.json'}: unsupported config model_type {model_type!r}; a merged "
                                   "export holds a qwen3_5_text config")


def test_unsupported_layer_type(tiny_checkpoint, tmp_path):
    export = _copy_export(tiny_checkpoint, tmp_path)
    config = json.loads((export / "config.json").read_text())
    config["layer_types"] = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    (export / "config.json").write_text(json.dumps(config))
    message = _load_error(export)
    assert message.startswith(f"{export / 'config.json'}")
    assert "sliding_attention" in message


def test_missing_config(tiny_checkpoint, tmp_path):
    export = _copy_export(tiny_checkpoint, tmp_path)
    (export / "config.json").unlink()
    assert _load_error(export) == f"{export / 'config.json'} is missing; the export is incomplete"


def test_missing_weights(tiny_checkpoint, tmp_path):
    export = _copy_export(tiny_checkpoint, tmp_path)
    tensors = load_file(str(export / "model.safetensors"))
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(export / "model.safetensors"), metadata={"format": "pt"})
    assert _load_error(export) == (f"{export}: 1 backbone weights are missing (e.g. ['layers.0.mlp.up_proj.weight']); "
                                   "the checkpoint is incomplete or not a Qwen3.5 text model")


def test_weight_with_the_wrong_shape(tiny_checkpoint, tmp_path):
    export = _copy_export(tiny_checkpoint, tmp_path)
    tensors = load_file(str(export / "model.safetensors"))
    tensors["layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    save_file(tensors, str(export / "model.safetensors"), metadata={"format": "pt"})
    message = _load_error(export)
    assert "layers.0.mlp.up_proj.weight" in message or "do not match config.json" in message


def test_no_weights_at_all(tiny_checkpoint, tmp_path):
    export = _copy_export(tiny_checkpoint, tmp_path)
    (export / "model.safetensors").unlink()
    # a CheckpointError naming the directory, not transformers' bare OSError
    assert str(export) in _load_error(export)


def test_missing_tokenizer(tiny_checkpoint, tmp_path):
    export = _copy_export(tiny_checkpoint, tmp_path)
    for item in export.iterdir():
        if item.name.startswith("tokenizer"):
            item.unlink()
    # transformers 5 would silently build an empty Qwen3.5 tokenizer from config.json (every text -> []);
    # loading must refuse instead of serving garbage
    assert "tokenizer" in _load_error(export)


def test_chat_halves_need_a_chat_template():
    tok = build_tiny_tokenizer()
    assert render_chat_halves(tok) == (QWEN_CHAT_PREFIX, QWEN_CHAT_SUFFIX)
    tok.chat_template = None
    with pytest.raises(CheckpointError, match="the base tokenizer has no chat template"):
        render_chat_halves(tok)
    tok.chat_template = "{{ messages[0]['content'] }}{{ messages[0]['content'] }}"
    with pytest.raises(CheckpointError, match="does not place the user message exactly once"):
        render_chat_halves(tok)


# --- the published package + base: the unmerged PEFT reference --------------------------------------------------

@pytest.fixture(scope="module")
def reference_model(tiny_checkpoint):
    return load_reference(tiny_checkpoint.base, tiny_checkpoint.package, dtype="float32", device="cpu")


def test_reference_model_fields(reference_model, tiny_checkpoint):
    from peft import PeftModel

    model = reference_model
    assert isinstance(model, JevModel) and model.method == "peft-unmerged"
    assert isinstance(model.backbone, PeftModel)
    assert model.model_id == TINY_MODEL_ID
    assert model.temperature == TINY_TEMPERATURE
    assert model.max_length == 4096  # from the package's model.json
    assert model.chat_prefix == QWEN_CHAT_PREFIX and model.chat_suffix == QWEN_CHAT_SUFFIX
    assert model.manifest.checkpoint_revision == "tiny-seed0"
    head = torch.load(tiny_checkpoint.package / "checkpoint" / "head.pt", weights_only=True)
    assert torch.equal(model.head.weight, head["weight"]) and torch.equal(model.head.bias, head["bias"])
    assert model.dtype == torch.float32

    # the adapter is unmerged: base weights are the base's, LoRA A/B are the package's fp32 tensors, scale 2.0
    base = load_file(str(tiny_checkpoint.base / "model.safetensors"))
    lora = load_file(str(tiny_checkpoint.package / "checkpoint" / "adapter" / "adapter_model.safetensors"))
    wrapped = {name: m for name, m in model.backbone.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    assert len(wrapped) == 10
    for name, module in wrapped.items():
        short = name[name.index("layers."):]
        assert not getattr(module, "merged", False)
        assert module.scaling["default"] == 2.0
        a = module.lora_A["default"].weight
        b = module.lora_B["default"].weight
        assert a.dtype == torch.float32 and b.dtype == torch.float32
        assert torch.equal(a, lora[f"base_model.model.model.language_model.{short}.lora_A.weight"])
        assert torch.equal(b, lora[f"base_model.model.model.language_model.{short}.lora_B.weight"])
        assert torch.equal(module.base_layer.weight, base[f"model.language_model.{short}.weight"].float())


def test_reference_scores_equal_an_independent_fp32_merge(reference_model, tiny_checkpoint):
    """W + 2.0 * B @ A in fp32 on the plain base backbone gives the reference model's scores."""
    from transformers import Qwen3_5TextModel

    from hf_openjev.checkpoint.package import read_base_text_config

    config = read_base_text_config(tiny_checkpoint.base)
    plain = Qwen3_5TextModel(config).float().eval()
    base = load_file(str(tiny_checkpoint.base / "model.safetensors"))
    lora = load_file(str(tiny_checkpoint.package / "checkpoint" / "adapter" / "adapter_model.safetensors"))
    state = {k[len("model.language_model."):]: v.float() for k, v in base.items() if k.startswith("model.language_model.")}
    for key in lora:
        if ".lora_A." in key:
            module = key[len("base_model.model.model.language_model."):key.index(".lora_A.")]
            a, b = lora[key], lora[key.replace(".lora_A.", ".lora_B.")]
            state[f"{module}.weight"] = state[f"{module}.weight"] + 2.0 * (b @ a)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("inv_freq") for k in missing)
    manual = JevModel(plain, reference_model.head, reference_model.tokenizer, reference_model.manifest, method="manual")
    seqs = _sequences(reference_model)
    ours = score_reference(reference_model, seqs)
    theirs = score_reference(manual, seqs)
    assert len(set(ours)) == len(seqs)
    assert max(abs(x - y) for x, y in zip(ours, theirs)) < 1e-4


def test_reference_agrees_with_the_merged_export(reference_model, tiny_model):
    seqs = _sequences(tiny_model)
    ref, merged = score_reference(reference_model, seqs), score_reference(tiny_model, seqs)
    # the export rounds W + delta to bf16: close, not equal
    assert max(abs(x - y) for x, y in zip(ref, merged)) < 0.1


def test_reference_from_a_text_only_base(reference_model, tiny_checkpoint, tmp_path):
    base = tmp_path / "text-base"
    shutil.copytree(tiny_checkpoint.base, base)
    tensors = load_file(str(base / "model.safetensors"))
    text = {k[len("model.language_model."):]: v for k, v in tensors.items() if k.startswith("model.language_model.")}
    save_file(text, str(base / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())["text_config"]
    config["model_type"] = "qwen3_5_text"
    (base / "config.json").write_text(json.dumps(config))
    model = load_reference(base, tiny_checkpoint.package, dtype="float32", device="cpu", max_length=100)
    assert model.max_length == 100
    seqs = _sequences(model)
    assert score_reference(model, seqs) == score_reference(reference_model, seqs)


def _copy_package(tiny_checkpoint, tmp_path) -> Path:
    dst = tmp_path / "package"
    shutil.copytree(tiny_checkpoint.package, dst)
    return dst


def _reference_error(base, package) -> str:
    with pytest.raises(CheckpointError) as info:
        load_reference(base, package, dtype="float32", device="cpu")
    return str(info.value)


def test_reference_head_size_differs(tiny_checkpoint, tmp_path):
    package = _copy_package(tiny_checkpoint, tmp_path)
    head_path = package / "checkpoint" / "head.pt"
    head = torch.load(head_path, weights_only=True)
    torch.save({"weight": head["weight"][:, :48].clone(), "bias": head["bias"]}, head_path)
    assert _reference_error(tiny_checkpoint.base, package) == (
        "the head has 48 inputs but the base hidden size is 64")


def test_reference_head_not_finite(tiny_checkpoint, tmp_path):
    package = _copy_package(tiny_checkpoint, tmp_path)
    head_path = package / "checkpoint" / "head.pt"
    head = torch.load(head_path, weights_only=True)
    head["weight"][0, 3] = float("nan")
    torch.save(head, head_path)
    assert _reference_error(tiny_checkpoint.base, package) == (
        "head_weight contains non-finite values (NaN or infinity); the head is corrupt")


def test_reference_unsupported_base_config(tiny_checkpoint, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_checkpoint.base, base)
    config = json.loads((base / "config.json").read_text())
    config["model_type"] = "llama"
    (base / "config.json").write_text(json.dumps(config))
    assert _reference_error(base, tiny_checkpoint.package) == (
        f"{base / 'config.json'}: model_type 'llama' is not a Qwen3.5 model (expected one of qwen3_5, qwen3_5_text)")


def test_reference_missing_base_weights(tiny_checkpoint, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_checkpoint.base, base)
    tensors = load_file(str(base / "model.safetensors"))
    del tensors["model.language_model.norm.weight"]
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    assert _reference_error(base, tiny_checkpoint.package) == (
        f"{base}: 1 backbone weights are missing (e.g. ['norm.weight']); "
        "the checkpoint is incomplete or not a Qwen3.5 text model")


@pytest.mark.parametrize("victim, expected", [
    ("head.pt", "head.pt is missing (the scalar head)"),
    ("temperature.json", "temperature.json is missing (the calibration temperature)"),
    ("model.json", "model.json is missing (the package's model.json)"),
    ("adapter/adapter_model.safetensors", "adapter_model.safetensors is missing (the LoRA adapter weights)"),
])
def test_reference_missing_package_file(tiny_checkpoint, tmp_path, victim, expected):
    package = _copy_package(tiny_checkpoint, tmp_path)
    (package / "checkpoint" / victim).unlink()
    assert _reference_error(tiny_checkpoint.base, package).endswith(expected)


def test_reference_adapter_for_another_base(tiny_checkpoint, tmp_path):
    package = _copy_package(tiny_checkpoint, tmp_path)
    path = package / "checkpoint" / "adapter" / "adapter_model.safetensors"
    lora = load_file(str(path))
    key = "base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_A.weight"
    lora[key] = torch.randn(8, 32)
    save_file(lora, str(path))
    message = _reference_error(tiny_checkpoint.base, package)
    assert message.startswith("the adapter's layers.3.self_attn.q_proj has shapes A (8, 32)")
    assert message.endswith("adapter and base do not match")


def test_public_names():
    assert hf_openjev.CheckpointError is CheckpointError
    assert issubclass(CheckpointError, ValueError)
    assert hf_openjev.__version__ == "0.1.0"

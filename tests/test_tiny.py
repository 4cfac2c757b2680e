"""hf_openjev.checkpoint.tiny: the tiny random checkpoint (base + package + merged export) built locally."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from hf_openjev.checkpoint.manifest import EXPORT_FORMAT, MANIFEST_NAME
from hf_openjev.checkpoint.tiny import (
    SPECIAL_TOKENS,
    TINY_MODEL_ID,
    TINY_TEMPERATURE,
    build_tiny_tokenizer,
    tiny_text_config,
)
from hf_openjev.export.tiny import build_tiny_checkpoint

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
ONE_TURN = "<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def _tensors(path):
    with safe_open(str(path), framework="pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}


def test_config_has_both_layer_types_and_fits_the_design_limits():
    config = tiny_text_config()
    assert config.model_type == "qwen3_5_text"
    assert config.layer_types == ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    assert config.hidden_size == 64 and config.hidden_size <= 128
    assert 4 <= config.num_hidden_layers <= 8
    # GDN: value heads a multiple of key heads (and more of them, as in the real models)
    assert config.linear_num_value_heads % config.linear_num_key_heads == 0
    assert config.linear_num_value_heads > config.linear_num_key_heads
    assert config.num_attention_heads % config.num_key_value_heads == 0
    # a non-multiple-of-4 depth still gets a full-attention layer
    six = tiny_text_config(num_layers=6)
    assert six.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
    three = tiny_text_config(num_layers=3)
    assert three.layer_types == ["linear_attention", "linear_attention", "full_attention"]


def test_tokenizer_has_qwen_special_tokens_as_single_tokens():
    tok = build_tiny_tokenizer()
    assert SPECIAL_TOKENS == QWEN_SPECIALS
    ids = set()
    for special in QWEN_SPECIALS:
        encoded = tok(special, add_special_tokens=False)["input_ids"]
        assert len(encoded) == 1, special
        assert tok.convert_ids_to_tokens(encoded) == [special]
        ids.add(encoded[0])
    assert len(ids) == 5
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.eos_token == "<|im_end|>"
    # special tokens stay whole inside text, and nothing is added (no BOS)
    encoded = tok("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert encoded[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert encoded[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok("hi")["input_ids"] == tok("hi", add_special_tokens=False)["input_ids"]
    # byte-level: any text round-trips
    text = "Über naïve café — 日本語 🙂 {\"a\": [1, 2]}"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_renders_one_user_turn_with_thinking_disabled():
    tok = build_tiny_tokenizer()
    for prompt in ["p", "Context:\nx\n\nQuestion: y\n", ""]:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
        assert text == ONE_TURN.format(p=prompt)
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "p"}], tokenize=False,
                                        add_generation_prompt=False, enable_thinking=False)
    assert no_prompt == "<|im_start|>user\np<|im_end|>\n"


def test_base_directory_is_a_full_style_qwen35_checkpoint(tiny_checkpoint):
    base = tiny_checkpoint.base
    config = json.loads((base / "config.json").read_text())
    assert config["model_type"] == "qwen3_5"
    assert config["text_config"]["model_type"] == "qwen3_5_text"
    assert "architectures" not in config["text_config"]
    tensors = _tensors(base / "model.safetensors")
    assert {"model.visual.patch_embed.proj.weight", "mtp.fc.weight", "lm_head.weight"} <= set(tensors)
    text = [k for k in tensors if k not in {"model.visual.patch_embed.proj.weight", "mtp.fc.weight", "lm_head.weight"}]
    assert text and all(k.startswith("model.language_model.") for k in text)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    # zero-initialised norms were randomised: no norm weight is all zeros or all ones
    norms = [k for k in text if k.endswith("norm.weight")]
    assert norms and all(tensors[k].float().std() > 0.01 for k in norms)
    reloaded = AutoTokenizer.from_pretrained(str(base))
    assert len(reloaded) == config["text_config"]["vocab_size"]
    assert reloaded.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                        add_generation_prompt=True, enable_thinking=False) == ONE_TURN.format(p="q")


def test_package_layout(tiny_checkpoint):
    ckpt = tiny_checkpoint.package / "checkpoint"
    model_info = json.loads((ckpt / "model.json").read_text())
    assert model_info == {"model_id": TINY_MODEL_ID, "revision": "tiny-seed0", "max_length": 4096, "lora_rank": 8,
                          "method": "lora+scalar-head", "test_checkpoint": True}  # not checked against the family
    assert json.loads((ckpt / "temperature.json").read_text()) == {"temperature": TINY_TEMPERATURE}
    adapter_config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 8 and adapter_config["lora_alpha"] == 16.0
    assert sorted(adapter_config["target_modules"]) == ["in_proj_qkv", "k_proj", "o_proj", "out_proj", "q_proj",
                                                        "v_proj"]
    lora = _tensors(ckpt / "adapter" / "adapter_model.safetensors")
    # 3 GDN layers x (in_proj_qkv, out_proj) + 1 attention layer x (q, k, v, o) = 10 modules, A and B each
    assert len(lora) == 20
    assert all(k.startswith("base_model.model.model.language_model.layers.") for k in lora)
    assert all(t.dtype == torch.float32 and t.abs().sum() > 0 for t in lora.values())
    a = lora["base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_A.weight"]
    b = lora["base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_B.weight"]
    assert a.shape == (8, 64) and b.shape[1] == 8
    head = torch.load(ckpt / "head.pt", weights_only=True)
    assert set(head) == {"weight", "bias"}
    assert head["weight"].shape == (1, 64) and head["bias"].shape == (1,)
    assert head["weight"].dtype == torch.float32


def test_export_is_a_merged_text_checkpoint(tiny_checkpoint):
    export = tiny_checkpoint.export
    manifest = json.loads((export / MANIFEST_NAME).read_text())
    assert list(manifest) == ["format", "model_id", "base_revision", "base_fingerprint", "checkpoint_revision",
                              "temperature", "max_length", "chat_prefix", "chat_suffix", "head_weight", "head_bias",
                              "test_checkpoint"]
    assert manifest["test_checkpoint"] is True  # the package's mark, carried into the export
    assert manifest["format"] == EXPORT_FORMAT == "open-jev-text-merged/1"
    assert manifest["model_id"] == TINY_MODEL_ID
    assert manifest["temperature"] == TINY_TEMPERATURE
    assert manifest["max_length"] == 4096
    assert manifest["chat_prefix"] + "{p}" + manifest["chat_suffix"] == ONE_TURN
    head = torch.load(tiny_checkpoint.package / "checkpoint" / "head.pt", weights_only=True)
    assert manifest["head_weight"] == head["weight"].flatten().tolist()
    assert manifest["head_bias"] == float(head["bias"][0])
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    tensors = _tensors(export / "model.safetensors")
    assert not any(k.startswith(("model.", "mtp.", "lm_head", "visual")) for k in tensors)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    base = _tensors(tiny_checkpoint.base / "model.safetensors")
    assert set(tensors) == {k[len("model.language_model."):] for k in base if k.startswith("model.language_model.")}
    # a LoRA target changed, a non-target copied bit for bit
    assert not torch.equal(tensors["layers.3.self_attn.q_proj.weight"],
                           base["model.language_model.layers.3.self_attn.q_proj.weight"])
    assert torch.equal(tensors["layers.0.mlp.up_proj.weight"], base["model.language_model.layers.0.mlp.up_proj.weight"])


def test_build_is_skipped_when_complete_and_is_deterministic(tiny_checkpoint, tmp_path):
    manifest = tiny_checkpoint.export / MANIFEST_NAME
    before = manifest.stat().st_mtime_ns, manifest.stat().st_ino
    again = build_tiny_checkpoint(tiny_checkpoint.root)
    assert again == tiny_checkpoint
    assert (manifest.stat().st_mtime_ns, manifest.stat().st_ino) == before

    same = build_tiny_checkpoint(tmp_path / "same")
    other = build_tiny_checkpoint(tmp_path / "other", seed=1)
    ours = _tensors(tiny_checkpoint.export / "model.safetensors")
    same_t = _tensors(same.export / "model.safetensors")
    other_t = _tensors(other.export / "model.safetensors")
    assert set(same_t) == set(ours) and all(torch.equal(same_t[k], ours[k]) for k in ours)
    assert not torch.equal(other_t["layers.0.mlp.up_proj.weight"], ours["layers.0.mlp.up_proj.weight"])
    assert (json.loads((same.export / MANIFEST_NAME).read_text())
            == json.loads(manifest.read_text()))

    # an incomplete build (no manifest) is rebuilt from scratch
    (same.export / MANIFEST_NAME).unlink()
    (same.root / "stray.txt").write_text("x")
    rebuilt = build_tiny_checkpoint(same.root)
    assert (rebuilt.export / MANIFEST_NAME).is_file()
    assert not (same.root / "stray.txt").exists()


def test_an_unknown_tokenizer_kind_is_refused_before_anything_is_written(tmp_path):
    import pytest

    (tmp_path / "keep").mkdir()
    with pytest.raises(ValueError, match="tokenizer must be one of toy, qwen3.5"):
        build_tiny_checkpoint(tmp_path, tokenizer="gpt2")
    assert (tmp_path / "keep").is_dir()


def test_a_folder_that_is_not_a_tiny_build_is_refused_and_kept(tmp_path):
    """build_tiny_checkpoint clears only a folder it made (issue 36): a user's folder is refused in one line."""
    from hf_openjev.errors import UsageError

    mine = tmp_path / "mine"
    (mine / "export").mkdir(parents=True)
    (mine / "thesis.tex").write_text("chapter 1")
    with pytest.raises(UsageError, match=r"is not empty and holds no tiny build; nothing was changed") as info:
        build_tiny_checkpoint(mine)
    assert "\n" not in str(info.value)
    assert sorted(os.listdir(mine)) == ["export", "thesis.tex"]
    (tmp_path / "file").write_text("x")
    for root in (tmp_path / "file", tmp_path / "file" / "below"):
        with pytest.raises(UsageError, match="pass a folder for the tiny checkpoint"):
            build_tiny_checkpoint(root)
    assert (tmp_path / "file").read_text() == "x"


def test_a_build_of_an_earlier_version_without_the_mark_is_rebuilt(tiny_checkpoint, tmp_path):
    """A demo cache made before the mark existed (only base/package/export, the tiny package) is still ours."""
    from hf_openjev.export.tiny import BUILD_MARK

    old = tmp_path / "old"
    shutil.copytree(tiny_checkpoint.root, old)
    (old / BUILD_MARK).unlink()
    (old / "export" / MANIFEST_NAME).unlink()  # unfinished: rebuilt
    rebuilt = build_tiny_checkpoint(old)
    assert (rebuilt.export / MANIFEST_NAME).is_file() and (old / BUILD_MARK).is_file()

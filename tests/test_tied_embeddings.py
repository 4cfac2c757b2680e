"""Tied embeddings end to end (issue 31: the 2B ties its LM head to its embedding): a tiny tied base and package
export tied (the embedding once, no LM head, the flag kept, the same LoRA targets, verified bitwise against PEFT),
load on the reference and fast paths and score there as the untied model does, and FP8 (swap and export) leaves
the shared embedding alone.

The tied base stores the embedding once and no ``lm_head`` (what ``save_pretrained`` writes for a tied model);
its ``config.json`` says ``tie_word_embeddings: true`` at the top level and in ``text_config``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import independent_score, random_token_requests
from export_tensors import bits, stored_tensors
from safetensors.torch import load_file, save_file

from hf_openjev.checkpoint.package import PUBLISHED_TARGETS
from hf_openjev.checkpoint.tiny import build_tiny_tokenizer, tiny_text_config, write_tiny_base_and_package
from hf_openjev.export.merge import merge_lora
from hf_openjev.export.verify import bf16_ulp_distance
from hf_openjev.fast_path import score_fast
from hf_openjev.fp8.linear import Fp8Linear
from hf_openjev.fp8.quantize import quantize_export
from hf_openjev.fp8.swap import quantize_model_fp8
from hf_openjev.model import load_export, load_reference
from hf_openjev.patches import apply_patches

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

EMBED = "embed_tokens.weight"


def _tied_config():
    return tiny_text_config(vocab_size=len(build_tiny_tokenizer()), tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tied base + package (seed 3) and its export, verified (PEFT comparison and score probe)."""
    root = tmp_path_factory.mktemp("tied")
    base, package = write_tiny_base_and_package(root, seed=3, config=_tied_config())
    report = merge_lora(base, package, root / "export", progress=False)
    return root, base, package, root / "export", report


def test_the_tied_base_stores_its_embedding_once_and_says_it_is_tied(tied):
    _, base, _, _, _ = tied
    config = json.loads((base / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["text_config"]["tie_word_embeddings"] is True
    keys = set(load_file(str(base / "model.safetensors")))
    assert f"model.language_model.{EMBED}" in keys and "lm_head.weight" not in keys


def test_a_tied_export_keeps_the_flag_the_embedding_once_and_the_lora_targets(tied):
    _, base, package, export, report = tied
    config = json.loads((export / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    source = load_file(str(base / "model.safetensors"))
    exported = stored_tensors(export)
    text = {k[len("model.language_model."):]: v for k, v in source.items() if k.startswith("model.language_model.")}
    assert set(exported) == set(text)  # nothing duplicated (no lm_head), nothing dropped (the embedding is there)
    assert sum(1 for k in exported if "embed" in k or "lm_head" in k) == 1
    assert torch.equal(bits(exported[EMBED]), bits(text[EMBED]))
    assert report.dropped == 2  # the vision and MTP tensors: there is no LM head to drop
    adapter = json.loads((package / "checkpoint" / "adapter" / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == set(PUBLISHED_TARGETS)
    assert {m.rsplit(".", 1)[-1] for m in report.merged} == set(PUBLISHED_TARGETS) and len(report.merged) == 10


def test_a_tied_export_is_bitwise_peft_merge_and_unload(tied):
    _, base, package, export, report = tied
    reference = load_reference(base, package, dtype="bfloat16", device="cpu")
    peft_merged = reference.backbone.merge_and_unload().state_dict()
    exported = stored_tensors(export)
    assert set(peft_merged) == set(exported)
    assert max(bf16_ulp_distance(exported[k], v) for k, v in peft_merged.items()) == 0
    assert (report.tensor_check.modules, report.tensor_check.bitwise, report.tensor_check.max_ulp) == (10, 10, 0)
    assert report.probe.ran and report.probe.same_tokens_max_abs_dp <= 0.01


def test_the_top_level_tie_flag_of_a_full_config_reaches_the_export(tied, tmp_path):
    """Qwen3_5ForConditionalGeneration ties by the top-level flag: a text_config without it still exports tied."""
    _, base, package, _, _ = tied
    edited = tmp_path / "base"
    shutil.copytree(base, edited)
    config = json.loads((edited / "config.json").read_text())
    del config["text_config"]["tie_word_embeddings"]
    (edited / "config.json").write_text(json.dumps(config))
    merge_lora(edited, package, tmp_path / "export", progress=False, verify=False)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["tie_word_embeddings"] is True
    assert load_reference(edited, package, dtype="float32", device="cpu").backbone.config.tie_word_embeddings


def test_a_tied_base_that_also_stores_its_lm_head_exports_the_embedding_once(tied, tmp_path):
    _, base, package, export, _ = tied
    edited = tmp_path / "base"
    shutil.copytree(base, edited)
    weights = load_file(str(edited / "model.safetensors"))
    weights["lm_head.weight"] = weights[f"model.language_model.{EMBED}"].clone()
    save_file(weights, str(edited / "model.safetensors"), metadata={"format": "pt"})
    report = merge_lora(edited, package, tmp_path / "export", progress=False, verify=False)
    again = stored_tensors(tmp_path / "export")
    assert report.dropped == 3 and set(again) == set(stored_tensors(export))
    assert all(torch.equal(bits(v), bits(stored_tensors(export)[k])) for k, v in again.items())


def test_reference_and_export_load_a_tied_model_and_agree(tied):
    _, base, package, export, _ = tied
    merged = load_export(export, dtype="float32", device="cpu")
    reference = load_reference(base, package, dtype="float32", device="cpu")
    assert merged.config.tie_word_embeddings and reference.backbone.config.tie_word_embeddings
    for ids in [seq for req in random_token_requests(merged) for q in req for seq in q]:
        assert abs(independent_score(merged, ids) - independent_score(reference, ids)) < 0.05


def test_the_fast_path_scores_a_tied_model_as_the_reference_and_as_the_untied_one(tied, tmp_path):
    _, _, _, export, _ = tied
    untied_dir = tmp_path / "untied"
    shutil.copytree(export, untied_dir)
    config = json.loads((untied_dir / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (untied_dir / "config.json").write_text(json.dumps(config))
    models = {}
    for name, path in (("tied", export), ("untied", untied_dir)):
        models[name] = load_export(path, dtype="float32", device="cpu")
    assert models["tied"].config.tie_word_embeddings and not models["untied"].config.tie_word_embeddings
    requests = random_token_requests(models["tied"])
    want = [independent_score(models["tied"], seq) for req in requests for q in req for seq in q]
    got = {}
    for name, model in models.items():
        apply_patches(model)
        got[name], _ = score_fast(model, requests)
    assert len(want) == 9 and max(abs(a - b) for a, b in zip(got["tied"], want, strict=True)) <= 1e-4
    assert got["tied"] == got["untied"]


def test_the_fp8_swap_leaves_the_shared_embedding_alone(tied):
    _, _, _, export, _ = tied
    model = load_export(export, dtype="bfloat16", device="cpu")
    before = model.backbone.embed_tokens.weight.detach().clone()
    assert quantize_model_fp8(model, "all") == 25
    swapped = [n for n, m in model.backbone.named_modules() if isinstance(m, Fp8Linear)]
    assert len(swapped) == 25 and not any("embed" in n for n in swapped)
    assert isinstance(model.backbone.embed_tokens, torch.nn.Embedding)
    assert torch.equal(bits(model.backbone.embed_tokens.weight), bits(before))


def test_the_fp8_export_of_a_tied_model_keeps_the_embedding_and_the_flag(tied, tmp_path):
    _, _, _, export, _ = tied
    report = quantize_export(export, tmp_path / "fp8", progress=False)
    src, out = stored_tensors(export), stored_tensors(report.out_dir)
    assert EMBED not in report.quantized and f"{EMBED[:-len('weight')]}weight_scale" not in out
    assert out[EMBED].dtype == torch.bfloat16 and torch.equal(bits(out[EMBED]), bits(src[EMBED]))
    assert not any("lm_head" in k for k in out)
    assert json.loads((report.out_dir / "config.json").read_text())["tie_word_embeddings"] is True
    loaded = load_export(report.out_dir, dtype="float32", device="cpu", fp8="all")
    assert loaded.config.tie_word_embeddings
    assert torch.equal(loaded.backbone.embed_tokens.weight, src[EMBED].float())

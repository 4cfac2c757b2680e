"""hf_openjev.patches: apply / revert / context manager, identity of what is replaced, version gate, and what the
pipeline reports about prefix sharing.

Every test that patches works on a private copy of the tiny export (``own_model``), never on ``tiny_model``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import pipeline
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

import hf_openjev
from hf_openjev.family import text_model_of
from hf_openjev.fast_options import FastPathOptions
from hf_openjev.packing.planner import plan_requests
from hf_openjev.patches import PatchRecord, apply_patches, patch_record, patched, revert_patches
from hf_openjev.patches.final_row_mlp import PackedDecoderLayer, PackedTextModel
from hf_openjev.patches.packed_candidates import PackedAttention, PackedGatedDeltaNet
from hf_openjev.patches.record import RECORD_ATTRIBUTE, check_transformers_version
from hf_openjev.scoring import answer_requests, prepare_request

torch.set_num_threads(1)

STOCK_TO_PATCHED = {qwen.Qwen3_5TextModel: PackedTextModel, qwen.Qwen3_5DecoderLayer: PackedDecoderLayer,
                    qwen.Qwen3_5GatedDeltaNet: PackedGatedDeltaNet, qwen.Qwen3_5Attention: PackedAttention}

LONG_STATE = ("The customer wrote three times about order 5531: the parcel left the warehouse on Monday, was "
              "scanned in Leipzig on Tuesday and has not moved since. They ask whether to wait, to cancel the "
              "order, or to have it sent again to a new address in Hamburg, and mention a billing question too.")
REQUEST = {"state": LONG_STATE, "questions": {
    "intent": {"type": "choice", "instructions": "Which intent does the message express?",
               "criteria": {"cancel": None, "track": "Where is the parcel?", "address": None, "billing": None}},
    "severity": {"type": "score", "instructions": "Rate the severity.",
                 "criteria": ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]},
    "late": {"type": "noul", "instructions": "Is the parcel late?"},
    "only": {"type": "choice", "instructions": "Pick", "criteria": {"single": None}}}}
SHORT = {"state": "hi", "questions": {"n": {"type": "noul", "instructions": "Late?"}}}


@pytest.fixture()
def own_model(tiny_checkpoint):
    """A private fp32 CPU copy of the tiny export (patches applied to it never leak into other tests)."""
    model = hf_openjev.load_export(tiny_checkpoint.export, dtype=torch.float32)
    assert patch_record(model) is None
    return model


def module_types(model) -> list[tuple[nn.Module, type]]:
    return [(m, type(m)) for m in model.modules()]


def parameters(model) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters()) + list(model.named_buffers())


@torch.no_grad()
def stock_outputs(model) -> list[torch.Tensor]:
    """Stock forwards (no ``pack``): a padded batch with a mask, and an unpadded sequence."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (3, 90), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 70:] = 0
    mask[2, 5:] = 0
    padded = model.backbone(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    single = model.backbone(input_ids=ids[:1, :77], use_cache=False).last_hidden_state
    return [padded, single]


# --- apply / revert ------------------------------------------------------------------------------------------

def test_apply_swaps_classes_and_keeps_every_parameter_object(own_model):
    before_types = module_types(own_model)
    before_params = parameters(own_model)
    record = apply_patches(own_model)
    assert isinstance(record, PatchRecord) and record.options == FastPathOptions()
    assert patch_record(own_model) is record
    assert getattr(own_model.backbone, RECORD_ATTRIBUTE) is record
    replaced = []
    for module, original in before_types:
        if original in STOCK_TO_PATCHED:
            assert type(module) is STOCK_TO_PATCHED[original]
            assert isinstance(module, original)  # a subclass: isinstance checks elsewhere keep working
            replaced.append((module, original))
        else:
            assert type(module) is original
    assert [(id(m), c) for m, c in record.replaced] == [(id(m), c) for m, c in replaced]
    config = own_model.config
    n_linear = sum(t == "linear_attention" for t in config.layer_types[: config.num_hidden_layers])
    counts = {cls: sum(type(m) is cls for m in own_model.modules()) for cls in STOCK_TO_PATCHED.values()}
    assert counts == {PackedTextModel: 1, PackedDecoderLayer: config.num_hidden_layers,
                      PackedGatedDeltaNet: n_linear, PackedAttention: config.num_hidden_layers - n_linear}
    after_params = parameters(own_model)
    assert [n for n, _ in after_params] == [n for n, _ in before_params]
    assert all(a is b for (_, a), (_, b) in zip(after_params, before_params))
    assert [(m, type(m)) for m in own_model.modules()] == [(m, STOCK_TO_PATCHED.get(c, c)) for m, c in before_types]


def test_apply_twice_is_a_no_op(own_model):
    record = apply_patches(own_model)
    types = module_types(own_model)
    replaced = list(record.replaced)
    again = apply_patches(own_model)
    assert again is record
    assert record.replaced == replaced
    assert module_types(own_model) == types
    assert record.options == FastPathOptions()


def test_revert_restores_exactly_what_was_replaced(own_model):
    before_types = module_types(own_model)
    before_params = parameters(own_model)
    apply_patches(own_model, FastPathOptions(shared_prefix=False))
    assert revert_patches(own_model) is True
    for (module, original), (module_after, type_after) in zip(before_types, module_types(own_model)):
        assert module_after is module
        assert type(module) is original and type_after is original
    assert all(a is b for (_, a), (_, b) in zip(parameters(own_model), before_params))
    assert patch_record(own_model) is None
    assert not hasattr(own_model.backbone, RECORD_ATTRIBUTE)
    assert revert_patches(own_model) is False  # nothing left to revert
    record = apply_patches(own_model)  # and it can be patched again from scratch
    assert record.options == FastPathOptions() and len(record.replaced) == sum(
        c in STOCK_TO_PATCHED for _, c in before_types)


def test_revert_on_an_unpatched_model_returns_false(own_model):
    types = module_types(own_model)
    assert revert_patches(own_model) is False
    assert module_types(own_model) == types


def test_patches_work_on_a_bare_backbone_too(own_model):
    backbone = own_model.backbone
    record = apply_patches(backbone)
    assert type(backbone) is PackedTextModel and patch_record(own_model) is record
    assert revert_patches(own_model) is True
    assert type(backbone) is qwen.Qwen3_5TextModel


def test_a_model_without_a_qwen_text_model_is_refused():
    with pytest.raises(TypeError, match="Qwen3_5TextModel"):
        apply_patches(nn.Linear(2, 2))
    with pytest.raises(TypeError):
        text_model_of(nn.Sequential(nn.Linear(2, 2)))


def test_context_manager_applies_and_reverts(own_model):
    types = module_types(own_model)
    with patched(own_model, FastPathOptions(final_row_mlp=False)) as record:
        assert patch_record(own_model) is record
        assert record.options == FastPathOptions(final_row_mlp=False)
        assert type(own_model.backbone) is PackedTextModel
    assert patch_record(own_model) is None
    assert module_types(own_model) == types


def test_context_manager_reverts_on_error(own_model):
    types = module_types(own_model)
    with pytest.raises(KeyError):
        with patched(own_model):
            raise KeyError("boom")
    assert patch_record(own_model) is None and module_types(own_model) == types


def test_context_manager_leaves_patches_it_did_not_apply(own_model):
    record = apply_patches(own_model)
    types = module_types(own_model)
    with patched(own_model) as inner:
        assert inner is record
    assert patch_record(own_model) is record
    assert module_types(own_model) == types


def test_context_manager_restores_the_options_it_changed(own_model):
    # The model was patched with the defaults; a block that asks for other options must not leave them behind
    # ("the context manager reverts only what it applied": here it applied an options change).
    record = apply_patches(own_model)
    with patched(own_model, FastPathOptions(shared_prefix=False, final_row_mlp=False)) as inner:
        assert inner.options == FastPathOptions(shared_prefix=False, final_row_mlp=False)
    assert patch_record(own_model) is record
    assert record.options == FastPathOptions()


def test_a_patched_model_without_pack_is_bit_identical_to_the_stock_model(own_model):
    stock = stock_outputs(own_model)
    apply_patches(own_model)
    patched_out = stock_outputs(own_model)
    assert all(torch.equal(a, b) for a, b in zip(stock, patched_out))
    reference = answer_requests(own_model, [REQUEST], fast=False)[0]
    revert_patches(own_model)
    assert all(torch.equal(a, b) for a, b in zip(stock, stock_outputs(own_model)))
    unpatched = answer_requests(own_model, [REQUEST], fast=False)[0]
    assert reference["answers"] == unpatched["answers"]


# --- the Transformers version gate ---------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["5.16.0", "5.16.9", "5.25.0", "5.30.1", "4.57.0", "6.0.0"])
def test_unsupported_transformers_versions_are_refused_with_a_clear_message(version):
    with pytest.raises(RuntimeError) as info:
        check_transformers_version(version)
    message = str(info.value)
    assert "transformers" in message and version in message
    assert ">=5.17" in message and "<5.25" in message
    assert "fast=False" in message


@pytest.mark.parametrize("version", ["5.17.0", "5.17.1", "5.24.0", "5.24.0.dev0", "5.20.0rc1"])
def test_supported_transformers_versions_pass(version):
    assert check_transformers_version(version) is None


def test_the_installed_transformers_version_is_supported():
    check_transformers_version()


def test_apply_on_an_unsupported_transformers_changes_nothing(own_model, monkeypatch):
    import transformers

    types = module_types(own_model)
    monkeypatch.setattr(transformers, "__version__", "5.16.0")
    with pytest.raises(RuntimeError, match="5.16.0"):
        apply_patches(own_model)
    assert patch_record(own_model) is None
    assert module_types(own_model) == types


# --- what the pipeline reports --------------------------------------------------------------------------------

def test_pipeline_reports_prefix_sharing_and_the_same_usage(own_model):
    jev = pipeline("jev-decision", model=own_model, device="cpu", dtype="float32", fast=True)  # patches own_model
    reference = jev(REQUEST, fast=False)
    fast = jev(REQUEST, fast=True)
    prepared = prepare_request(own_model, REQUEST)
    expected_shared = plan_requests([prepared.tokens]).shared_tokens[0]
    assert len(prepared.tokens[0][0]) > 128  # the request prefix (chat prefix + state) is long
    assert expected_shared >= 64 * (prepared.parsed.candidate_count - 1) > 0
    assert reference["metadata"]["prefix_cache"] == {"enabled": False, "mode": "none", "shared_tokens": 0}
    assert fast["metadata"]["prefix_cache"] == {"enabled": True, "mode": "prefix-tree",
                                                "shared_tokens": expected_shared}
    assert reference["metadata"]["method"] == "reference" and fast["metadata"]["method"] == "fast"
    assert fast["usage"] == reference["usage"] == {"input_tokens": prepared.input_tokens, "output_tokens": 0}
    for qid, answer in reference["answers"].items():
        other = fast["answers"][qid]
        for key in ("choice", "probabilities", "noul", "score"):
            if key == "choice":
                assert other.get(key) == answer.get(key)
            elif key == "probabilities" and key in answer:
                assert max(abs(answer[key][k] - other[key][k]) for k in answer[key]) <= 1e-4
            elif key in answer:
                assert other[key] == pytest.approx(answer[key], abs=1e-4)


def test_the_fast_path_scores_in_inference_mode_and_leaves_the_weights_writable(own_model):
    """score_fast runs the patched forward under torch.inference_mode (no autograd keys on any op call); nothing
    it leaves on the model is an inference tensor, so the weights still load in place afterwards."""
    from hf_openjev.fast_path import score_fast

    apply_patches(own_model)
    modes = []
    handle = text_model_of(own_model).register_forward_pre_hook(
        lambda module, args, kwargs: modes.append(torch.is_inference_mode_enabled()), with_kwargs=True)
    try:
        scores, _ = score_fast(own_model, [prepare_request(own_model, r).tokens for r in (REQUEST, SHORT)])
    finally:
        handle.remove()
    assert modes and all(modes) and len(scores) == 4 + 10 + 1 + 1 + 1
    assert not any(t.is_inference() for _, t in parameters(own_model))
    own_model.load_state_dict({name: t.clone() for name, t in own_model.state_dict().items()})


def test_prefix_cache_per_request_and_with_sharing_switched_off(own_model):
    prepared = [prepare_request(own_model, r) for r in (REQUEST, SHORT)]
    expected = plan_requests([p.tokens for p in prepared]).shared_tokens
    assert expected[0] > 0 and expected[1] == 0
    apply_patches(own_model)
    fast = answer_requests(own_model, [REQUEST, SHORT], fast=True)
    assert [r["metadata"]["prefix_cache"] for r in fast] == [
        {"enabled": True, "mode": "prefix-tree", "shared_tokens": n} for n in expected]
    reference = answer_requests(own_model, [REQUEST, SHORT], fast=False)
    assert [r["usage"] for r in fast] == [r["usage"] for r in reference]
    assert [r["usage"]["input_tokens"] for r in fast] == [p.input_tokens for p in prepared]

    apply_patches(own_model, FastPathOptions(shared_prefix=False))
    unshared = answer_requests(own_model, [REQUEST, SHORT], fast=True)
    assert [r["metadata"]["prefix_cache"] for r in unshared] == [
        {"enabled": False, "mode": "none", "shared_tokens": 0}] * 2
    assert [r["usage"] for r in unshared] == [r["usage"] for r in reference]
    # a bigger threshold than the shared prefix: enabled, but nothing shared
    apply_patches(own_model)
    huge = answer_requests(own_model, [REQUEST], fast=True, options=FastPathOptions(min_shared_tokens=10_000))[0]
    assert huge["metadata"]["prefix_cache"] == {"enabled": True, "mode": "prefix-tree", "shared_tokens": 0}
    assert huge["usage"] == reference[0]["usage"]


# --- a family member's own defaults reach the model through one door --------------------------------------------

@pytest.fixture()
def tiny_is_a_member(own_model, monkeypatch):
    """The tiny shape registered as a family member with defaults of its own (as the 2B has)."""
    from hf_openjev import family
    from hf_openjev.fast_options import MEMBER_DEFAULTS

    member = family.FamilyMember("Open-Jev-Tiny", "none/tiny", family.shape_of(text_model_of(own_model).config),
                                 1.0, tied=False)
    monkeypatch.setattr(family, "MEMBERS", (*family.MEMBERS, member))
    monkeypatch.setitem(MEMBER_DEFAULTS, member.name, {"packed_candidates": False, "min_shared_tokens": 5})
    return FastPathOptions(packed_candidates=False, min_shared_tokens=5)


def test_a_member_without_options_given_gets_its_own_defaults(own_model, tiny_is_a_member):
    from hf_openjev.patches import read_options

    assert read_options(own_model) == tiny_is_a_member  # not patched yet: what apply_patches would use
    assert apply_patches(own_model).options == tiny_is_a_member
    assert apply_patches(own_model).options == tiny_is_a_member  # again: kept, not reset to the package's


def test_the_pipeline_names_options_over_the_members_defaults(own_model, tiny_is_a_member):
    pipe = pipeline("jev-decision", model=own_model, fast=True, cuda_graphs=False)
    assert pipe._fast_options == tiny_is_a_member.replace(cuda_graphs=False)
    assert patch_record(own_model).options == tiny_is_a_member.replace(cuda_graphs=False)

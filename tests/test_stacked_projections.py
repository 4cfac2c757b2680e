"""patches/stacked_projections.py: one GEMM per module, no weight copies, same Parameter objects."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen3_5TextModel

from hf_openjev.checkpoint.tiny import tiny_text_config
from hf_openjev.patches.stacked_projections import GROUPS, STACKED_ATTRIBUTE, projections, stack_projections

torch.set_num_threads(1)


def _model(seed=0):
    torch.manual_seed(seed)
    return Qwen3_5TextModel(tiny_text_config(vocab_size=97, num_layers=4)).eval()


def _storages(model):
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}


def _groups(model):
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__name__ in GROUPS:
                yield module, GROUPS[cls.__name__]


def test_stacking_keeps_parameters_and_values_and_adds_no_memory():
    model = _model()
    params_before = {name: p for name, p in model.named_parameters()}
    values_before = {name: p.detach().clone() for name, p in model.named_parameters()}
    bytes_before = sum(_storages(model).values())
    count = stack_projections(model)
    assert count == 3 + 1 + 4  # 3 GDN mixers, 1 attention, 4 MLPs (the tiny config's 4 layers)
    for name, p in model.named_parameters():
        assert p is params_before[name]
        assert torch.equal(p, values_before[name])
    assert sum(_storages(model).values()) == bytes_before
    for module, names in _groups(model):
        stacked = getattr(module, STACKED_ATTRIBUTE)
        for name in names:  # every projection's weight is a view of the one stacked weight
            weight = getattr(module, name).weight
            assert weight.untyped_storage().data_ptr() == stacked.weight.untyped_storage().data_ptr()
    assert stack_projections(model) == 0  # idempotent


def test_stacked_outputs_equal_the_separate_layers():
    model = _model(1)
    x = torch.randn(37, model.config.hidden_size)
    expected = {id(m): tuple(getattr(m, n)(x) for n in names) for m, names in _groups(model)}
    stack_projections(model)
    for module, names in _groups(model):
        got = projections(module, x)
        assert len(got) == len(names)
        for a, b in zip(got, expected[id(module)]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_moved_or_cast_model_is_stacked_again():
    model = _model(2)
    stack_projections(model)
    model.to(torch.float64)  # .to() gives each Parameter its own new storage
    x = torch.randn(5, model.config.hidden_size, dtype=torch.float64)
    for module, names in _groups(model):
        got = projections(module, x)
        assert got[0].dtype == torch.float64
        for a, name in zip(got, names):
            torch.testing.assert_close(a, getattr(module, name)(x))
        stacked = getattr(module, STACKED_ATTRIBUTE)
        assert getattr(module, names[0]).weight.data_ptr() == stacked.weight.data_ptr()


@pytest.mark.parametrize("path", ["stack", "restack"])
def test_stacking_inside_inference_mode_leaves_weights_a_later_update_can_write(path):
    """score_fast runs under torch.inference_mode, so a model cast since stacking is stacked again there
    ("restack"), and a caller may patch a model inside inference mode ("stack"). Either way the weights must not
    become inference tensors: loading a state dict (an in-place copy) outside inference mode would then fail."""
    model = _model(3)
    if path == "stack":
        with torch.inference_mode():
            stack_projections(model)
    else:
        stack_projections(model)
        model.to(torch.float64)
        x = torch.randn(5, model.config.hidden_size, dtype=torch.float64)
        with torch.inference_mode():
            for module, _ in _groups(model):
                projections(module, x)
    assert not any(p.is_inference() for p in model.parameters())
    state = {name: torch.zeros_like(p) for name, p in model.state_dict().items()}
    model.load_state_dict(state)  # in place, outside inference mode
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())


def test_wrapped_projections_are_left_alone():
    model = _model(3)
    mlp = model.layers[0].mlp

    class Wrapper(nn.Module):  # stands in for a PEFT LoRA layer
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) + 1

    mlp.up_proj = Wrapper(mlp.up_proj)
    stack_projections(model)
    assert getattr(mlp, STACKED_ATTRIBUTE, None) is None
    x = torch.randn(3, model.config.hidden_size)
    gate, up = projections(mlp, x)
    torch.testing.assert_close(up, mlp.up_proj(x))

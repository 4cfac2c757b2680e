"""hf_openjev.fp8.prepare: ``prepare_model_for_fp8`` swaps a model's projections where it is, then moves it; the
loader, the pipeline and ``apply_patches`` all go through it (one door), and what it refuses it refuses before
anything changes."""

from __future__ import annotations

import pytest

import hf_openjev.fp8.prepare as prepare_module
from hf_openjev.checkpoint.fp8_scheme import resolve_fp8_targets
from hf_openjev.errors import UsageError
from hf_openjev.fast_options import FastPathOptions
from hf_openjev.fp8 import prepare_model_for_fp8
from hf_openjev.fp8.linear import Fp8Linear
from hf_openjev.fp8.swap import fp8_modules
from hf_openjev.model import load_export
from hf_openjev.patches import apply_patches

SWAPPED = {"all": 25, "no-gdn": 16}  # Fp8Linear modules of the tiny model per mode

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def _load(tiny_checkpoint):
    return load_export(tiny_checkpoint.export, dtype="float32", device="cpu")


def _fp8_count(model) -> int:
    return sum(isinstance(m, Fp8Linear) for m in model.backbone.modules())


@pytest.mark.parametrize("mode", ["all", "no-gdn"])
def test_prepare_swaps_where_the_model_is_then_moves_it(tiny_checkpoint, monkeypatch, mode):
    model = _load(tiny_checkpoint)
    moves = []
    original = type(model).to

    def recording(self, *args, **kwargs):
        moves.append((str(args[0]), _fp8_count(self)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "to", recording)
    assert prepare_model_for_fp8(model, mode, "meta") == SWAPPED[mode]
    assert moves == [("meta", SWAPPED[mode])]  # one move, of the model already in FP8
    assert fp8_modules(model) == resolve_fp8_targets(mode)
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    assert prepare_model_for_fp8(model, mode) == 0  # idempotent: nothing left to swap, no move without a device


def test_prepare_off_leaves_a_bf16_model_as_it_is(tiny_checkpoint):
    model = _load(tiny_checkpoint)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert prepare_model_for_fp8(model, "off") == 0
    assert _fp8_count(model) == 0 and {name: p.data_ptr() for name, p in model.named_parameters()} == before


@pytest.mark.parametrize("mode, device, error, message", [
    ("fp16", None, UsageError, "fp8 must be one of"),
    ("all", {"": "cpu"}, UsageError, "loads the model onto one device"),
])
def test_prepare_refuses_a_bad_mode_or_a_device_map_before_anything_changes(tiny_checkpoint, mode, device, error,
                                                                             message):
    model = _load(tiny_checkpoint)
    with pytest.raises(error, match=message):
        prepare_model_for_fp8(model, mode, device)
    assert _fp8_count(model) == 0


def test_prepare_refuses_to_narrow_an_fp8_model(tiny_checkpoint):
    model = _load(tiny_checkpoint)
    prepare_model_for_fp8(model, "all")
    for narrower in ("no-gdn", "off"):
        with pytest.raises(ValueError, match="already FP8"):
            prepare_model_for_fp8(model, narrower)
    assert _fp8_count(model) == SWAPPED["all"]


def test_the_loader_the_pipeline_and_apply_patches_all_prepare_through_the_one_door(tiny_checkpoint, monkeypatch):
    calls = []
    real = prepare_module.prepare_model_for_fp8

    def recording(model, fp8, device=None):
        calls.append((fp8, None if device is None else str(device)))
        return real(model, fp8, device)

    monkeypatch.setattr(prepare_module, "prepare_model_for_fp8", recording)
    load_export(tiny_checkpoint.export, dtype="float32", device="cpu", fp8="no-gdn")
    assert calls == [("no-gdn", "cpu")]

    from transformers import pipeline

    calls.clear()
    pipeline("jev-decision", model=_load(tiny_checkpoint), device="cpu", fast=True, fp8="all")
    assert calls[0] == ("all", None)  # the pipeline's swap, before Pipeline.__init__ moves the model

    calls.clear()
    apply_patches(_load(tiny_checkpoint), FastPathOptions(fp8="all"))
    assert calls == [("all", None)]


def test_the_fp8_door_imports_no_torch():
    import subprocess
    import sys

    code = ("import hf_openjev.fp8, hf_openjev.fp8.option, hf_openjev.checkpoint.fp8_scheme\nimport sys\n"
            "assert hf_openjev.fp8.FP8_CHOICES == ('off', 'all', 'no-gdn')\n"
            "assert 'torch' not in sys.modules, 'torch loaded'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

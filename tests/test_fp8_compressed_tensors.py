"""The compressed-tensors library (and Transformers through it) reads what the FP8 export writes: the config parses
as the library's own FP8_DYNAMIC preset, the library's target/ignore matching picks exactly the modules that were
quantized, and Transformers loads the directory (compressed and dequantized) with every tensor in place."""

import inspect
import json
import warnings

import pytest
import torch
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from safetensors.torch import load_file
from transformers import CompressedTensorsConfig, Qwen3_5TextConfig, Qwen3_5TextModel

from hf_openjev.checkpoint.fp8_scheme import ALL_TARGETS, GDN_IN_BF16
from hf_openjev.fp8.quantize import quantize_export
from hf_openjev.fp8.state import load_fp8_state_dict

VARIANTS = {"all": ALL_TARGETS, "gdn-bf16": GDN_IN_BF16}


@pytest.fixture(scope="module", params=list(VARIANTS))
def fp8(request, tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"fp8-{request.param}") / "export"
    return quantize_export(tiny_checkpoint.export, out, targets=VARIANTS[request.param], progress=False)


def _ct_config(export_dir) -> dict:
    return json.loads((export_dir / "config.json").read_text())["quantization_config"]


def _plain_config(export_dir):
    config = Qwen3_5TextConfig.from_pretrained(str(export_dir))
    del config.quantization_config
    return config


def test_config_parses_as_the_fp8_dynamic_preset(fp8):
    config = QuantizationConfig.model_validate(_ct_config(fp8.out_dir))
    assert config.quant_method == "compressed-tensors" and config.format == "float-quantized"
    assert config.quantization_status == QuantizationStatus.COMPRESSED and config.kv_cache_scheme is None
    (group,) = config.config_groups.values()
    preset = preset_name_to_scheme("FP8_DYNAMIC", group.targets)
    assert group.weights == preset.weights and group.input_activations == preset.input_activations
    assert group.output_activations is None
    assert group.weights.strategy == "channel" and group.input_activations.strategy == "token"
    assert group.input_activations.dynamic is True and group.weights.dynamic is False


def test_the_librarys_matching_picks_exactly_the_quantized_modules(fp8):
    config = QuantizationConfig.model_validate(_ct_config(fp8.out_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Qwen3_5TextModel(_plain_config(fp8.out_dir))
    apply_quantization_config(model, config, show_progress=False)
    chosen = {name for name, module in model.named_modules() if getattr(module, "quantization_scheme", None)}
    assert chosen == {name[: -len(".weight")] for name in fp8.quantized}
    linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    assert any("in_proj_a" in n for n in linears - chosen) and chosen < linears


def _load(export_dir, dtype, **quant):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the quantization_config from the model will be used" (the one passed sets
        kwargs = {"quantization_config": CompressedTensorsConfig(**quant)} if quant else {}  # only the loading mode)
        model, info = Qwen3_5TextModel.from_pretrained(str(export_dir), dtype=dtype, output_loading_info=True, **kwargs)
    assert not any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model


def _dequantize_kwargs() -> dict:
    """Transformers >= 5.2x says ``dequantize=True``; older ones only ``run_compressed=False``."""
    if "dequantize" in inspect.signature(CompressedTensorsConfig.__init__).parameters:
        return {"dequantize": True}
    return {"run_compressed": False}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_transformers_dequantizes_to_our_dequantized_state(fp8, dtype):
    model = _load(fp8.out_dir, dtype, **_dequantize_kwargs())
    ours = load_fp8_state_dict(fp8.out_dir, dtype=dtype)
    theirs = model.state_dict()
    extra = set(theirs) - set(ours)
    # Transformers 5.17 dequantizes the weights but keeps their (now unused) scales; newer releases drop them
    assert extra in (set(), {name + "_scale" for name in fp8.quantized}), sorted(extra)[:4]
    assert set(ours) <= set(theirs)
    # ... and multiplies by the scale rounded to bf16 in bf16, where ours multiplies in fp32 and rounds once: in bf16
    # the two may then differ by a bf16 rounding of the scale (2^-8 relative) on that older path only
    rounded_scale = bool(extra) and dtype == torch.bfloat16
    for name, tensor in ours.items():
        assert theirs[name].dtype == dtype, name
        if rounded_scale:
            torch.testing.assert_close(theirs[name], tensor, rtol=2**-7, atol=0, msg=name)
        else:
            assert torch.equal(theirs[name], tensor), name


def test_transformers_compressed_load_holds_our_fp8_bits(fp8):
    model = _load(fp8.out_dir, torch.float32)  # the config's own mode: weights stay e4m3 (scales in the model dtype)
    stored = load_file(str(fp8.out_dir / "model.safetensors"))
    modules = dict(model.named_modules())
    for name in fp8.quantized:
        module = modules[name[: -len(".weight")]]
        assert module.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(module.weight.view(torch.uint8), stored[name].view(torch.uint8))
        assert torch.equal(module.weight_scale, stored[name + "_scale"])

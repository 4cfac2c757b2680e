"""hf_openjev.fp8.state: the FP8 export dequantized into a state dict that a stock Qwen3_5TextModel loads."""

import json
import shutil

import pytest
import torch

from hf_openjev.errors import CheckpointError
from hf_openjev.fp8.quantize import quantize_export
from hf_openjev.fp8.state import dequantize_fp8_state, load_fp8_state_dict
from hf_openjev.ops.fp8_linear import quantize_weight_per_channel

E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def fp8_dir(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8state") / "export"
    quantize_export(tiny_checkpoint.export, out, progress=False)
    return out


def _pair(n=12, k=40, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return w, *quantize_weight_per_channel(w)


def test_dequantize_fp8_state_replaces_pairs_and_passes_the_rest():
    w, w_fp8, scale = _pair()
    norm = torch.randn(40).bfloat16()
    out = dequantize_fp8_state({"a.weight": w_fp8, "a.weight_scale": scale, "n.weight": norm})
    assert set(out) == {"a.weight", "n.weight"} and out["n.weight"] is norm
    assert out["a.weight"].dtype == torch.bfloat16
    want = (w_fp8.float() * scale).bfloat16()  # written out: fp32 product, one rounding
    assert torch.equal(out["a.weight"], want)
    flat = dequantize_fp8_state({"a.weight": w_fp8, "a.weight_scale": scale.reshape(-1)}, dtype=torch.float32)
    assert torch.equal(flat["a.weight"], w_fp8.float() * scale)
    assert ((flat["a.weight"] - w).abs() <= torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)).all()


@pytest.mark.parametrize("case, message", [
    ("scale alone", "has no a.weight beside it"),
    ("weight alone", "has no a.weight_scale"),
    ("scale shape", "one scale per output channel"),
    ("scale dtype", "fp32 scales"),
    ("e5m2", "float8_e4m3fn weights only"),
])
def test_dequantize_fp8_state_refuses_what_does_not_pair(case, message):
    _, w_fp8, scale = _pair()
    state = {
        "scale alone": {"a.weight_scale": scale},
        "weight alone": {"a.weight": w_fp8},
        "scale shape": {"a.weight": w_fp8, "a.weight_scale": scale[:6]},
        "scale dtype": {"a.weight": w_fp8, "a.weight_scale": scale.bfloat16()},
        "e5m2": {"a.weight": w_fp8.float().to(torch.float8_e5m2)},
    }[case]
    with pytest.raises(CheckpointError, match=message):
        dequantize_fp8_state(state)


def test_the_dequantized_export_runs_in_a_stock_backbone(fp8_dir, tiny_model):
    """Loaded strictly into Qwen3_5TextModel (config without quantization_config), it runs close to the bf16 export
    (fp8 weights only: no activation quantization on this path) but not identically."""
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    state = load_fp8_state_dict(fp8_dir, dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in state.values())
    config = Qwen3_5TextConfig.from_pretrained(str(fp8_dir))
    assert config.quantization_config["quant_method"] == "compressed-tensors"
    del config.quantization_config  # else from_pretrained would route through the quantizer
    backbone = Qwen3_5TextModel(config).eval()
    backbone.load_state_dict(state, strict=True)
    ids = torch.tensor([tiny_model.encode("Is this proposed answer correct? Answer Yes or No.")])
    with torch.no_grad():
        got = backbone(input_ids=ids, use_cache=False).last_hidden_state
        want = tiny_model.backbone(input_ids=ids, use_cache=False).last_hidden_state
    rel = ((got - want).norm() / want.norm()).item()
    print(f"dequantized FP8 vs bf16 export: relative difference of the final hidden states {rel:.3e}")
    assert 1e-4 < rel < 0.1


def test_load_fp8_state_dict_refuses_bf16_and_edited_exports(tiny_checkpoint, fp8_dir, tmp_path):
    with pytest.raises(CheckpointError, match="not an FP8 export"):
        load_fp8_state_dict(tiny_checkpoint.export)
    edited = tmp_path / "edited"
    shutil.copytree(fp8_dir, edited)
    manifest = json.loads((edited / "open_jev_export.json").read_text())
    manifest["quantization"]["quantized_weights"] = 24
    (edited / "open_jev_export.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="25 weights are e4m3 but the manifest says 24"):
        load_fp8_state_dict(edited)
    manifest["quantization"]["modules"] = ["mlp.down_proj"]
    (edited / "open_jev_export.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not match the manifest"):
        load_fp8_state_dict(edited)

"""hf_openjev.fp8.quantize.quantize_export on the tiny export: names, dtypes, scales, fp8 error, bit-identical copies,
the GDN-in-bf16 variant, streaming over shards, manifest/config, refusals, nothing left behind on failure."""

import json
import shutil

import pytest
import torch
from export_tensors import bits as _bits
from export_tensors import stored_tensors as _tensors
from safetensors.torch import load_file, save_file

from hf_openjev.checkpoint.files import base_weight_files
from hf_openjev.checkpoint.fp8_scheme import (
    FP8_EXPORT_FORMAT,
    GDN_IN_BF16,
    QUANTIZABLE,
    read_fp8_quantization,
    target_of,
)
from hf_openjev.checkpoint.manifest import read_manifest
from hf_openjev.errors import CheckpointError
from hf_openjev.export.merge import merge_lora
from hf_openjev.fp8 import quantize as fp8_export
from hf_openjev.fp8.quantize import quantize_export
from hf_openjev.ops.fp8_linear import dequantize_weight, quantize_weight_per_channel

E4M3 = torch.float8_e4m3fn
NEVER = ("embed_tokens", "norm", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias")


@pytest.fixture(scope="module")
def fp8(tiny_checkpoint, tmp_path_factory):
    report = quantize_export(tiny_checkpoint.export, tmp_path_factory.mktemp("fp8") / "export", progress=False)
    return report


def test_targets_become_e4m3_with_channel_scales_and_the_rest_is_bit_identical(tiny_checkpoint, fp8):
    src, out = _tensors(tiny_checkpoint.export), _tensors(fp8.out_dir)
    targets = {n for n in src if target_of(n, QUANTIZABLE)}
    assert len(targets) == 25  # 3 GDN layers x (3 GDN + 3 MLP) + 1 attention layer x (4 + 3)
    assert sorted(fp8.quantized) == sorted(targets) and fp8.copied == len(src) - len(targets)
    assert set(out) == set(src) | {n + "_scale" for n in targets}
    for name in targets:
        n, k = src[name].shape
        assert out[name].dtype == E4M3 and out[name].shape == (n, k)
        scale = out[name + "_scale"]
        assert scale.dtype == torch.float32 and scale.shape == (n, 1)
        assert torch.isfinite(scale).all() and (scale > 0).all()
    for name in set(src) - targets:
        assert out[name].dtype == src[name].dtype and torch.equal(_bits(out[name]), _bits(src[name])), name
    kept = [n for n in src if any(part in n for part in NEVER)]
    assert kept and not any(n in targets for n in kept)
    assert any("in_proj_a" in n for n in kept) and any("A_log" in n for n in kept)


def test_weights_are_the_ops_quantization_within_e4m3_error(tiny_checkpoint, fp8):
    src, out = _tensors(tiny_checkpoint.export), _tensors(fp8.out_dir)
    worst = 0.0
    for name in fp8.quantized:
        w = src[name]
        w_fp8, scale = quantize_weight_per_channel(w)
        assert torch.equal(_bits(out[name]), _bits(w_fp8)) and torch.equal(out[name + "_scale"], scale)
        back = dequantize_weight(out[name], out[name + "_scale"])
        bound = torch.maximum(w.float().abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)  # half an e4m3 unit
        assert ((back - w.float()).abs() <= bound).all(), name
        worst = max(worst, ((back - w.float()).norm() / w.float().norm()).item())
    assert 1e-3 < worst < 2**-4
    assert fp8.max_weight_error == pytest.approx(worst, rel=1e-4)


def test_gdn_projections_can_stay_in_bf16(tiny_checkpoint, tmp_path):
    report = quantize_export(tiny_checkpoint.export, tmp_path / "fp8", targets=GDN_IN_BF16, progress=False)
    src, out = _tensors(tiny_checkpoint.export), _tensors(tmp_path / "fp8")
    assert report.modules == tuple(s for s in QUANTIZABLE if not s.startswith("linear_attn"))
    for name in src:
        if ".linear_attn." in name:
            assert torch.equal(_bits(out[name]), _bits(src[name])) and name + "_scale" not in out
    assert {n for n in report.quantized} == {n for n in src if ".mlp." in n or ".self_attn." in n and "norm" not in n}
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert not any("linear_attn" in t for t in config["config_groups"]["group_0"]["targets"])
    assert r"re:.*\.linear_attn\.in_proj_qkv$" in config["ignore"]
    only = quantize_export(tiny_checkpoint.export, tmp_path / "down", targets=["mlp.down_proj"], progress=False)
    assert only.modules == ("mlp.down_proj",) and all(n.endswith("mlp.down_proj.weight") for n in only.quantized)
    assert read_fp8_quantization(tmp_path / "down").modules == ("mlp.down_proj",)


def test_manifest_config_and_other_files(tiny_checkpoint, fp8):
    src_dir, out_dir = tiny_checkpoint.export, fp8.out_dir
    src_manifest = json.loads((src_dir / "open_jev_export.json").read_text())
    manifest = json.loads((out_dir / "open_jev_export.json").read_text())
    assert manifest["format"] == FP8_EXPORT_FORMAT and list(manifest)[0] == "format"
    assert {k: v for k, v in manifest.items() if k not in ("format", "quantization")} == \
        {k: v for k, v in src_manifest.items() if k != "format"}
    assert manifest["quantization"] == {"scheme": "fp8-dynamic", "layout": "compressed-tensors/float-quantized",
                                        "modules": list(QUANTIZABLE), "quantized_weights": 25,
                                        "source_format": "open-jev-text-merged/1"}
    read = read_manifest(out_dir)  # read_manifest knows both formats (an older one refused FP8: "unknown format")
    assert read.format == FP8_EXPORT_FORMAT and read.quantization == manifest["quantization"]
    assert read.to_json() == manifest
    config, src_config = (json.loads((d / "config.json").read_text()) for d in (out_dir, src_dir))
    assert {k: v for k, v in config.items() if k != "quantization_config"} == src_config
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    for path in src_dir.iterdir():
        if path.name not in ("config.json", "open_jev_export.json") and not path.name.endswith(".safetensors"):
            assert (out_dir / path.name).read_bytes() == path.read_bytes(), path.name
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(p.name for p in src_dir.iterdir())
    assert read_fp8_quantization(out_dir).quantized_weights == 25
    assert any("25 weights in e4m3" in line for line in fp8.lines())


def test_streaming_over_shards_in_small_pieces(tiny_checkpoint, fp8, tmp_path, monkeypatch):
    """A sharded source, quantized with 512-byte pieces: the same shards, an index naming every tensor (each
    scale in its weight's shard), the same tensors as the one-shard export, and no read larger than a piece."""
    sharded = tmp_path / "sharded"
    merge_lora(tiny_checkpoint.base, tiny_checkpoint.package, sharded, max_shard_bytes=120_000, verify=False,
               progress=False)
    shards = [p.name for p in base_weight_files(sharded)]
    assert len(shards) >= 3
    monkeypatch.setattr(fp8_export, "_CHUNK_BYTES", 512)
    reads = []
    read = fp8_export.TensorFileReader.read
    monkeypatch.setattr(fp8_export.TensorFileReader, "read", lambda self, *a: reads.append(read(self, *a)) or reads[-1])
    report = quantize_export(sharded, tmp_path / "fp8", progress=False)
    assert max(r.numel() for r in reads) <= 512 and len(reads) > 200
    assert [name for name, _ in report.shards] == shards
    assert sorted(p.name for p in (tmp_path / "fp8").glob("*.safetensors")) == sorted(shards)
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    out = _tensors(tmp_path / "fp8")
    assert set(index) == set(out)
    for name in report.quantized:
        assert index[name + "_scale"] == index[name]
    one_shard = _tensors(fp8.out_dir)
    assert set(out) == set(one_shard)
    for name in out:
        assert torch.equal(_bits(out[name]), _bits(one_shard[name])), name
    loaded = load_file(str(tmp_path / "fp8" / shards[0]))  # safetensors itself reads each shard (offsets valid)
    assert loaded


def _copy_export(tiny_checkpoint, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_checkpoint.export, src)
    return src


def _edit_weights(src, edit):
    path = src / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("case, message", [
    ("missing", "is not a directory"),
    ("no manifest", "open_jev_export.json is missing"),
    ("fp8 export", "already an FP8 export"),
    ("quantization_config", "already has a quantization_config"),
    ("scale tensor", "already quantized"),
    ("nan weight", "NaN or infinite"),
    ("out exists", "already exists"),
    ("out inside source", "overlap"),
    ("unknown target", "unknown FP8 target"),
    ("small projection", "stay in bf16"),
    ("no target", "no FP8 targets"),
])
def test_refusals_leave_nothing_behind(tiny_checkpoint, fp8, tmp_path, case, message):
    src, out, kwargs = tiny_checkpoint.export, tmp_path / "out" / "fp8", {}
    if case == "missing":
        src = tmp_path / "nowhere"
    elif case == "no manifest":
        src = _copy_export(tiny_checkpoint, tmp_path)
        (src / "open_jev_export.json").unlink()
    elif case == "fp8 export":
        src = fp8.out_dir
    elif case == "quantization_config":
        src = _copy_export(tiny_checkpoint, tmp_path)
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(dict(config, quantization_config={"quant_method": "fp8"})))
    elif case == "scale tensor":
        src = _copy_export(tiny_checkpoint, tmp_path)
        _edit_weights(src, lambda t: t.update({"layers.0.mlp.up_proj.weight_scale": torch.ones(128, 1)}))
    elif case == "nan weight":
        src = _copy_export(tiny_checkpoint, tmp_path)
        _edit_weights(src, lambda t: t["layers.3.self_attn.o_proj.weight"].__setitem__((5, 7), float("nan")))
    elif case == "out exists":
        out.mkdir(parents=True)
    elif case == "out inside source":
        src = _copy_export(tiny_checkpoint, tmp_path)
        out = src / "fp8"
    else:
        kwargs["targets"] = {"unknown target": ["mlp", "lm_head"], "small projection": ["linear_attn.in_proj_a"],
                             "no target": []}[case]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match=message):
        quantize_export(src, out, progress=False, **kwargs)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no temporary directory, no parents, no output


def test_a_failure_while_writing_keeps_the_old_target(tiny_checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "fp8"
    quantize_export(tiny_checkpoint.export, out, targets=["mlp"], progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []

    def failing_copy(*args):
        calls.append(1)
        if len(calls) == 7:
            raise OSError("disk went away")

    monkeypatch.setattr(fp8_export, "_copy_tensor", failing_copy)
    with pytest.raises(OSError, match="disk went away"):
        quantize_export(tiny_checkpoint.export, out, overwrite=True, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8"]
    monkeypatch.undo()
    report = quantize_export(tiny_checkpoint.export, out, overwrite=True, progress=False)  # now replaced
    assert report.modules == QUANTIZABLE and read_fp8_quantization(out).modules == QUANTIZABLE

"""FP8 at run time (issue 22, phase 2; CPU): the fast path's ``fp8`` option and ``quantize_model_fp8`` swap exactly the
targeted projections for ``Fp8Linear`` (never the head, embeddings, norms, conv, in_proj_a/b), in place and for
good; FP8 stacked projections equal unstacked ones; zero rows give zeros; an FP8 export loads through
``load_export`` (reference path: dequantized) and through the fast path (the export's own e4m3 bits); the
benchmark's --fp8 mode; ``hf-openjev export --fp8`` and ``hf-openjev quantize``.

The fast path's FP8 forward is compared with the stock (reference) forward whose projections do the same
quantize-dequantize written out here in plain torch. They differ only by the fast path's own order of fp32
arithmetic (1e-7 relative), but per-token quantization is discontinuous: now and then an activation lands on the
other side of an e4m3 rounding boundary (a 1/16 step), and that candidate's score moves by up to a few 1e-2 on
this tiny random model. So: most candidates agree to fp32 noise (``FP32_NOISE``), every one within
``QDQ_SCORE_TOLERANCE``, and both are far below the effect of FP8 itself (measured in the same test).
"""

from __future__ import annotations

import gc
import json
import math
import weakref

import pytest
import torch
from conftest import random_token_requests as _requests
from export_tensors import bits as _bits
from export_tensors import stored_tensors as _tensors
from repo_data import load_recipe
from torch import nn

import hf_openjev
from hf_openjev.checkpoint.fp8_scheme import FP8_EXPORT_FORMAT, GDN_IN_BF16, QUANTIZABLE, resolve_fp8_targets, target_of
from hf_openjev.errors import CheckpointError
from hf_openjev.fast_options import FastPathOptions
from hf_openjev.fast_path import score_fast
from hf_openjev.fp8 import swap as fp8_swap
from hf_openjev.fp8.linear import Fp8Linear, quantize_linear
from hf_openjev.fp8.quantize import quantize_export
from hf_openjev.fp8.state import load_fp8_state_dict
from hf_openjev.fp8.swap import fp8_modules, quantize_model_fp8
from hf_openjev.ops.fp8_linear import FP8_DTYPE, quantize_weight_per_channel
from hf_openjev.patches import apply_patches, patch_record, read_options, revert_patches
from hf_openjev.patches.stacked_projections import GROUPS, STACKED_ATTRIBUTE, projections, stack_projections
from hf_openjev.reference import score_reference

torch.set_num_threads(1)
QDQ_SCORE_TOLERANCE = 0.05  # |Δscore|, fast FP8 vs plain quantize-dequantize, when an e4m3 rounding flips
FP32_NOISE = 1e-5  # |Δscore| of the same forward in another fp32 order (no flip)
NEVER = ("embed_tokens", "norm", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias")
GDN_MODULES = tuple(s for s in QUANTIZABLE if s.startswith("linear_attn."))


def _load(path, dtype="float32"):
    return hf_openjev.load_export(path, dtype=dtype, device="cpu")




def _fp8_names(model) -> set[str]:
    return {name for name, m in model.backbone.named_modules() if isinstance(m, Fp8Linear)}


@pytest.fixture(scope="module")
def fp8_export(tiny_checkpoint, tmp_path_factory):
    return quantize_export(tiny_checkpoint.export, tmp_path_factory.mktemp("fp8") / "all", progress=False).out_dir


# --- which modules, in place ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["all", "no-gdn"])
def test_exactly_the_targeted_projections_are_swapped(tiny_checkpoint, mode):
    model = _load(tiny_checkpoint.export, "bfloat16")
    kept = {name: p for name, p in model.named_parameters() if any(part in name for part in NEVER)}
    kept_values = {name: p.detach().clone() for name, p in kept.items()}
    head = model.head.weight.detach().clone()
    count = quantize_model_fp8(model, mode)
    targets = resolve_fp8_targets(mode)
    expected = {name for name, m in model.backbone.named_modules() if target_of(f"{name}.weight", targets)}
    assert _fp8_names(model) == expected and count == len(expected) == {"all": 25, "no-gdn": 16}[mode]
    assert fp8_modules(model) == targets and read_options(model).fp8 == mode  # unpatched: the mode it has
    for name, m in model.backbone.named_modules():
        if name.endswith(("in_proj_a", "in_proj_b")) or (mode == "no-gdn" and target_of(f"{name}.weight",
                                                                                          GDN_MODULES)):
            assert type(m) is nn.Linear, name
    assert kept and all(p is dict(model.named_parameters())[n] for n, p in kept.items())  # the same Parameters
    assert all(torch.equal(kept[n], kept_values[n]) for n in kept) and torch.equal(model.head.weight, head)
    assert model.head.weight.dtype == torch.float32 and model.backbone.embed_tokens.weight.dtype == torch.bfloat16
    assert quantize_model_fp8(model, mode) == 0  # idempotent


def test_quantizing_in_memory_gives_the_exports_bits(tiny_checkpoint, fp8_export):
    model = _load(tiny_checkpoint.export, "bfloat16")
    quantize_model_fp8(model, "all")
    stored = _tensors(fp8_export)
    for name, m in model.backbone.named_modules():
        if isinstance(m, Fp8Linear):
            assert m.weight.dtype == FP8_DTYPE and m.weight_scale.shape == (m.out_features, 1)
            assert torch.equal(_bits(m.weight), _bits(stored[f"{name}.weight"])), name
            assert torch.equal(m.weight_scale, stored[f"{name}.weight_scale"]), name


def test_quantize_linear_in_blocks_of_rows_is_the_whole_weights_quantization(monkeypatch):
    import hf_openjev.fp8.linear as module

    linear = nn.Linear(48, 37, bias=True)
    monkeypatch.setattr(module, "_CHUNK_BYTES", 4 * 48 * 5)  # blocks of 5 rows
    fp8 = quantize_linear(linear)
    w_fp8, scale = quantize_weight_per_channel(linear.weight.detach())
    assert torch.equal(_bits(fp8.weight), _bits(w_fp8)) and torch.equal(fp8.weight_scale, scale)
    assert torch.equal(fp8.bias, linear.bias.detach())
    x = torch.randn(4, 48)
    assert torch.equal(fp8(x), torch.ops.hf_openjev.fp8_linear(x, w_fp8, scale, linear.bias.detach()))


@pytest.mark.slow
def test_the_bf16_weights_are_released_module_by_module(tiny_checkpoint, monkeypatch):
    """Stacked first (one bf16 copy per module, views), then quantized: at every step the already replaced
    projections of other modules are gone, and at the end no old Linear or stack is alive."""
    model = _load(tiny_checkpoint.export, "bfloat16")
    apply_patches(model, FastPathOptions())  # bf16, stacked
    stacks = [weakref.ref(getattr(m, STACKED_ATTRIBUTE)) for m in model.modules()
              if getattr(m, STACKED_ATTRIBUTE, None) is not None]
    seen: list[weakref.ref] = []
    alive_at_calls = []
    real = fp8_swap.quantize_linear

    def tracking(linear):
        gc.collect()
        alive_at_calls.append(sum(ref() is not None for ref in seen))
        seen.append(weakref.ref(linear))
        return real(linear)

    monkeypatch.setattr(fp8_swap, "quantize_linear", tracking)
    revert_patches(model)
    quantize_model_fp8(model, "all")
    gc.collect()
    assert len(seen) == 25 and max(alive_at_calls) <= 3  # at most the earlier projections of the same module
    assert all(ref() is None for ref in seen) and stacks and all(ref() is None for ref in stacks)


def test_the_fp8_swap_names_the_patches_attributes_it_reads():
    """fp8 never imports the patches (tests/test_layout.py): the swap reads a patched model's record and stacks by
    their attribute names, which must stay the patches' own."""
    from hf_openjev.fp8 import swap
    from hf_openjev.patches.record import RECORD_ATTRIBUTE

    assert (swap._STACKED_ATTRIBUTE, swap._RECORD_ATTRIBUTE) == (STACKED_ATTRIBUTE, RECORD_ATTRIBUTE)


def test_a_dtype_cast_moves_fp8_modules_without_casting_them(tiny_checkpoint):
    model = _load(tiny_checkpoint.export, "bfloat16")
    apply_patches(model, FastPathOptions(fp8="all"))
    model.to(torch.float32)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            assert m.weight.dtype == FP8_DTYPE and m.weight_scale.dtype == torch.float32
    assert model.dtype == torch.float32
    scores, _ = score_fast(model, _requests(model, 1))  # the stacks are rebuilt for the new dtype
    assert all(math.isfinite(s) for s in scores)


# --- one way ----------------------------------------------------------------------------------------------------

def test_fp8_cannot_be_turned_off_or_narrowed(tiny_checkpoint):
    model = _load(tiny_checkpoint.export)
    apply_patches(model, FastPathOptions(fp8="all"))
    before = _fp8_names(model)
    for mode in ("off", "no-gdn"):
        with pytest.raises(ValueError, match="already FP8 .* cannot be turned off or narrowed"):
            apply_patches(model, FastPathOptions(fp8=mode))
    assert read_options(model).fp8 == "all" and _fp8_names(model) == before
    with pytest.raises(ValueError, match="FP8 is chosen when the model is set up"):
        score_fast(model, _requests(model, 1), FastPathOptions())
    revert_patches(model)  # the classes go back; the FP8 modules stay (their bf16 weights are gone)
    assert _fp8_names(model) == before
    with pytest.raises(ValueError, match="already FP8"):
        apply_patches(model, FastPathOptions())


def test_a_pipeline_sets_fp8_at_construction_only(tiny_checkpoint):
    from transformers import pipeline

    hf_openjev.register_pipeline()
    model = _load(tiny_checkpoint.export)
    jev = pipeline("jev-decision", model=model, fast=True, fp8="no-gdn")
    assert fp8_modules(model) == resolve_fp8_targets("no-gdn")
    request = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}
    assert 0 < jev(request)["answers"]["q"]["noul"] < 1
    with pytest.raises(ValueError, match="fp8 is chosen when the pipeline is constructed"):
        jev(request, fp8="off")
    assert 0 < jev(request, share_tails=True)["answers"]["q"]["noul"] < 1  # other options still per call


# --- numbers ------------------------------------------------------------------------------------------------------

class PlainQdqLinear(nn.Module):
    """The scheme written out in plain torch: per-token activation scales, per-channel weight scales, fp32."""

    def __init__(self, fp8: Fp8Linear):
        super().__init__()
        self.w = fp8.weight.float() * fp8.weight_scale  # [N, K] fp32, dequantized

    def forward(self, x):  # x [..., K] -> [..., N]
        h = x.float()
        scale = h.abs().amax(dim=-1, keepdim=True).clamp(min=448 * torch.finfo(torch.float32).tiny) / 448.0
        q = (h / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        return (q @ self.w.t()).to(x.dtype)


def _plain_qdq_model(path):
    model = _load(path)
    quantize_model_fp8(model, "all")
    for name, m in list(model.backbone.named_modules()):
        if isinstance(m, Fp8Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.backbone.get_submodule(parent), child, PlainQdqLinear(m))
    return model


def test_the_fp8_fast_path_is_the_plain_quantize_dequantize_forward(tiny_checkpoint):
    requests = _requests(_load(tiny_checkpoint.export))
    sequences = [c for r in requests for q in r for c in q]
    fast = _load(tiny_checkpoint.export)
    apply_patches(fast, FastPathOptions(fp8="all"))
    got, _ = score_fast(fast, requests)
    want = score_reference(_plain_qdq_model(tiny_checkpoint.export), sequences)
    bf16 = score_reference(_load(tiny_checkpoint.export), sequences)  # no FP8 at all (fp32 on the bf16 weights)
    gaps = sorted(abs(a - b) for a, b in zip(got, want))
    fp8_effect = max(abs(a - b) for a, b in zip(want, bf16))
    print(f"fast FP8 vs plain quantize-dequantize, |Δscore| per candidate: {[f'{g:.1e}' for g in gaps]}; "
          f"FP8 vs none: max {fp8_effect:.3e}")
    assert len(gaps) == 9 and gaps[len(gaps) // 2] <= FP32_NOISE and gaps[-1] <= QDQ_SCORE_TOLERANCE
    assert fp8_effect > 5 * gaps[-1]
    unstacked = _load(tiny_checkpoint.export)
    apply_patches(unstacked, FastPathOptions(fp8="all", stacked_projections=False))
    other, _ = score_fast(unstacked, requests)
    stacking = sorted(abs(a - b) for a, b in zip(got, other))  # stacking changes nothing but GEMM order
    assert stacking[len(stacking) // 2] <= FP32_NOISE and stacking[-1] <= QDQ_SCORE_TOLERANCE


def _exact_fp8_linear(n: int, k: int, g: torch.Generator) -> nn.Linear:
    """A Linear whose per-channel quantization is exact: small integers times 2^e, each row holding 448 * 2^e."""
    w = torch.randint(-16, 17, (n, k), generator=g).float()
    w[:, 0] = 448.0
    return _linear(w * 2.0 ** torch.randint(-8, 4, (n, 1), generator=g).float())


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    return linear


def _group_module(kind: str, linears: dict[str, nn.Module]) -> nn.Module:
    """A bare module of one stacked kind (its class name is what stacking looks up)."""
    module = type(kind, (nn.Module,), {})()
    for name, layer in linears.items():
        setattr(module, name, layer)
    return module


@pytest.mark.parametrize("kind, fp8_names", [("Qwen3_5GatedDeltaNet", ("in_proj_qkv", "in_proj_z")),
                                             ("Qwen3_5Attention", ("q_proj", "k_proj", "v_proj")),
                                             ("Qwen3_5Attention", ("k_proj",)),
                                             ("Qwen3_5MLP", ("gate_proj", "up_proj"))])
def test_stacked_fp8_projections_equal_unstacked_ones_bit_for_bit(kind, fp8_names):
    """Inputs and weights whose every product and sum is exact in fp32 (small integers times powers of two): any
    GEMM order gives the same bits, so what is compared is the stacking (rows, scales, order of the outputs)."""
    g = torch.Generator().manual_seed(len(fp8_names))
    k, sizes = 64, {"in_proj_qkv": 96, "in_proj_z": 48, "in_proj_b": 8, "in_proj_a": 8, "q_proj": 64,
                    "k_proj": 32, "v_proj": 32, "gate_proj": 80, "up_proj": 80}
    layers = {name: _exact_fp8_linear(sizes[name], k, g) for name in GROUPS[kind]}
    layers = {name: quantize_linear(layer) if name in fp8_names else layer for name, layer in layers.items()}
    module = _group_module(kind, layers)
    x = torch.randint(-16, 17, (7, k), generator=g).float()
    x[:, 1] = 448.0  # every row's scale is a power of two
    x *= 2.0 ** torch.randint(-4, 4, (7, 1), generator=g).float()
    x[3] = 0.0  # a padded row
    expected = [getattr(module, name)(x) for name in GROUPS[kind]]
    assert stack_projections(module) == 1
    stacked = getattr(module, STACKED_ATTRIBUTE)
    assert len(stacked.parts) == (1 if len(fp8_names) == len(GROUPS[kind]) else 2)
    got = projections(module, x)
    for name, a, b in zip(GROUPS[kind], got, expected):
        assert torch.equal(a, b), name
        assert not a[3].any(), name  # zero rows give zeros
    for part in stacked.parts:  # the members are views of the part's one weight (no second copy)
        for name in part.names:
            weight = getattr(module, name).weight
            assert weight.untyped_storage().data_ptr() == part.weight.untyped_storage().data_ptr()


def test_an_fp8_row_of_zeros_gives_zeros_and_bias_rows():
    layer = quantize_linear(nn.Linear(32, 16, bias=True))
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    x[2] = 0
    y = layer(x)
    assert torch.isfinite(y).all() and torch.equal(y[2], layer.bias.to(y.dtype))


# --- FP8 exports ----------------------------------------------------------------------------------------------------

def test_load_export_reads_an_fp8_export_dequantized(tiny_checkpoint, fp8_export):
    model = _load(fp8_export)
    assert model.manifest.format == FP8_EXPORT_FORMAT and model.quantization["modules"] == list(QUANTIZABLE)
    assert _load(tiny_checkpoint.export).quantization is None
    state = load_fp8_state_dict(fp8_export, dtype=torch.float32)
    assert model.backbone.state_dict().keys() == state.keys() and not _fp8_names(model)
    assert all(torch.equal(model.backbone.state_dict()[k], v) for k, v in state.items())
    assert getattr(model.config, "quantization_config", None) is None  # never handed to compressed-tensors
    from hf_openjev.eval.evaluate import model_fingerprint

    assert model_fingerprint(model.manifest) != model_fingerprint(_load(tiny_checkpoint.export).manifest)


def test_the_fast_path_serves_the_exports_own_fp8_bits(tiny_checkpoint, fp8_export):
    model = _load(fp8_export)
    requests = _requests(model)
    sequences = [c for r in requests for q in r for c in q]
    reference = score_reference(model, sequences)  # dequantized weights, bf16-free fp32 arithmetic
    apply_patches(model, FastPathOptions(fp8="all"))
    stored = _tensors(fp8_export)
    for name, m in model.backbone.named_modules():
        if isinstance(m, Fp8Linear):
            assert torch.equal(_bits(m.weight), _bits(stored[f"{name}.weight"])), name
            assert torch.equal(m.weight_scale, stored[f"{name}.weight_scale"]), name
    fast, _ = score_fast(model, requests)
    in_memory = _load(tiny_checkpoint.export)  # the bf16 export, quantized at load time: the same bits
    apply_patches(in_memory, FastPathOptions(fp8="all"))
    assert score_fast(in_memory, requests)[0] == fast
    gap = max(abs(a - b) for a, b in zip(fast, reference))  # the activations' quantization (scores of size ~3)
    assert 0 < gap < 0.5


def test_fp8_modes_and_exports_of_other_targets_combine(tiny_checkpoint, fp8_export, tmp_path):
    narrow = quantize_export(tiny_checkpoint.export, tmp_path / "no-gdn", targets=GDN_IN_BF16, progress=False)
    model = _load(narrow.out_dir, "bfloat16")
    apply_patches(model, FastPathOptions(fp8="all"))  # the GDN's projections: quantized from the bf16 weights
    stored = _tensors(fp8_export)
    for name, m in model.backbone.named_modules():
        if isinstance(m, Fp8Linear):
            assert torch.equal(_bits(m.weight), _bits(stored[f"{name}.weight"])), name
    wide = _load(fp8_export, "bfloat16")
    apply_patches(wide, FastPathOptions(fp8="no-gdn"))  # the GDN's stay dequantized, as bf16 Linear modules
    assert fp8_modules(wide) == resolve_fp8_targets("no-gdn")
    assert all(type(m) is nn.Linear for n, m in wide.backbone.named_modules() if n.endswith("in_proj_qkv"))


def test_an_fp8_model_whose_weights_changed_is_refused(fp8_export):
    cast = _load(fp8_export, "bfloat16").to(torch.float32)  # a cast is no change: the export's bits are used
    quantize_model_fp8(cast, "all")
    stored = _tensors(fp8_export)
    assert torch.equal(_bits(cast.backbone.layers[0].mlp.up_proj.weight), _bits(stored["layers.0.mlp.up_proj.weight"]))
    model = _load(fp8_export)
    with torch.no_grad():
        model.backbone.layers[0].mlp.up_proj.weight.mul_(1.5)
    with pytest.raises(RuntimeError, match="layers.0.mlp.up_proj: the model's weight is not the dequantized"):
        quantize_model_fp8(model, "all")


def test_a_bf16_export_with_a_quantization_config_is_refused(tiny_checkpoint, fp8_export, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint.export, broken)
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"] = json.loads((fp8_export / "config.json").read_text())["quantization_config"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="has a quantization_config but the manifest's format is a bf16"):
        _load(broken)
    edited = tmp_path / "edited"
    shutil.copytree(fp8_export, edited)
    manifest = json.loads((edited / "open_jev_export.json").read_text())
    manifest["quantization"]["modules"] = ["mlp.down_proj"]
    (edited / "open_jev_export.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not match the manifest"):
        _load(edited)


# --- command line ---------------------------------------------------------------------------------------------------

def _cli(argv) -> int:
    from hf_openjev import cli

    return cli.main(argv)


def test_export_fp8_writes_the_fp8_export_and_nothing_else(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "new" / "fp8"
    rc = _cli(["export", "--base", str(tiny_checkpoint.base), "--package", str(tiny_checkpoint.package), "--out",
               str(out), "--fp8", "no-gdn", "--no-progress", "--probe", "off"])
    assert rc == 0
    printed = capsys.readouterr().out
    for said in ("bitwise identical", "the merge above was temporary", "16 weights in e4m3"):
        assert said in printed
    assert sorted(p.name for p in out.parent.iterdir()) == ["fp8"]  # the temporary bf16 merge is gone
    manifest = json.loads((out / "open_jev_export.json").read_text())
    assert manifest["format"] == FP8_EXPORT_FORMAT and manifest["quantization"]["modules"] == list(
        resolve_fp8_targets("no-gdn"))
    want = quantize_export(tiny_checkpoint.export, tmp_path / "direct", targets=GDN_IN_BF16, progress=False)
    got, direct = _tensors(out), _tensors(want.out_dir)
    assert got.keys() == direct.keys() and all(torch.equal(_bits(got[k]), _bits(direct[k])) for k in got)
    assert _cli(["export", "--base", str(tiny_checkpoint.base), "--package", str(tiny_checkpoint.package), "--out",
                 str(out), "--fp8"]) == 2  # exists: refused before merging
    assert "already exists" in capsys.readouterr().err


def test_export_fp8_leaves_nothing_behind_on_failure(tiny_checkpoint, tmp_path, monkeypatch):
    import hf_openjev.export.merge_fp8 as fp8_export_module

    def failing(*args, **kwargs):
        raise CheckpointError("quantizing failed")

    monkeypatch.setattr(fp8_export_module, "quantize_export", failing)
    out = tmp_path / "a" / "b" / "fp8"
    assert _cli(["export", "--base", str(tiny_checkpoint.base), "--package", str(tiny_checkpoint.package), "--out",
                 str(out), "--fp8", "--no-verify", "--no-progress"]) == 2
    assert list(tmp_path.iterdir()) == []  # not even the parents it made


def test_the_quantize_command_quantizes_an_existing_export(tiny_checkpoint, fp8_export, tmp_path, capsys):
    out = tmp_path / "q"
    assert _cli(["quantize", "--model", str(tiny_checkpoint.export), "--out", str(out), "--no-progress"]) == 0
    assert "25 weights in e4m3" in capsys.readouterr().out
    got, want = _tensors(out), _tensors(fp8_export)
    assert got.keys() == want.keys() and all(torch.equal(_bits(got[k]), _bits(want[k])) for k in got)
    assert _cli(["quantize", "--model", str(out), "--out", str(tmp_path / "again")]) == 2
    assert "already an FP8 export" in capsys.readouterr().err


# --- the benchmark ----------------------------------------------------------------------------------------------------

def test_the_bench_runs_the_fast_path_in_fp8_after_the_bf16_reference_arms(tmp_path, capsys):
    bench = load_recipe("bench_jevbench")
    rc = bench.main(["--shape", "tiny", "--limit", "4", "--arms", "C,E,B", "--passes", "1", "--b-passes", "1",
                     "--fp8", "no-gdn", "--memory-cap-gb", "40", "--long-candidate", "30", "--single", "9",
                     "--concurrency", "2", "--sweep", '[{"share_tails": true}]', "--out", str(tmp_path)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert printed.index("arm B") < printed.index("fp8 no-gdn: 16 projections swapped") < printed.index("arm C")
    assert not (tmp_path / "bench_tiny_bfloat16.json").exists()
    results = json.loads((tmp_path / "bench_tiny_fp8-no-gdn.json").read_text())
    info = results["fp8"]
    assert info["mode"] == "no-gdn" and info["modules"] == list(resolve_fp8_targets("no-gdn"))
    assert info["swapped"] == 16 and info["weights_gb"] < info["weights_gb_bf16"]
    assert info["memory_cap_gb"] is None and "not applied" in info["memory_cap_note"]  # no CUDA here
    assert results["effective_patch_options"]["C"]["fp8"] == "no-gdn"
    assert list(results["arms"]) == ["B", "C", "E"]  # the reference arm first, on the bf16 weights
    assert 0 < results["parity_C_vs_B"]["max_abs_dp"] < 0.1 and results["parity_C_vs_E"]["max_abs_dp"] == 0.0
    assert results["sweep"]['{"share_tails": true}']["parity_vs_B"]["n"] == 4
    assert "FP8 no-gdn" in (tmp_path / "bench_tiny_fp8-no-gdn.md").read_text()


@pytest.mark.parametrize("extra, message", [(["--sweep", '[{"fp8": "all"}]'], "fp8 cannot be swept"),
                                            (["--memory-cap-gb", "40"], "--memory-cap-gb needs --fp8"),
                                            (["--fp8", "on"], "invalid choice")])
def test_the_bench_refuses_fp8_misuse_before_any_work(tmp_path, capsys, extra, message):
    bench = load_recipe("bench_jevbench")
    with pytest.raises(SystemExit):
        bench.main(["--shape", "tiny", "--arms", "C", *extra, "--out", str(tmp_path / "o")])
    assert message in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_the_bench_hashes_the_bf16_weights_and_names_fp8_configurations(tmp_path):
    from test_oracle_recipe import run_oracle

    assert run_oracle(["--shape", "tiny", "--limit", "2", "--out", str(tmp_path / "oracle")]) == 0
    bench = load_recipe("bench_jevbench")
    rc = bench.main(["--shape", "tiny", "--limit", "2", "--arms", "C,B", "--passes", "1", "--b-passes", "1",
                     "--concurrency", "", "--single", "", "--long-candidate", "0", "--fp8", "all",
                     "--sweep", '[{"min_shared_tokens": 16}]',
                     "--oracle", str(tmp_path / "oracle" / "oracle_tiny.json"),
                     "--out", str(tmp_path / "run")])
    assert rc == 0
    report = json.loads((tmp_path / "run" / "fidelity_tiny.json").read_text())
    assert report["oracle_sha256_check"]["match"] and report["fp8"] == "all"
    assert list(report["configurations"]) == ["B", "fp8-all", 'fp8-all {"min_shared_tokens": 16}']
    assert all(c["max_abs_dp"] < 0.1 for c in report["configurations"].values())


# --- on the H200 (pytest -m gpu) --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_graph_replays_equal_eager_fp8_on_cuda(tiny_checkpoint):
    """The kernel path (Triton quantizer + row-wise _scaled_mm; every tiny projection has K and N multiples of 16)
    in padded CUDA graphs: replays equal captures bit for bit and stay close to eager FP8 (padded GEMM shapes
    round differently; per-token scales keep the padded zero rows from touching the real ones)."""
    model = hf_openjev.load_export(tiny_checkpoint.export, dtype="bfloat16", device="cuda")
    apply_patches(model, FastPathOptions(fp8="all"))
    assert all(m.weight.is_cuda for m in model.modules() if isinstance(m, Fp8Linear))
    requests = _requests(model)
    eager, _ = score_fast(model, requests, FastPathOptions(fp8="all", cuda_graphs=False))
    first, _ = score_fast(model, requests)  # captures
    again, _ = score_fast(model, requests)  # replays
    assert first == again and patch_record(model).graphs.replays > 0
    assert max(abs(a - b) for a, b in zip(first, eager)) <= 0.05 * max(abs(x) for x in eager)
    plain = score_reference(model, [c for r in requests for q in r for c in q])  # stock forward, same FP8 modules
    assert max(abs(a - b) for a, b in zip(eager, plain)) < 0.5

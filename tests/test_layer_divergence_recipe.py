"""recipes/layer_divergence.py on the tiny shape: in bf16 the Gated DeltaNet layers before the first attention
layer round exactly like stock Transformers (same values bit for bit); in fp32 every layer agrees closely; a request
of the gate's workload is scored as its ids, against fp32 too, and bad arguments are refused before any model."""

from __future__ import annotations

import json

import pytest
import torch
from repo_data import load_recipe


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fast_path_layers_against_stock(tmp_path, dtype):
    torch.set_num_threads(1)
    recipe = load_recipe("layer_divergence")
    assert recipe.main(["--shape", "tiny", "--dtype", dtype, "--tokens", "90", "--out", str(tmp_path)]) == 0
    layers = json.loads((tmp_path / f"divergence_tiny_{dtype}.json").read_text())["layers"]
    assert len(layers) == 4 and layers[0]["type"] == "linear_attention" and "full_attention" in [r["type"] for r in layers]
    if dtype == "bfloat16":
        before_attention = layers[: [r["type"] for r in layers].index("full_attention")]
        assert before_attention and all(r["mismatch_fraction"] == 0.0 for r in before_attention)
    else:
        assert all(r["max_rel"] < 1e-4 for r in layers)


def test_a_gate_request_against_fp32(tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("layer_divergence")
    assert recipe.main(["--shape", "tiny", "--seed", "1", "--request", "easy-extraction-08", "--candidate", "2",
                        "--fp32", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "divergence_tiny_bfloat16_easy-extraction-08.json").read_text())
    assert result["tokens"] == 29 + 32 and result["seed"] == 1 and result["candidate"] == 2
    layers = result["layers"]
    before_attention = layers[: [r["type"] for r in layers].index("full_attention")]
    assert all(r["mismatch_fraction"] == 0.0 for r in before_attention)  # the fast path ran in bf16 again
    for r in layers:  # bf16 against fp32: rounding-sized, over the whole output and on the scored last row
        assert 0 < r["stock_vs_fp32"] < 0.05 and 0 < r["fast_vs_fp32"] < 0.05
        assert 0 < r["stock_vs_fp32_last_row"] < 0.05
    assert "| fast vs fp32 |" in (tmp_path / "divergence_tiny_bfloat16_easy-extraction-08.md").read_text()


def test_the_fp32_run_puts_every_tensor_back_in_its_dtype():
    recipe = load_recipe("layer_divergence")
    from benchlib.random_model import build_model

    from hf_openjev.family import text_model_of

    text_model = text_model_of(build_model("tiny", seed=0, device="cpu", dtype=torch.bfloat16))
    before = {n: (t.dtype, t.clone()) for n, t in [*text_model.named_parameters(), *text_model.named_buffers()]}
    assert {dtype for dtype, _ in before.values()} == {torch.bfloat16, torch.float32}  # RoPE's buffers are fp32
    outputs = recipe.fp32_outputs(text_model, list(range(1000, 1040)), "cpu")
    assert all(o.dtype == torch.float32 for o in outputs) and len(outputs) == 4
    after = dict([*text_model.named_parameters(), *text_model.named_buffers()])
    assert all(after[n].dtype == dtype and torch.equal(after[n], value) for n, (dtype, value) in before.items())


def test_the_requests_ids_are_the_workloads():
    recipe = load_recipe("layer_divergence")
    from benchlib.workload import ESTIMATED_MANIFEST

    from hf_openjev.fidelity_check.workload import build_workload

    work = {item["id"]: prepared for item, prepared in build_workload(ESTIMATED_MANIFEST, vocab=recipe.VOCAB, seed=3)}
    assert recipe.request_sequence("easy-extraction-08", 4, 3) == work["easy-extraction-08"].tokens[0][4]


@pytest.mark.parametrize("argv, message", [
    (["--request", "no-such-request"], "--request no-such-request: no such request"),
    (["--request", "easy-extraction-08", "--candidate", "5"], "--candidate 5: easy-extraction-08 has 5 candidates"),
    (["--patch-options", "{not json"], "--patch-options: not JSON"),
    (["--patch-options", '{"no_such_option": 1}'], "--patch-options: .*no_such_option"),
])
def test_a_bad_request_is_refused_before_any_model(tmp_path, monkeypatch, argv, message):
    recipe = load_recipe("layer_divergence")
    monkeypatch.setattr(recipe, "prepare_recipe", lambda args: pytest.fail("a model was built"))
    with pytest.raises(SystemExit, match=message):
        recipe.main(["--shape", "tiny", *argv, "--out", str(tmp_path)])


def test_fp32_needs_the_bf16_paths(tmp_path, monkeypatch, capsys):
    recipe = load_recipe("layer_divergence")
    monkeypatch.setattr(recipe, "prepare_recipe", lambda args: pytest.fail("a model was built"))
    with pytest.raises(SystemExit):
        recipe.main(["--shape", "tiny", "--dtype", "float32", "--fp32", "--out", str(tmp_path)])
    assert "use it with --dtype bfloat16" in capsys.readouterr().err

"""recipes/op_launch_cost.py: the host's time per elementwise op call (a GPU recipe; its inputs checked here)."""

from __future__ import annotations

import pytest
import torch
from repo_data import load_recipe

from hf_openjev.ops import elementwise as ew


def test_every_elementwise_op_is_timed_at_each_layer_with_inputs_it_accepts():
    recipe = load_recipe("op_launch_cost")
    from benchlib.shapes import SHAPES

    inputs = recipe.op_inputs(SHAPES["tiny"], 5, torch.device("cpu"))
    registered = {name for name, value in vars(ew).items()
                  if isinstance(value, torch.library.CustomOpDef)}
    assert set(inputs) == registered
    for name, args in inputs.items():
        custom, impl = recipe.layers_of(name)
        assert custom is getattr(torch.ops.hf_openjev, name) and callable(impl)
        custom(*args)  # the CPU reference takes the recipe's inputs as the model's calls give them


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_without_cuda_it_says_so_and_writes_nothing(tmp_path, capsys):
    assert load_recipe("op_launch_cost").main(["--out", str(tmp_path / "x")]) == 2
    assert "needs CUDA" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_the_gdn_ops_take_the_recipes_inputs_and_the_profile_gives_per_call_rows(monkeypatch):
    """--gdn: the two fla-backed GDN ops accept the recipe's inputs as the patched layer gives them (their CPU
    references run here), and the profile's rows are per call of the profiled function."""
    recipe = load_recipe("op_launch_cost")
    from benchlib.shapes import SHAPES

    inputs = recipe.gdn_inputs(SHAPES["tiny"], [70], torch.device("cpu"))
    assert set(inputs) == {"gdn_prefill", "causal_conv1d_packed"}
    conv, conv_final = torch.ops.hf_openjev.causal_conv1d_packed(*inputs["causal_conv1d_packed"])
    assert conv.shape == inputs["causal_conv1d_packed"][0].shape and conv_final.shape[0] == 1
    out, final = torch.ops.hf_openjev.gdn_prefill(*inputs["gdn_prefill"])
    assert out.shape == inputs["gdn_prefill"][2].shape and final.shape[0] == 1
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []

    def inner():
        calls.append(1)

    def outer(x):
        inner()
        inner()
        return x

    lines = recipe.profile_calls(outer, (1,), calls=4)
    assert len(calls) == 8
    (row,) = [line for line in lines if "(inner)" in line]
    assert "  2.0 calls" in row


def test_the_markdown_gives_each_gdn_op_its_times_and_profile():
    """--gdn's rows: each op's per-call times and its cProfile lines under a heading of their own."""
    result = {"shape": "27b", "command": "c", "device": "d", "versions": {}, "ops": [],
              "baselines": {"torch.add": 6.3, "empty triton kernel": 11.1},
              "gdn_ops": [{"op": "gdn_prefill", "tokens": 128, "custom op": 990.0, "cuda impl": 950.0,
                           "profile": ["  950.0 us cum    12.0 us own   1.0 calls  ops/gdn_prefill.py:1(f)"]}]}
    text = load_recipe("op_launch_cost").render_markdown(result)
    assert "## gdn_prefill, one sequence of 128 tokens: custom op 990.0 us, cuda impl 950.0 us a call" in text
    assert "ops/gdn_prefill.py:1(f)" in text

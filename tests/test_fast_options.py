"""hf_openjev.fast_options: the one fast-path configuration: defaults, checks with messages that say what to do,
building from a mapping (unknown names refused), and no torch import."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from hf_openjev.fast_options import DENSE_ATTENTION_TOKENS, FORWARD_FIELDS, GRAPH_TOKENS, FastPathOptions
from hf_openjev.packing import planner

INTS = {"min_shared_tokens": 1, "max_sequences": 1, "max_tokens": 1, "dense_attention_tokens": 0,
        "graph_tokens": 1}  # name: minimum
BOOLS = ["packed_candidates", "shared_prefix", "final_row_mlp", "stacked_projections", "cuda_graphs",
         "compile_elementwise", "fused_elementwise", "gdn_fp32", "residual_fp32", "share_tails", "measured_buckets"]


def test_every_option_and_its_default():
    options = FastPathOptions()
    assert set(FastPathOptions.names()) == set(INTS) | set(BOOLS) | {"fp8", "packed_attention"}
    assert len(FastPathOptions.names()) == 18
    assert options.fp8 == "off" and options.packed_attention == "flash"  # FP8 and the other kernels are opt-in
    assert (options.min_shared_tokens, options.max_sequences, options.max_tokens, options.share_tails) == (
        planner.DEFAULT_MIN_SHARED_TOKENS, planner.DEFAULT_MAX_SEQUENCES, planner.DEFAULT_MAX_TOKENS,
        planner.DEFAULT_SHARE_TAILS)
    assert options.dense_attention_tokens == DENSE_ATTENTION_TOKENS == 2048
    assert options.graph_tokens == GRAPH_TOKENS == 4096  # packs up to 4,096 tokens replay graphs
    assert [name for name in BOOLS if getattr(options, name)] == [
        "packed_candidates", "shared_prefix", "final_row_mlp", "stacked_projections", "cuda_graphs",
        "fused_elementwise", "share_tails"]
    # exact prefix sharing from 16 tokens: the fastest configuration that passes the fidelity gate (issue 21)
    assert (options.share_tails, options.min_shared_tokens) == (True, 16)


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FastPathOptions().share_tails = True


@pytest.mark.parametrize("name", list(INTS))
@pytest.mark.parametrize("value", [True, 16.0, "16", None, -1])
def test_a_bad_integer_is_refused_with_what_to_give(name, value):
    kind = "a positive integer" if INTS[name] == 1 else r"a non-negative integer \(0: never\)"
    with pytest.raises(ValueError, match=rf"^{name} must be {kind}, got {value!r}$"):
        FastPathOptions(**{name: value})


def test_the_smallest_integers_are_accepted_and_one_below_is_not():
    assert FastPathOptions(dense_attention_tokens=0, min_shared_tokens=1, max_sequences=1, max_tokens=1,
                           graph_tokens=1)
    for name, minimum in INTS.items():
        with pytest.raises(ValueError, match=name):
            FastPathOptions(**{name: minimum - 1})


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_a_flag_must_be_a_bool(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be True or False, got {value!r}$"):
        FastPathOptions(**{name: value})


@pytest.mark.parametrize("value", ["on", "ALL", "no_gdn", True, None, ""])
def test_fp8_is_one_of_its_modes(value):
    assert [FastPathOptions(fp8=mode).fp8 for mode in ("off", "all", "no-gdn")] == ["off", "all", "no-gdn"]
    with pytest.raises(ValueError, match=rf"^fp8 must be one of 'off', 'all', 'no-gdn', got {value!r}$"):
        FastPathOptions(fp8=value)


def test_a_mapping_changes_its_base_and_unknown_names_are_refused():
    options = FastPathOptions.from_mapping({"share_tails": True, "min_shared_tokens": 16})
    assert options == FastPathOptions(share_tails=True, min_shared_tokens=16)
    both = FastPathOptions.from_mapping({"gdn_fp32": True}, base=options)
    assert both == FastPathOptions(share_tails=True, min_shared_tokens=16, gdn_fp32=True)
    with pytest.raises(ValueError, match=r"unknown fast-path option\(s\): min_shared, tails; known: packed_candidates"):
        FastPathOptions.from_mapping({"tails": True, "min_shared": 3, "gdn_fp32": True})
    with pytest.raises(ValueError, match="must be a mapping"):
        FastPathOptions.from_mapping([("share_tails", True)])
    with pytest.raises(ValueError, match="max_tokens must be a positive integer, got 0"):  # values checked too
        FastPathOptions.from_mapping({"max_tokens": 0})


def test_replace_checks_like_a_new_one():
    options = FastPathOptions().replace(max_sequences=3)
    assert options.max_sequences == 3 and FastPathOptions().max_sequences == 16
    with pytest.raises(ValueError, match="max_sequences must be a positive integer"):
        options.replace(max_sequences=0)
    with pytest.raises(ValueError, match="unknown fast-path option"):
        options.replace(max_seq=3)


def test_to_dict_all_or_the_changes():
    options = FastPathOptions(share_tails=False, cuda_graphs=False)
    assert options.to_dict(changed_only=True) == {"cuda_graphs": False, "share_tails": False}
    assert list(options.to_dict()) == list(FastPathOptions.names()) and options.to_dict()["max_tokens"] == 4096
    assert FastPathOptions.from_mapping(options.to_dict()) == options
    assert FastPathOptions().to_dict(changed_only=True) == {}


def test_the_forward_key_holds_the_options_the_forward_reads():
    key = FastPathOptions().forward_key()
    for name in FastPathOptions.names():
        value = getattr(FastPathOptions(), name)
        other = (not value) if isinstance(value, bool) else {"fp8": "all", "packed_attention": "efficient"}[name] \
            if isinstance(value, str) else value + 1
        changed = FastPathOptions().replace(**{name: other})
        assert (changed.forward_key() != key) == (name in FORWARD_FIELDS), name
    # fp8 is not read by the forward: apply_patches swaps the modules once (score_fast refuses a call's other fp8)
    assert FORWARD_FIELDS == ("final_row_mlp", "compile_elementwise", "fused_elementwise", "gdn_fp32",
                              "packed_attention", "residual_fp32")


def test_the_packed_attention_kernel_is_one_of_two_names():
    assert FastPathOptions().packed_attention == "flash"  # the one the fidelity gate has passed
    for kernel in ("flash", "efficient"):
        assert FastPathOptions(packed_attention=kernel).packed_attention == kernel
    for other in ("fa3", "cudnn"):  # cuDNN's ragged path cannot be captured in a graph (RESULTS.md s22)
        with pytest.raises(ValueError, match=f"packed_attention must be one of 'flash', 'efficient', got '{other}'"):
            FastPathOptions.from_mapping({"packed_attention": other})


def test_importing_the_options_loads_no_torch():
    code = "import sys, hf_openjev.fast_options; assert 'torch' not in sys.modules, 'torch was imported'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_options_from_a_command_lines_json_are_checked_and_named_by_its_flag():
    from hf_openjev.fast_options import options_mapping_from_json

    assert options_mapping_from_json('{"dense_attention_tokens": 1, "shared_prefix": false}', flag="--x") == {
        "dense_attention_tokens": 1, "shared_prefix": False}
    assert options_mapping_from_json("{}", flag="--x") == {}
    for text, message in [("{", "--x: not JSON"), ('"a"', "--x: give a JSON object"),
                          ('{"nope": 1}', "--x: unknown fast-path option(s): nope"),
                          ('{"dense_attention_tokens": -1}', "--x: dense_attention_tokens must be a non-negative")]:
        with pytest.raises(ValueError) as info:
            options_mapping_from_json(text, flag="--x")
        assert str(info.value).startswith(message) and "\n" not in str(info.value), (text, str(info.value))


# --- a family member's own defaults (options_for, the one door) -----------------------------------------------

def _config_of(member):
    import types

    names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "linear_num_key_heads", "linear_num_value_heads")
    return types.SimpleNamespace(**dict(zip(names, member.shape)))


def test_each_member_gets_its_own_defaults_and_named_changes_win():
    from hf_openjev.family import MEMBERS, member_sized
    from hf_openjev.fast_options import MEMBER_DEFAULTS, PACKED_2B, options_for

    two_b = member_sized("2b")
    own = FastPathOptions.from_mapping(MEMBER_DEFAULTS[two_b.name])
    assert (own.packed_candidates, own.shared_prefix, own.dense_attention_tokens) == (False, False, 1)
    assert options_for(two_b) == options_for(_config_of(two_b)) == own  # a member, or a config of its shape
    composite = type("Composite", (), {"text_config": _config_of(two_b)})()
    assert options_for(composite) == own
    for member in MEMBERS:
        if member is not two_b:
            assert options_for(member) == FastPathOptions()  # 9B and 27B: the package's defaults
    assert options_for(None) == options_for(member_sized("mid")) == FastPathOptions()
    changed = options_for(two_b, {"cuda_graphs": False}, fp8="no-gdn")
    assert changed == own.replace(cuda_graphs=False, fp8="no-gdn")  # the rest of the 2B's own stays
    assert options_for(two_b, PACKED_2B) == FastPathOptions()  # the packed path named back in
    with pytest.raises(ValueError, match="unknown fast-path option"):
        options_for(two_b, {"packed": True})


def test_a_commands_options_are_checked_first_and_put_over_the_members_defaults_later():
    from hf_openjev.family import member_sized
    from hf_openjev.fast_options import MEMBER_DEFAULTS, options_for, resolve_fast_options

    two_b, changes = member_sized("2b"), {"min_shared_tokens": 7}
    options, fast = resolve_fast_options(changes, fp8="off", fast=None, reference_flag="--reference")
    assert fast is True and options == FastPathOptions(min_shared_tokens=7)  # no model yet: the package's
    assert options_for(two_b, changes) == FastPathOptions.from_mapping({**MEMBER_DEFAULTS[two_b.name], **changes})
    assert resolve_fast_options({}, fp8="off", fast=None, reference_flag="--reference") == (None, None)

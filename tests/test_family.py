"""hf_openjev.family (issue 31): the members' shape tuples, temperatures and tied flags, and the check export, the
loaders, the pipeline, eval and serve run on a checkpoint: an unknown shape is one line naming the tuple and the
nearest member, a checkpoint naming one member with another's shape or temperature is refused, and
``allow_unknown_shape`` / ``--allow-unknown-shape`` runs it anyway. The tiny checkpoints pass for their
``test_checkpoint`` mark; with the mark removed the same checkpoint is refused."""

from __future__ import annotations

import json
import shutil
import socket
from types import SimpleNamespace

import pytest
from serve_cli_args import forbid_loading

from hf_openjev import cli
from hf_openjev.checkpoint.manifest import MANIFEST_NAME
from hf_openjev.errors import CheckpointError
from hf_openjev.export.merge import merge_lora
from hf_openjev.family import (
    MEMBERS,
    ModelShape,
    backbone_parameters,
    check_export_shape,
    check_family_member,
    member_with_shape,
    shape_of,
    text_config_of,
)
from hf_openjev.model import load_export, load_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py

BY_SIZE = {m.name.split("-")[2].lower(): m for m in MEMBERS}  # "27b", "9b", "2b"


def _config(shape, tied=False) -> SimpleNamespace:
    s = ModelShape(*shape)
    return SimpleNamespace(hidden_size=s.hidden, intermediate_size=s.mlp, num_hidden_layers=s.layers,
                           num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                           linear_num_key_heads=s.gdn_key_heads, linear_num_value_heads=s.gdn_value_heads,
                           tie_word_embeddings=tied)


def _error(config, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        check_family_member(config, where="ckpt", **kwargs)
    message = str(info.value)
    assert "\n" not in message and message.startswith("ckpt: ")
    return message


# --- the table --------------------------------------------------------------------------------------------------

def test_the_table_holds_the_three_members():
    assert BY_SIZE["27b"].shape == (5120, 17408, 64, 24, 4, 16, 48)
    assert BY_SIZE["9b"].shape == (4096, 12288, 32, 16, 4, 16, 32)
    assert BY_SIZE["2b"].shape == (2048, 6144, 24, 8, 2, 16, 16)
    assert [BY_SIZE[s].temperature for s in ("27b", "9b", "2b")] == [2.5343690298472983, 1.8969118766347646,
                                                                        1.518796342858676]
    assert [BY_SIZE[s].tied for s in ("27b", "9b", "2b")] == [False, False, True]
    assert [BY_SIZE[s].base for s in ("27b", "9b", "2b")] == ["Qwen/Qwen3.8-27B", "Qwen/Qwen3.5-9B", "Qwen/Qwen3.5-2B"]


@pytest.mark.parametrize("member", MEMBERS, ids=lambda m: m.name)
def test_each_members_config_passes_the_check(member):
    config = text_config_of(member)
    assert shape_of(config) == member.shape and config.tie_word_embeddings is member.tied
    assert config.layer_types.count("full_attention") * 4 == member.shape.layers
    assert check_family_member(config, temperature=member.temperature, names=[member.base], where="x") is member


def test_the_27b_backbone_has_the_documented_parameter_count():
    assert abs(backbone_parameters(BY_SIZE["27b"]) - 25.6e9) < 0.05e9  # checkpoints.md: about 25.6 B


# --- the check --------------------------------------------------------------------------------------------------

def test_an_unknown_shape_names_its_tuple_and_the_nearest_member():
    message = _error(_config((4096, 11008, 32, 16, 4, 16, 32)), temperature=1.0)
    assert "(hidden, MLP, layers, heads, KV heads, GDN key heads, GDN value heads) = (4096, 11008, 32, 16, 4, 16, 32)" \
        in message
    assert "the nearest is Open-Jev-9B (4096, 12288, 32, 16, 4, 16, 32)" in message
    assert "allow_unknown_shape=True (--allow-unknown-shape)" in message
    assert "nearest is Open-Jev-2B" in _error(_config((64, 128, 4, 4, 2, 2, 6)), temperature=1.0)


def test_an_unknown_shape_runs_when_allowed_and_a_test_checkpoint_always():
    config = _config((64, 128, 4, 4, 2, 2, 6))
    assert check_family_member(config, temperature=1.0, allow_unknown=True, where="x") is None
    assert check_family_member(config, temperature=1.0, test_checkpoint=True, where="x") is None
    assert check_family_member(config, temperature=1.0, names=["Qwen/Qwen3.5-9B"], allow_unknown=True,
                               where="x") is None


@pytest.mark.parametrize("name", ["Qwen/Qwen3.5-9B", "qwen/qwen3.5-9b", "open-jev/Open-Jev-9B", "open-jev-9b-v2"])
def test_a_checkpoint_naming_one_member_with_anothers_shape_is_refused(name):
    two_b = BY_SIZE["2b"]
    message = _error(_config(two_b.shape, tied=True), temperature=two_b.temperature, names=[name])
    assert f"it names Open-Jev-9B ({name!r})" in message and "(2048, 6144, 24, 8, 2, 16, 16)" in message
    assert "is not that model's (4096, 12288, 32, 16, 4, 16, 32)" in message


def test_names_of_other_models_are_not_read_as_members():
    two_b, big = BY_SIZE["2b"], BY_SIZE["27b"]
    assert check_family_member(_config(big.shape), temperature=big.temperature,
                               names=["open-jev/Open-Jev-27B-v1.1", "Qwen/Qwen3.8-27B"], where="x") is big
    assert check_family_member(_config(two_b.shape, tied=True), temperature=two_b.temperature,
                               names=["open-jev/Open-Jev-2B", "/models/open-jev-2b", "open-jev/tiny-random",
                                      "Qwen/Qwen3.5-27B", ""], where="x") is two_b
    with pytest.raises(CheckpointError, match="names Open-Jev-27B-v1.1"):  # "27b" is not read as "2b"
        check_family_member(_config(two_b.shape, tied=True), temperature=two_b.temperature,
                            names=["open-jev/Open-Jev-27B-v1.1"], where="x")


def test_a_members_shape_with_another_members_temperature_is_refused():
    nine = BY_SIZE["9b"]
    message = _error(_config(nine.shape), temperature=BY_SIZE["2b"].temperature)
    assert "the shape of Open-Jev-9B but the temperature of Open-Jev-2B (1.518796342858676)" in message
    assert check_family_member(_config(nine.shape), temperature=1.9, where="x") is nine  # a recalibration


def test_a_members_shape_with_the_other_tie_flag_is_refused():
    two_b, nine = BY_SIZE["2b"], BY_SIZE["9b"]
    assert "tie_word_embeddings is false but Open-Jev-2B ties its embeddings" in _error(
        _config(two_b.shape, tied=False), temperature=two_b.temperature)
    assert "tie_word_embeddings is true but Open-Jev-9B does not tie" in _error(
        _config(nine.shape, tied=True), temperature=nine.temperature)
    assert member_with_shape(two_b.shape) is two_b


# --- where it runs: export, loaders, pipeline, eval, serve ------------------------------------------------------

@pytest.fixture
def unmarked(tiny_checkpoint, tmp_path) -> SimpleNamespace:
    """Copies of the tiny export and package without their test_checkpoint mark."""
    export, package = tmp_path / "export", tmp_path / "package"
    shutil.copytree(tiny_checkpoint.export, export)
    shutil.copytree(tiny_checkpoint.package, package)
    for path in (export / MANIFEST_NAME, package / "checkpoint" / "model.json"):
        data = json.loads(path.read_text())
        assert data.pop("test_checkpoint") is True
        path.write_text(json.dumps(data))
    return SimpleNamespace(export=export, package=package, base=tiny_checkpoint.base, root=tmp_path)


UNKNOWN = "(64, 128, 4, 4, 2, 2, 6) is no Open-Jev model's; the nearest is Open-Jev-2B"


def test_the_loaders_refuse_an_unknown_shape_unless_allowed(unmarked):
    with pytest.raises(CheckpointError, match=r"export: its shape .* = " + UNKNOWN.replace("(", r"\(").replace(")", r"\)")):
        load_export(unmarked.export, dtype="float32", device="cpu")
    assert load_export(unmarked.export, dtype="float32", device="cpu", allow_unknown_shape=True).config.hidden_size == 64
    with pytest.raises(CheckpointError, match="is no Open-Jev model's"):
        load_reference(unmarked.base, unmarked.package, dtype="float32", device="cpu")
    load_reference(unmarked.base, unmarked.package, dtype="float32", device="cpu", allow_unknown_shape=True)


def test_an_export_naming_a_member_is_refused_before_its_weights_load(unmarked):
    """A 2B-shaped config under a manifest that names the 9B: the family check speaks before the weight check."""
    two_b = BY_SIZE["2b"]
    config = json.loads((unmarked.export / "config.json").read_text())
    config.update(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                  num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, head_dim=256,
                  linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True,
                  layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6)
    (unmarked.export / "config.json").write_text(json.dumps(config))
    manifest = json.loads((unmarked.export / MANIFEST_NAME).read_text())
    manifest.update(model_id="open-jev/Open-Jev-9B", head_weight=[0.01] * 2048, temperature=two_b.temperature)
    (unmarked.export / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"it names Open-Jev-9B \('open-jev/Open-Jev-9B'\)"):
        load_export(unmarked.export, device="cpu")
    assert check_export_shape(unmarked.export, allow_unknown=True) is two_b
    manifest["model_id"] = "open-jev/Open-Jev-2B"  # now a 2B: the check passes and the weights are what fail
    (unmarked.export / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert check_export_shape(unmarked.export) is two_b
    with pytest.raises(CheckpointError, match="config.json implies"):
        load_export(unmarked.export, device="cpu")


def test_export_refuses_an_unknown_shape_before_writing_unless_allowed(unmarked):
    out = unmarked.root / "out"
    with pytest.raises(CheckpointError, match="is no Open-Jev model's"):
        merge_lora(unmarked.base, unmarked.package, out, progress=False, verify=False)
    assert not out.exists()
    adapter = unmarked.package / "checkpoint" / "adapter" / "adapter_config.json"
    config = json.loads(adapter.read_text())
    adapter.write_text(json.dumps({**config, "base_model_name_or_path": "Qwen/Qwen3.5-9B"}))
    with pytest.raises(CheckpointError, match=r"it names Open-Jev-9B \('Qwen/Qwen3.5-9B'\)"):
        merge_lora(unmarked.base, unmarked.package, out, progress=False, verify=False)
    adapter.write_text(json.dumps(config))
    merge_lora(unmarked.base, unmarked.package, out, progress=False, allow_unknown_shape=True)  # probe included
    assert "test_checkpoint" not in json.loads((out / MANIFEST_NAME).read_text())


def test_the_export_command_has_allow_unknown_shape(unmarked, capsys):
    argv = ["export", "--base", str(unmarked.base), "--package", str(unmarked.package), "--no-progress",
            "--no-verify", "--out"]
    assert cli.main(argv + [str(unmarked.root / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-openjev export: error: ") and UNKNOWN in err and "\n" not in err
    assert cli.main(argv + [str(unmarked.root / "b"), "--allow-unknown-shape"]) == 0
    assert (unmarked.root / "b" / MANIFEST_NAME).is_file()


def test_the_pipeline_takes_allow_unknown_shape(unmarked):
    from transformers import pipeline

    import hf_openjev  # noqa: F401 - registers the task

    with pytest.raises(CheckpointError, match="is no Open-Jev model's"):
        pipeline("jev-decision", model=str(unmarked.export), device="cpu")
    jev = pipeline("jev-decision", model=str(unmarked.export), device="cpu", allow_unknown_shape=True)
    assert jev.model.config.hidden_size == 64


def test_eval_refuses_an_unknown_shape_before_reading_tasks(unmarked, monkeypatch, capsys):
    from hf_openjev.eval import evaluate as evaluate_mod

    def no_tasks(*args, **kwargs):
        raise AssertionError("tasks read")

    monkeypatch.setattr(evaluate_mod, "load_tasks", no_tasks)
    data = unmarked.root / "tasks.jsonl"
    data.write_text("{}\n")
    argv = ["eval", "--model", str(unmarked.export), "--data", str(data), "--out", str(unmarked.root / "eval"),
            "--device", "cpu", "--no-progress"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-openjev eval: error: ") and UNKNOWN in err
    with pytest.raises(AssertionError, match="tasks read"):  # allowed: on to the tasks
        cli.main(argv + ["--allow-unknown-shape"])


def test_serve_refuses_an_unknown_shape_before_loading_unless_allowed(unmarked, monkeypatch, capsys):
    from hf_openjev.serve import startup

    forbid_loading(monkeypatch, "family check")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert cli.main(["serve", "--model", str(unmarked.export), "--port", str(port), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-openjev serve: error: ") and UNKNOWN in err and "\n" not in err
    seen = {}
    monkeypatch.setattr(startup, "serve", lambda model_dir, **kw: seen.update(kw) or 0)
    assert cli.main(["serve", "--model", str(unmarked.export), "--allow-unknown-shape"]) == 0
    assert seen["allow_unknown_shape"] is True


def test_a_cached_tiny_build_without_the_mark_is_rebuilt(tmp_path):
    """A demo cache made before the mark existed would be refused by the check: build_tiny_checkpoint rebuilds it."""
    from hf_openjev.export.tiny import build_tiny_checkpoint

    tiny = build_tiny_checkpoint(tmp_path / "tiny")
    path = tiny.export / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    del manifest["test_checkpoint"]
    path.write_text(json.dumps(manifest))
    build_tiny_checkpoint(tmp_path / "tiny")
    assert json.loads(path.read_text())["test_checkpoint"] is True
    load_export(tiny.export, dtype="float32", device="cpu")


def test_a_test_checkpoint_mark_must_be_a_boolean(unmarked):
    path = unmarked.export / MANIFEST_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), "test_checkpoint": "yes"}))
    with pytest.raises(CheckpointError, match="test_checkpoint must be true or false, got 'yes'"):
        load_export(unmarked.export, device="cpu")

"""hf_openjev.checkpoint.out_dir: what ``--overwrite`` may replace (an export or an empty folder only) and where an
export may not go (on, above or inside the base or the package), through every export command (issue 36)."""

from __future__ import annotations

import os
import shutil

import pytest

from hf_openjev.checkpoint.manifest import MANIFEST_NAME
from hf_openjev.errors import CheckpointError
from hf_openjev.export.merge import merge_lora
from hf_openjev.fp8.quantize import quantize_export


def _user_folder(path):
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("chapter 1")
    return path


def _cli(monkeypatch, argv):
    import hf_openjev.cli as cli

    monkeypatch.setattr(cli, "COMMANDS", {name: cli.COMMANDS[name] for name in ("export", "quantize")})
    return cli.main(argv)


def test_overwrite_refuses_a_folder_that_is_not_an_export_and_keeps_it(tiny_checkpoint, tmp_path, monkeypatch,
                                                                        capsys):
    thesis = _user_folder(tmp_path / "thesis")
    with pytest.raises(CheckpointError, match=r"is not an export \(no open_jev_export.json\) and not empty; "
                                              r"--overwrite replaces only an export or an empty folder"):
        merge_lora(tiny_checkpoint.base, tiny_checkpoint.package, thesis, overwrite=True, progress=False,
                   verify=False)
    with pytest.raises(CheckpointError, match="is not an export"):
        quantize_export(tiny_checkpoint.export, thesis, overwrite=True, progress=False)
    args = ["--out", str(thesis), "--overwrite", "--no-progress"]
    assert _cli(monkeypatch, ["export", "--base", str(tiny_checkpoint.base), "--package",
                              str(tiny_checkpoint.package), *args, "--no-verify"]) == 2
    assert _cli(monkeypatch, ["export", "--base", str(tiny_checkpoint.base), "--package",
                              str(tiny_checkpoint.package), *args, "--fp8", "--probe", "off"]) == 2
    assert _cli(monkeypatch, ["quantize", "--model", str(tiny_checkpoint.export), *args]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all("--overwrite replaces only an export or an empty folder" in e for e in errors)
    assert os.listdir(thesis) == ["thesis.tex"] and sorted(os.listdir(tmp_path)) == ["thesis"]


def test_overwrite_replaces_an_export_or_an_empty_folder(tiny_checkpoint, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    merge_lora(tiny_checkpoint.base, tiny_checkpoint.package, empty, overwrite=True, progress=False, verify=False)
    assert (empty / MANIFEST_NAME).is_file()
    (empty / "stale-note").write_text("old export's")
    quantize_export(empty, tmp_path / "fp8", progress=False)
    quantize_export(empty, tmp_path / "fp8", overwrite=True, progress=False)  # replaces an (FP8) export
    merge_lora(tiny_checkpoint.base, tiny_checkpoint.package, empty, overwrite=True, progress=False, verify=False)
    assert not (empty / "stale-note").exists() and sorted(os.listdir(tmp_path)) == ["empty", "fp8"]


def test_out_inside_the_base_or_the_package_is_refused(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    base, package = tmp_path / "base", tmp_path / "package"
    shutil.copytree(tiny_checkpoint.base, base)
    shutil.copytree(tiny_checkpoint.package, package)
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    for out in (package / "checkpoint", package / "checkpoint" / "new", base / "export"):
        with pytest.raises(CheckpointError, match=r"is inside the input directory .*; choose a folder outside the "
                                                  r"base and the package"):
            merge_lora(base, package, out, overwrite=True, progress=False, verify=False)
    assert _cli(monkeypatch, ["export", "--base", str(base), "--package", str(package), "--out",
                              str(package / "checkpoint"), "--overwrite", "--fp8", "--no-progress"]) == 2
    assert "is inside the input directory" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before


def test_a_link_and_a_file_are_not_replaced(tmp_path):
    from hf_openjev.checkpoint.out_dir import check_replaceable, is_replaceable

    export = tmp_path / "export"
    export.mkdir()
    (export / MANIFEST_NAME).write_text("{}")
    (tmp_path / "link").symlink_to(export)
    (tmp_path / "file").write_text("x")
    assert is_replaceable(export) and not is_replaceable(tmp_path / "link")
    for path in (tmp_path / "link", tmp_path / "file"):
        with pytest.raises(CheckpointError, match="not a directory"):
            check_replaceable(path, overwrite=True)

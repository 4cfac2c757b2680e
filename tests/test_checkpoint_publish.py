"""hf_openjev.checkpoint.publish: the temporary an export is written into (claim_export_temp, TempDir.discard), as
``hf-openjev export`` and ``hf-openjev quantize`` both claim it."""

from __future__ import annotations

import os
import stat

import pytest

import hf_openjev.checkpoint.publish as publish
from hf_openjev.checkpoint.out_dir import read_umask


def test_the_export_temp_is_an_ordinary_directory_and_stale_ones_are_removed_and_said(tmp_path):
    out = tmp_path / "new" / "export"
    out.parent.mkdir()
    stale = publish.claim_temp_dir(out)
    stale.release()  # its process died: the lock file is gone, the lock with it
    stale.lock_path.write_text("")  # a lock file nobody holds
    said = []
    claim = publish.claim_export_temp(tmp_path / "new" / "export", say=said.append, what="fp8")
    assert said == [f"fp8: removed {stale.path}, left by an export that did not finish"]
    assert not stale.path.exists() and claim.path.parent == out.parent and claim.path.is_dir()
    assert stat.S_IMODE(claim.path.stat().st_mode) == 0o777 & ~read_umask()
    (claim.path / "shard.safetensors").write_text("x")
    claim.discard()
    assert not claim.path.exists() and not claim.lock_path.exists() and claim.lock_fd is None


def test_the_parent_is_made_and_a_failure_after_the_claim_leaves_nothing(tmp_path, monkeypatch):
    def refuse(path, mode):
        raise PermissionError("chmod refused")

    monkeypatch.setattr(publish.os, "chmod", refuse)
    with pytest.raises(PermissionError):
        publish.claim_export_temp(tmp_path / "a" / "b" / "export", say=print, what="export")
    assert os.listdir(tmp_path / "a" / "b") == []

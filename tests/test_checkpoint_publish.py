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


def _fake_export(path, marker: str):
    path.mkdir()
    (path / "open_jev_export.json").write_text("{}")
    (path / "marker").write_text(marker)


def test_the_swap_refuses_a_target_that_stopped_being_an_export(tmp_path):
    from hf_openjev.errors import CheckpointError

    out = tmp_path / "export"
    _fake_export(out, "old")
    claim = publish.claim_export_temp(out, say=print, what="export")
    (claim.path / "new").write_text("x")
    (out / "open_jev_export.json").unlink()  # replaced by the user's files while the export ran
    (out / "thesis.tex").write_text("chapter 1")
    with pytest.raises(CheckpointError, match="no longer an export or an empty folder, so it was not replaced"):
        publish.put_in_place(claim, out, overwrite=True, refuse=AssertionError)
    assert sorted(os.listdir(out)) == ["marker", "thesis.tex"]
    claim.discard()


_KILLED_SWAP = r'''
import os, sys
from pathlib import Path
import hf_openjev.checkpoint.publish as p

out = Path(sys.argv[1])
p._exchange = lambda a, b: False  # another OS, NFS: two renames
real = Path.rename
def rename(self, target):
    moved = real(self, target)
    if Path(self) == out:  # the old export has just been moved aside; the new one is not in place yet
        os._exit(9)  # as SIGKILL: no handler, no cleanup
    return moved
Path.rename = rename
claim = p.claim_export_temp(out, say=print, what="export")
(claim.path / "open_jev_export.json").write_text("{}")
(claim.path / "marker").write_text("new")
p.put_in_place(claim, out, overwrite=True, refuse=AssertionError)
'''


def _kill_between_the_renames(out):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _KILLED_SWAP, str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 9, proc.stderr
    assert not out.exists()
    aside = [p for p in out.parent.iterdir() if p.name.startswith(".export.old-") and p.is_dir()]
    assert len(aside) == 1 and (aside[0] / "marker").read_text() == "old"  # kept until the new one is in place


def test_a_fallback_swap_killed_between_the_renames_is_put_back_by_the_next_run(tmp_path):
    """Issue 36: without the atomic exchange, a crash between the renames left no OUT, and the rerun deleted the
    moved-aside export with the stale temporaries. Now stale removal keeps it and the next claim puts it back."""
    out = tmp_path / "export"
    _fake_export(out, "old")
    _kill_between_the_renames(out)
    assert publish.remove_stale_temps(out) != [] and not out.exists()  # the dead run's new temporary goes...
    assert any(p.name.startswith(".export.old-") for p in tmp_path.iterdir())  # ...the old export stays
    said = []
    claim = publish.claim_export_temp(out, say=said.append, what="export")
    assert (out / "marker").read_text() == "old"
    assert said[0].startswith(f"export: put back {out} from {tmp_path / '.export.old-'}")
    claim.discard()
    assert sorted(os.listdir(tmp_path)) == ["export"]


def test_an_export_rerun_after_a_killed_fallback_swap_restores_then_honours_overwrite(tiny_checkpoint, tmp_path):
    from hf_openjev.errors import CheckpointError
    from hf_openjev.export.merge import merge_lora

    out = tmp_path / "export"
    _fake_export(out, "old")
    _kill_between_the_renames(out)
    said = []
    with pytest.raises(CheckpointError, match="already exists; pass --overwrite"):  # the old export is back
        merge_lora(tiny_checkpoint.base, tiny_checkpoint.package, out, progress=False, verify=False, log=said.append)
    assert (out / "marker").read_text() == "old" and said[0].startswith(f"export: put back {out}")
    merge_lora(tiny_checkpoint.base, tiny_checkpoint.package, out, overwrite=True, progress=False, verify=False)
    assert not (out / "marker").exists() and sorted(os.listdir(tmp_path)) == ["export"]


def test_the_fallback_swap_puts_the_old_export_back_on_an_error_and_replaces_it_otherwise(tmp_path, monkeypatch):
    """Without the atomic exchange: an error in the second rename puts the old export back; a clean swap leaves only
    the new one (the regression guard of the two-rename path the issue-36 restore builds on)."""
    from pathlib import Path

    monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    out = tmp_path / "export"
    _fake_export(out, "old")
    claim = publish.claim_export_temp(out, say=print, what="export")
    (claim.path / "open_jev_export.json").write_text("{}")
    (claim.path / "marker").write_text("new")
    real = Path.rename

    def second_rename_fails(self, target):
        if Path(target) == out and Path(self) == claim.path:
            raise OSError(5, "I/O error")
        return real(self, target)

    with monkeypatch.context() as patch:
        patch.setattr(Path, "rename", second_rename_fails)
        with pytest.raises(OSError, match="I/O error"):
            publish.put_in_place(claim, out, overwrite=True, refuse=AssertionError)
    assert (out / "marker").read_text() == "old"
    publish.put_in_place(claim, out, overwrite=True, refuse=AssertionError)
    assert (out / "marker").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["export"]

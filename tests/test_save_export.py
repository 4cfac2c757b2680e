"""``jev.save_pretrained(dir)`` (hf_openjev.save_export): a copy of the export that loads and answers the same;
refused before writing when it cannot be done; never a partial directory."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import pipeline

import hf_openjev
from hf_openjev.errors import UsageError

REQUEST = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "Is it urgent?"}}}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def jev(tiny_checkpoint):
    return pipeline("jev-decision", model=str(tiny_checkpoint.export), device="cpu", dtype="float32")


def test_save_pretrained_writes_an_export_that_loads_and_answers_the_same(jev, tmp_path):
    saved = jev.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]
    again = pipeline("jev-decision", model=str(saved), device="cpu", dtype="float32")
    assert again(REQUEST)["answers"] == jev(REQUEST)["answers"]
    (tmp_path / "empty").mkdir()
    jev.save_pretrained(tmp_path / "empty")  # an empty directory is fine too
    assert (tmp_path / "empty" / "open_jev_export.json").is_file()


def test_save_pretrained_refuses_before_writing(jev, tiny_model, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UsageError, match="exists and is not an empty directory"):
        jev.save_pretrained(tmp_path / "full")
    memory = hf_openjev.JevModel(tiny_model.backbone.__class__(tiny_model.backbone.config), torch.nn.Linear(64, 1),
                                 tiny_model.tokenizer, tiny_model.manifest, method="merged")
    memory.backbone.config._name_or_path = ""
    in_memory = pipeline("jev-decision", model=memory, device="cpu")
    with pytest.raises(UsageError, match="was not loaded from an export directory"):
        in_memory.save_pretrained(tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_a_failed_copy_leaves_no_partial_directory(jev, tmp_path, monkeypatch):
    import hf_openjev.checkpoint.save_export as save_export

    real, copied = shutil.copyfile, []

    def flaky(src, dst):
        copied.append(src)
        if len(copied) == 3:
            raise OSError(28, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(save_export.shutil, "copyfile", flaky)
    with pytest.raises(OSError):
        jev.save_pretrained(tmp_path / "saved")
    assert list(tmp_path.iterdir()) == []

"""``jev.save_pretrained(directory)``: a copy of the merged export the pipeline's model was loaded from.

An export is what the loaders read (``open_jev_export.json``, config, bf16 shards, tokenizer files), so saving a
pipeline writes that export again, not the model's in-memory state: a model loaded in another dtype, patched for
the fast path or with FP8 projections saves the export it came from (load it with the same options to get the
same model again). Everything is checked before the first byte is written (one-line
:class:`~hf_openjev.errors.UsageError`), the copy goes to a temporary directory beside the target with the
manifest last, and only a finished copy is renamed into place: a failure never leaves a partial directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..errors import CheckpointError, UsageError
from .manifest import MANIFEST_NAME, read_manifest

__all__ = ["save_export_copy"]


def _source_export(model) -> Path:
    """The export directory ``model`` was loaded from, checked to still hold the same manifest."""
    source = getattr(getattr(model.backbone, "config", None), "_name_or_path", None)
    hint = "save it with `hf-openjev export` (or keep the directory it was loaded from)"
    if not source or not Path(source).is_dir():
        raise UsageError(f"save_pretrained copies the merged export a model was loaded from, and this model was not "
                         f"loaded from an export directory; {hint}")
    try:
        on_disk = read_manifest(source)
    except CheckpointError as exc:
        raise UsageError(f"save_pretrained: the export this model was loaded from cannot be read any more ({exc})") \
            from None
    if on_disk.to_json() != model.manifest.to_json():
        raise UsageError(f"save_pretrained: {source} no longer holds the export this model was loaded from (its "
                         f"manifest changed); {hint}")
    return Path(source)


def _check_target(target: Path, source: Path) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"save_pretrained: {target} exists and is not an empty directory; pass a new directory")
    if target.resolve() == source.resolve():
        raise UsageError(f"save_pretrained: {target} is the export the model was loaded from")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"save_pretrained: cannot create {target}: {parent} is not writable")


def save_export_copy(model, save_directory) -> Path:
    """Copy ``model``'s export to ``save_directory`` (new, or an empty directory); returns its path."""
    source = _source_export(model)
    target = Path(save_directory)
    _check_target(target, source)
    files = sorted((p for p in source.iterdir() if p.is_file() and p.name != MANIFEST_NAME), key=lambda p: p.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.saving-", dir=target.parent))
    try:
        for path in [*files, source / MANIFEST_NAME]:  # the manifest last: without it, no loader accepts the copy
            shutil.copyfile(path, tmp / path.name)
        mask = os.umask(0o022)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes it 0o700: an ordinary directory, as mkdir makes
        if target.exists():
            target.rmdir()  # empty (checked above)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target

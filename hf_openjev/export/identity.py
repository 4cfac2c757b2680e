"""Is ``--base`` the model the package was trained on? And a fingerprint of the base weights for the manifest.

An adapter merges into any base whose shapes fit, so a package swapped onto another base of the same size
exports cleanly and verifies as "bitwise identical" to PEFT: the verification checks the merge, not the base.
This module compares what can be read on both sides:

- the package names its base in ``adapter/adapter_config.json`` (PEFT's ``base_model_name_or_path`` and
  ``revision``) and may in ``model.json`` (``base_model`` / ``base_model_id``, ``base_revision``,
  ``base_fingerprint``);
- the base directory says what it is through, first found first: the Hugging Face cache layout of its path
  (``.../models--ORG--NAME/snapshots/REVISION``), a git checkout of a Hub repo (``.git``: remote url and HEAD),
  the metadata ``hf download --local-dir`` leaves (``.cache/huggingface/download/*.metadata``: the revision), and
  ``_name_or_path`` in ``config.json``. A model card is not read: its ``base_model`` names the model's parent,
  not the model.

Repo ids are compared case-insensitively, revisions as commit hashes (a short hash matches its long form). A
name that is a local path, or a revision that is a branch name, cannot be compared and is reported as such.
Any mismatch is refused unless explicitly allowed; whatever cannot be read is said in the export report.

:func:`base_fingerprint` covers, for each base safetensors shard in index order: the file size, the whole
safetensors header (every tensor's name, dtype, shape and offsets) and three 64 KiB samples of the tensor data
(start, middle, end). It reads about 200 KiB per shard (fast on any disk, streaming, no tensor is loaded). It
identifies a download, not every weight: two files that differ only outside the samples get the same
fingerprint, so it is a provenance record, not a tamper check; re-sharding the same weights changes it.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError

FINGERPRINT_VERSION = "sha256-sampled-v1"
_SAMPLE_BYTES = 64 * 1024
_MAX_HEADER_BYTES = 100 * 1024**2  # the safetensors limit
_HF_CACHE = re.compile(r"(?:^|/)models--(?P<repo>[^/]+)/snapshots/(?P<rev>[^/]+)(?:/|$)")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_HEX = re.compile(r"^[0-9a-f]{7,64}$")
_HUB_URL = re.compile(r"^(?:https?://|ssh://)?(?:[^@/]+@)?(?:huggingface\.co|hf\.co)[:/]+(?:models/)?(?P<repo>[^?#]+?)"
                      r"(?:\.git)?/*$")


@dataclass(frozen=True)
class Claim:
    """A statement of identity and where it was read."""

    value: str
    source: str


@dataclass
class BaseIdentity:
    """What the package says its base is, what ``--base`` says it is, and how they compare."""

    fingerprint: str
    package_names: list[Claim] = field(default_factory=list)
    package_revisions: list[Claim] = field(default_factory=list)
    base_name: Claim | None = None
    base_revision: Claim | None = None
    matched: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    allowed: bool = False  # mismatches exported anyway (allow_base_mismatch=True)

    @property
    def revision(self) -> str:
        """For the manifest: the base directory's revision, else the one the package names, else ""."""
        if self.base_revision is not None:
            return self.base_revision.value
        return self.package_revisions[0].value if self.package_revisions else ""

    def warning(self) -> str | None:
        if not self.mismatches:
            return None
        return ("WARNING: base mismatch allowed (--allow-base-mismatch): " + "; ".join(self.mismatches) + ". The "
                "adapter was merged into a base it was not trained on: the verification below shows the merge is "
                "faithful, not that the export's answers mean anything")

    def lines(self) -> list[str]:
        base = " @ ".join(c.value for c in (self.base_name, self.base_revision) if c is not None)
        sources = ", ".join(dict.fromkeys(c.source for c in (self.base_name, self.base_revision) if c is not None))
        out = [f"base: {base} (from {sources})" if base else "base: the base directory's identity cannot be read"]
        out += [f"base: {line}" for line in self.matched]
        out += [f"base: identity not checked: {line}" for line in self.unknown]
        out.append(f"base: fingerprint {self.fingerprint} (recorded in open_jev_export.json)")
        return out


def base_fingerprint(files: list[Path]) -> str:
    """``sha256-sampled-v1:<hex>`` over the shards' sizes, headers and data samples (see the module docstring)."""
    digest = hashlib.sha256(FINGERPRINT_VERSION.encode("ascii"))
    for path in files:
        size = Path(path).stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < length <= min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path} is not a safetensors file (bad header length)")
            digest.update(struct.pack("<QQ", size, length))
            digest.update(fh.read(length))
            start, data = 8 + length, size - 8 - length
            if data <= 3 * _SAMPLE_BYTES:
                offsets = [0] if data else []
                sample = data
            else:
                offsets = [0, (data - _SAMPLE_BYTES) // 2, data - _SAMPLE_BYTES]
                sample = _SAMPLE_BYTES
            for offset in offsets:
                fh.seek(start + offset)
                digest.update(fh.read(sample))
    return f"{FINGERPRINT_VERSION}:{digest.hexdigest()}"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _text(value) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


def package_claims(package) -> tuple[list[Claim], list[Claim], str | None]:
    """(base names, base revisions, base fingerprint) the package states."""
    adapter, info = package.adapter_config, package.model_info
    name_fields = [(adapter, "adapter_config.json", "base_model_name_or_path"), (info, "model.json", "base_model"),
                   (info, "model.json", "base_model_id")]
    revision_fields = [(info, "model.json", "base_revision"), (adapter, "adapter_config.json", "revision")]
    names = [Claim(_text(data.get(key)), f"{file} {key}") for data, file, key in name_fields if _text(data.get(key))]
    revisions = [Claim(_text(data.get(key)), f"{file} {key}") for data, file, key in revision_fields
                 if _text(data.get(key))]
    return names, revisions, _text(info.get("base_fingerprint"))


def _git_identity(base_dir: Path) -> tuple[Claim | None, Claim | None]:
    git = base_dir / ".git"
    if not git.is_dir():
        return None, None
    name = revision = None
    try:
        config = (git / "config").read_text(encoding="utf-8", errors="replace")
    except OSError:
        config = ""
    for line in config.splitlines():
        key, _, value = line.strip().partition("=")
        match = _HUB_URL.match(value.strip()) if key.strip() == "url" else None
        if match and _REPO_ID.match(match.group("repo")):
            name = Claim(match.group("repo"), "its git remote")
            break
    try:
        head = (git / "HEAD").read_text(encoding="utf-8").strip()
        if head.startswith("ref:"):
            ref = head[4:].strip()
            ref_file = git / ref
            if ref_file.is_file():
                head = ref_file.read_text(encoding="utf-8").strip()
            else:
                packed = (git / "packed-refs").read_text(encoding="utf-8") if (git / "packed-refs").is_file() else ""
                head = next((ln.split()[0] for ln in packed.splitlines() if ln.endswith(" " + ref)), "")
        if _HEX.match(head.lower()):
            revision = Claim(head.lower(), "its git HEAD")
    except (OSError, UnicodeDecodeError):
        pass
    return name, revision


def base_dir_identity(base_dir: Path) -> tuple[Claim | None, Claim | None]:
    """(repo id, revision) of a base directory, each None when it cannot be read (first source found wins)."""
    base_dir = Path(base_dir)
    name = revision = None
    for text in dict.fromkeys((base_dir.absolute().as_posix(), base_dir.resolve().as_posix())):
        match = _HF_CACHE.search(text)
        if match:
            repo = match.group("repo").replace("--", "/", 1)
            name = Claim(repo, "its Hugging Face cache path") if _REPO_ID.match(repo) else None
            rev = match.group("rev").lower()
            revision = Claim(rev, "its Hugging Face cache path") if _HEX.match(rev) else None
            break
    git_name, git_revision = _git_identity(base_dir)
    name, revision = name or git_name, revision or git_revision
    if revision is None:
        metadata = base_dir / ".cache" / "huggingface" / "download"
        for path in sorted(metadata.glob("*.metadata")) if metadata.is_dir() else []:
            try:
                first = path.read_text(encoding="utf-8").splitlines()[0].strip().lower()
            except (OSError, UnicodeDecodeError, IndexError):
                continue
            if _HEX.match(first):
                revision = Claim(first, "its `hf download` metadata")
                break
    if name is None:
        stated = _text(_read_json(base_dir / "config.json").get("_name_or_path"))
        if stated and _REPO_ID.match(stated) and not Path(stated).exists():
            name = Claim(stated, "config.json _name_or_path")
    return name, revision


def _same_revision(a: str, b: str) -> bool:
    a, b = a.lower(), b.lower()
    return a.startswith(b) or b.startswith(a)


def check_base_identity(base_dir, package, files: list[Path], *, allow_mismatch: bool = False) -> BaseIdentity:
    """Compare the package's base with ``base_dir``; raise :class:`CheckpointError` on a mismatch unless allowed."""
    base_dir = Path(base_dir)
    names, revisions, stated_fingerprint = package_claims(package)
    base_name, base_revision = base_dir_identity(base_dir)
    identity = BaseIdentity(fingerprint=base_fingerprint(files), package_names=names, package_revisions=revisions,
                            base_name=base_name, base_revision=base_revision, allowed=allow_mismatch)
    anonymous = base_name is None and base_revision is None
    if not names and not revisions and not stated_fingerprint:
        identity.unknown.append("the package names no base model (no base_model_name_or_path in "
                                "adapter_config.json, no base_model / base_revision in model.json)")
    elif anonymous and (names or revisions):
        identity.unknown.append(f"{base_dir} carries no identity (not a Hugging Face cache snapshot, no git remote, "
                                "no `hf download` metadata, no _name_or_path in config.json)")
    for claim in names:
        if not _REPO_ID.match(claim.value) or Path(claim.value).exists():
            identity.unknown.append(f"the package names its base by a local path ({claim.value!r}, {claim.source})")
        elif base_name is None:
            if not anonymous:
                identity.unknown.append(f"the package names base {claim.value!r} ({claim.source}) but the base "
                                        "directory's name cannot be read")
        elif claim.value.lower() == base_name.value.lower():
            identity.matched.append(f"{claim.source} names {claim.value!r}: matches")
        else:
            identity.mismatches.append(f"the package names base {claim.value!r} ({claim.source}) but --base is "
                                       f"{base_name.value!r} ({base_name.source})")
    for claim in revisions:
        if not _HEX.match(claim.value.lower()):
            identity.unknown.append(f"{claim.source} is {claim.value!r}, not a commit hash")
        elif base_revision is None:
            if not anonymous:
                identity.unknown.append(f"the package names base revision {claim.value!r} ({claim.source}) but "
                                        "the base directory's revision cannot be read")
        elif _same_revision(claim.value, base_revision.value):
            identity.matched.append(f"{claim.source} {claim.value!r}: matches")
        else:
            identity.mismatches.append(f"the package names base revision {claim.value!r} ({claim.source}) but "
                                       f"--base is revision {base_revision.value!r} ({base_revision.source})")
    if stated_fingerprint:
        if stated_fingerprint == identity.fingerprint:
            identity.matched.append("model.json base_fingerprint: matches")
        else:
            identity.mismatches.append(f"the package's model.json base_fingerprint is {stated_fingerprint!r} but "
                                       f"--base has {identity.fingerprint!r}")
    if identity.mismatches and not allow_mismatch:
        wanted = next((c.value for c in names if _REPO_ID.match(c.value)), None)
        hint = (f"`hf download {wanted}" + (f" --revision {revisions[0].value}" if revisions else "")
                + " --local-dir DIR`") if wanted else "the base model it was trained on"
        raise CheckpointError(
            f"--base {base_dir} is not the base model the package was trained on: {'; '.join(identity.mismatches)}. "
            f"Pass the base the package names as --base (e.g. {hint}), or pass --allow-base-mismatch "
            "(allow_base_mismatch=True) if you know the weights are the same")
    return identity

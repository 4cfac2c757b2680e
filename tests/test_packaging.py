"""pyproject.toml: hf_openjev, hf_openjev.ops (from ops/) and hf_openjev.patches (from patches/); no top-level
``ops`` or ``patches``; the ``hf-openjev`` console script."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "hf_openjev", "ops", "patches", "data", "docs"]  # data/, docs/: never installed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build a wheel offline from a clean copy of the sources (no stale build/ directory, no repo writes)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.is_file():
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(out),
         str(src)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = list(out.glob("hf_openjev-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _py_files(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*.py")}


def test_wheel_maps_ops_and_patches_under_hf_openjev(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert wheel.name == "hf_openjev-0.1.0-py3-none-any.whl"
    ops = {n.split("/")[-1] for n in names if re.fullmatch(r"hf_openjev/ops/[^/]+\.py", n)}
    patches = {n.split("/")[-1] for n in names if re.fullmatch(r"hf_openjev/patches/[^/]+\.py", n)}
    assert "__init__.py" in ops and "__init__.py" in patches
    assert ops == _py_files(REPO / "ops")
    assert patches == _py_files(REPO / "patches")
    core = {n.split("/")[-1] for n in names if re.fullmatch(r"hf_openjev/[^/]+\.py", n)}
    assert core == _py_files(REPO / "hf_openjev")
    # nothing installs as a top-level ops/ or patches/ (or tests/, recipes/)
    top = {n.split("/")[0] for n in names}
    assert top == {"hf_openjev", "hf_openjev-0.1.0.dist-info"}
    assert not any(n.startswith(("ops/", "patches/", "tests/", "recipes/")) for n in names)


def test_wheel_holds_every_module_of_the_core_and_its_subpackages(wheel):
    """Every source file under hf_openjev/ (fp8/, checkpoint/, packing/ and the commands' folders included) is in
    the wheel: a subpackage missing from pyproject's ``packages`` list would install without its files."""
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "hf_openjev").rglob("*.py")}
    assert {"hf_openjev/fp8/__init__.py", "hf_openjev/checkpoint/__init__.py", "hf_openjev/packing/__init__.py"} <= sources
    assert sources - names == set()


def test_wheel_metadata(wheel):
    with zipfile.ZipFile(wheel) as z:
        entry_points = z.read("hf_openjev-0.1.0.dist-info/entry_points.txt").decode()
        top_level = z.read("hf_openjev-0.1.0.dist-info/top_level.txt").decode().split()
        metadata = z.read("hf_openjev-0.1.0.dist-info/METADATA").decode()
    sections = re.findall(r"^\[([^\]]+)\]$", entry_points, flags=re.M)
    assert sections == ["console_scripts"]
    assert re.search(r"^hf-openjev\s*=\s*hf_openjev\.cli:main\s*$", entry_points, flags=re.M)
    assert top_level == ["hf_openjev"]
    assert "Name: hf_openjev" in metadata and "Version: 0.1.0" in metadata
    # fla-core only in the cuda extra, never a base requirement
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, flags=re.M)
    assert [r for r in requires if r.startswith("fla-core")] == ['fla-core==0.6.0; extra == "cuda"']


def test_installed_environment_has_no_top_level_ops_or_patches(tmp_path):
    code = ("import importlib.util as u\n"
            "print(u.find_spec('ops'), u.find_spec('patches'))\n"
            "import hf_openjev.ops, hf_openjev.patches\n"
            "print(hf_openjev.ops.__file__)\n"
            "print(hf_openjev.patches.__file__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["None None", str(REPO / "ops" / "__init__.py"),
                                       str(REPO / "patches" / "__init__.py")]


def test_no_source_imports_top_level_ops_or_patches():
    pattern = re.compile(r"^\s*(?:from|import)\s+(?:ops|patches)\b", flags=re.M)
    offenders = []
    for folder in ("hf_openjev", "ops", "patches", "tests", "recipes"):
        for path in (REPO / folder).rglob("*.py"):
            if pattern.search(path.read_text(encoding="utf-8")):
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == []

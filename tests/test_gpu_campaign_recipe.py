"""recipes/gpu_campaign.sh's GPU suite in parts (the list: recipes/gpu_parts.txt). Every ``@pytest.mark.gpu`` test
is in exactly one numbered part, so a new GPU test file cannot be forgotten; the quick part checks every op and the
fast path end to end; ``pytest-parts`` lists the parts and ``pytest-part`` refuses an unknown one, on CPU."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys

import pytest
from repo_data import REPO

SCRIPT = REPO / "recipes" / "gpu_campaign.sh"
PARTS = REPO / "recipes" / "gpu_parts.txt"
QUICK = "quick"
FAST_PATH_FILE = "tests/test_cuda_graphs.py"  # the fast path's end-to-end checks on CUDA


def read_parts(text: str) -> dict[str, list[str]]:
    """``{part: [entry, ...]}`` in the file's order (``#`` starts a comment line)."""
    parts: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            part, entry = line.split()
            parts.setdefault(part, []).append(entry)
    return parts


def _has_gpu_mark(node: ast.AST) -> bool:
    """``pytest.mark.gpu`` anywhere under ``node`` (a decorator, a ``pytest.param(..., marks=...)``)."""
    return any(isinstance(n, ast.Attribute) and n.attr == "gpu" and isinstance(n.value, ast.Attribute)
               and n.value.attr == "mark" for n in ast.walk(node))


def gpu_tests(source: str) -> set[str]:
    """The names of the test functions of a test file's ``source`` that hold a GPU test (the whole module when its
    ``pytestmark`` has the mark)."""
    tree = ast.parse(source)
    tests = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    module_marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                        and _has_gpu_mark(n.value) for n in tree.body)
    return {t.name for t in tests if module_marked or any(_has_gpu_mark(d) for d in t.decorator_list)}


def gpu_test_files() -> dict[str, set[str]]:
    """``{"tests/test_x.py": {GPU test functions}}`` of every test file that holds one."""
    out = {}
    for path in sorted((REPO / "tests").glob("test_*.py")):
        found = gpu_tests(path.read_text(encoding="utf-8"))
        if found:
            out[path.relative_to(REPO).as_posix()] = found
    return out


def check_numbered_parts(parts: dict[str, list[str]], gpu: dict[str, set[str]]) -> list[str]:
    """What is wrong with the numbered parts (every part but quick) against ``gpu`` (:func:`gpu_test_files`): a GPU
    test in no part or in two, an entry that names no GPU test, a parametrized node id (a part holds files or whole
    test functions)."""
    seen: dict[tuple[str, str], list[str]] = {}
    problems = []
    for part, entries in parts.items():
        if part == QUICK:
            continue
        for entry in entries:
            path, _, function = entry.partition("::")
            if "[" in function:
                problems.append(f"part {part}: {entry}: a numbered part takes a file or a test function")
                continue
            if path not in gpu or (function and function not in gpu[path]):
                problems.append(f"part {part}: {entry} holds no GPU test")
                continue
            for name in [function] if function else sorted(gpu[path]):
                seen.setdefault((path, name), []).append(part)
    for path, names in gpu.items():
        for name in sorted(names):
            where = seen.get((path, name), [])
            if len(where) != 1:
                problems.append(f"{path}::{name} is in {len(where)} numbered parts ({', '.join(where) or 'none'}); "
                                "put it in exactly one (recipes/gpu_parts.txt)")
    return problems


def check_quick_part(parts: dict[str, list[str]], gpu: dict[str, set[str]]) -> list[str]:
    """What the quick part lacks: a check of every op (each ``tests/test_op_*.py`` with a GPU test) and of the fast
    path end to end; or an entry that names no GPU test."""
    quick = parts.get(QUICK, [])
    problems = []
    for entry in quick:
        path, _, function = entry.partition("::")
        if path not in gpu or function.split("[")[0] not in gpu[path]:
            problems.append(f"quick: {entry} names no GPU test function")
    files = {entry.partition("::")[0] for entry in quick}
    for path in sorted(gpu):
        if (path.startswith("tests/test_op_") or path == FAST_PATH_FILE) and path not in files:
            problems.append(f"quick: nothing of {path}")
    return problems


def test_every_gpu_test_is_in_exactly_one_numbered_part():
    parts = read_parts(PARTS.read_text(encoding="utf-8"))
    gpu = gpu_test_files()
    assert FAST_PATH_FILE in gpu and sum(p.startswith("tests/test_op_") for p in gpu) >= 6, sorted(gpu)
    assert sorted(p for p in parts if p != QUICK) == [str(i) for i in range(1, len(parts))], list(parts)
    assert check_numbered_parts(parts, gpu) == []


def test_the_quick_part_checks_every_op_and_the_fast_path():
    parts = read_parts(PARTS.read_text(encoding="utf-8"))
    assert check_quick_part(parts, gpu_test_files()) == []


def test_the_checkers_see_a_forgotten_file_a_doubled_test_and_a_quick_part_without_an_op():
    gpu = {"tests/test_op_a.py": {"test_x", "test_y"}, "tests/test_op_b.py": {"test_z"},
           FAST_PATH_FILE: {"test_replay"}, "tests/test_new.py": {"test_new"}}
    parts = {"1": ["tests/test_op_a.py", "tests/test_op_b.py::test_z"],
             "2": ["tests/test_op_a.py::test_y", f"{FAST_PATH_FILE}::test_replay[default]", "tests/test_plain.py"],
             QUICK: [f"{FAST_PATH_FILE}::test_replay[default]", "tests/test_op_a.py::test_x[1]", "tests/test_op_b.py"]}
    assert check_numbered_parts(parts, gpu) == [
        f"part 2: {FAST_PATH_FILE}::test_replay[default]: a numbered part takes a file or a test function",
        "part 2: tests/test_plain.py holds no GPU test",
        "tests/test_op_a.py::test_y is in 2 numbered parts (1, 2); put it in exactly one (recipes/gpu_parts.txt)",
        f"{FAST_PATH_FILE}::test_replay is in 0 numbered parts (none); put it in exactly one (recipes/gpu_parts.txt)",
        "tests/test_new.py::test_new is in 0 numbered parts (none); put it in exactly one (recipes/gpu_parts.txt)"]
    assert check_quick_part(parts, gpu) == ["quick: tests/test_op_b.py names no GPU test function"]
    assert check_quick_part({QUICK: parts[QUICK][:2]}, gpu) == ["quick: nothing of tests/test_op_b.py"]


def test_gpu_marks_are_found_on_decorators_params_and_the_module():
    source = ("import pytest\n"
              "@pytest.mark.gpu\ndef test_a(): pass\n"
              "@pytest.mark.parametrize('d', ['cpu', pytest.param('cuda', marks=[pytest.mark.gpu])])\n"
              "def test_b(d): pass\n"
              "@pytest.mark.slow\ndef test_c(): pass\n"
              "def helper_gpu(): pass\n")
    assert gpu_tests(source) == {"test_a", "test_b"}
    assert gpu_tests("import pytest\npytestmark = [pytest.mark.gpu]\ndef test_d(): pass\n") == {"test_d"}


@pytest.mark.slow
def test_the_quick_node_ids_are_collected():
    """Every quick entry is a node id pytest collects under -m gpu (a renamed parameter would make the part
    fail on the device, not here)."""
    quick = read_parts(PARTS.read_text(encoding="utf-8"))[QUICK]
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
                             "no:cacheprovider", *quick], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert sorted(collected) == sorted(quick)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_script_lists_the_parts_and_refuses_an_unknown_one():
    parts = read_parts(PARTS.read_text(encoding="utf-8"))
    listed = subprocess.run(["bash", str(SCRIPT), "pytest-parts"], capture_output=True, text=True, cwd=REPO,
                            timeout=30)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [f"{part}: {' '.join(entries)} " for part, entries in parts.items()]
    unknown = subprocess.run(["bash", str(SCRIPT), "pytest-part", "1", "nine"], capture_output=True, text=True,
                             cwd=REPO, timeout=30)
    assert unknown.returncode == 2 and unknown.stdout.startswith(f"unknown part nine (the parts: {' '.join(parts)} ")

"""The package's import rules (docs/design.md "Layout"), read from the source with ``ast`` (nothing is imported):

- no two modules import each other in a circle, lazy imports inside functions included;
- the core (``hf_openjev/`` with its fp8, checkpoint and packing subpackages) imports none of the command
  subpackages (export, eval, serve, fidelity_check, demo); only the command line (``cli.py``) may;
- nothing imports ``ops`` or ``patches`` as top-level modules: always ``hf_openjev.ops`` / ``hf_openjev.patches``;
- no module of the package imports a reference kept for tests and recipes (``hf_openjev.packing.naive_layout``);
- ``import hf_openjev`` and ``hf-openjev --help`` import neither torch nor Transformers;
- no two folders (subpackages: fp8, checkpoint, packing, tokenizer, ops, patches, the commands) import each other,
  directly or round a longer circle, every import counted; the patches call FP8, never the reverse, and FP8 reads
  checkpoint formats, never the reverse; the flat core (``hf_openjev/*.py``) holds at most 20 modules;
- no folder imports a flat-core module that imports the folder (``packing`` never reads ``fast_options``, which
  reads the planner's defaults: the options are passed in);
- no function or method is over 80 lines (CONTRIBUTING "Where things go"), and no file of the package over 600;
- ``recipes/`` holds scripts and today's results, at most 0.6 MB that is not code (docs/design.md: raw campaign
  output does not stay in the tree); the inputs they read live in ``data/``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject's package-dir mapping)
SOURCES = {"hf_openjev": "hf_openjev", "ops": "hf_openjev.ops", "patches": "hf_openjev.patches"}
COMMANDS = ("hf_openjev.export", "hf_openjev.eval", "hf_openjev.serve", "hf_openjev.fidelity_check", "hf_openjev.demo")
COMMAND_LEVEL_CORE = {"hf_openjev.cli"}  # the command line, the one command module in the core folder
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600
# Functions over the cap today, "path:qualified name" (relative to the repository root); the list may only shrink.
LONG_FUNCTIONS: frozenset[str] = frozenset()


def module_files() -> dict[str, Path]:
    """``{installed module name: source file}`` for every module of the package."""
    out = {}
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that ``name`` imports anywhere in its file (a package's ``__init__`` counts as it)."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in known:  # ``from x import name`` where name is not a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as a list of modules, or None. A package's ``__init__`` is skipped as an importer of its
    own submodules (importing ``a.b`` runs ``a`` first anyway; a re-export is not a circle)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


MAX_FLAT_MODULES = 20
# (importer folder, imported folder) pairs that must never appear: the direction the code needs is the other one
FORBIDDEN_FOLDER_IMPORTS = (("hf_openjev.fp8", "hf_openjev.patches"), ("hf_openjev.checkpoint", "hf_openjev.fp8"))


def folder_of(name: str, packages: set[str]) -> str | None:
    """The subpackage (``hf_openjev.fp8``, ``hf_openjev.ops``, ...) that holds module ``name``; None for the flat
    core (``hf_openjev`` and its top-level modules)."""
    parts = name.split(".")
    folder = ".".join(parts[:2])
    return folder if len(parts) >= 2 and folder in packages else None


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``{folder: folders it imports}`` from a module graph, every import counted (function-local ones too)."""
    packages = {".".join(name.split(".")[:2]) for name in graph if name.count(".") >= 2}
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        here = folder_of(name, packages)
        if here is None:
            continue
        out.setdefault(here, set())
        out[here] |= {there for t in targets if (there := folder_of(t, packages)) not in (None, here)}
    return out


def test_no_circle_between_folders():
    folders = folder_graph(import_graph())
    cycle = find_cycle(folders)
    assert cycle is None, "folders import each other in a circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("importer, imported", FORBIDDEN_FOLDER_IMPORTS)
def test_folder_import_direction(importer, imported):
    bad = [f"{name} -> {t}" for name, targets in import_graph().items() if name.startswith(importer + ".")
           for t in targets if t == imported or t.startswith(imported + ".")]
    assert not bad, f"{importer} must not import {imported} (the other way round only): " + ", ".join(bad)


def back_up_arrows(graph: dict[str, set[str]]) -> list[str]:
    """``folder module -> core module`` imports where the flat-core module imports that folder itself: the folder
    sits below the module, so the arrow runs back up (``hf_openjev.packing.pack_context -> hf_openjev.fast_options``
    while ``fast_options`` reads the planner's defaults). The thing the folder needs belongs in the folder, or is
    passed in."""
    packages = {".".join(name.split(".")[:2]) for name in graph if name.count(".") >= 2}
    out = []
    for name, targets in graph.items():
        here = folder_of(name, packages)
        if here is None:
            continue
        out += [f"{name} -> {t}" for t in sorted(targets) if folder_of(t, packages) is None and t != "hf_openjev"
                and any(folder_of(u, packages) == here for u in graph.get(t, ()))]
    return out


def test_no_folder_imports_a_core_module_above_it():
    bad = back_up_arrows(import_graph())
    assert not bad, "a folder imports a core module that imports the folder (move what it needs down, or pass " \
                    "it in): " + ", ".join(bad)


def test_the_back_up_checker_sees_packing_reading_the_fast_options():
    graph = {"hf_openjev.fast_options": {"hf_openjev.packing.planner"}, "hf_openjev.packing.planner": set(),
             "hf_openjev.packing.pack_context": {"hf_openjev.fast_options", "hf_openjev.errors"},
             "hf_openjev.errors": set(), "hf_openjev.fp8.option": {"hf_openjev.errors"}}
    assert back_up_arrows(graph) == ["hf_openjev.packing.pack_context -> hf_openjev.fast_options"]


def test_the_folder_checker_sees_a_circle():
    graph = {"hf_openjev.a.x": {"hf_openjev.b.y"}, "hf_openjev.b.y": {"hf_openjev.c.z", "hf_openjev.errors"},
             "hf_openjev.c.z": {"hf_openjev.a"}, "hf_openjev.a": set(), "hf_openjev.errors": set()}
    folders = folder_graph(graph)
    assert folders == {"hf_openjev.a": {"hf_openjev.b"}, "hf_openjev.b": {"hf_openjev.c"},
                       "hf_openjev.c": {"hf_openjev.a"}}
    assert find_cycle(folders) == ["hf_openjev.a", "hf_openjev.b", "hf_openjev.c", "hf_openjev.a"]


def test_the_flat_core_is_small():
    flat = sorted(path.name for path in (ROOT / "hf_openjev").glob("*.py"))
    assert len(flat) <= MAX_FLAT_MODULES, f"{len(flat)} flat modules in hf_openjev/ (at most {MAX_FLAT_MODULES}: " \
                                          f"put command-only code in its command's folder): {flat}"


RECIPES_MAX_DATA_BYTES = 600_000


def test_recipes_hold_no_raw_runs():
    """Everything in ``recipes/`` but its code (results, RESULTS.md, tables) stays under 0.6 MB, and no data folder
    is back there: the benchmark's inputs and the oracles are ``data/bench/``'s."""
    files = [p for p in (ROOT / "recipes").rglob("*")
             if p.is_file() and p.suffix not in (".py", ".sh", ".pyc") and "__pycache__" not in p.parts]
    size = sum(p.stat().st_size for p in files)
    largest = sorted(files, key=lambda p: p.stat().st_size)[-3:]
    assert size <= RECIPES_MAX_DATA_BYTES, (
        f"recipes/ holds {size:,} bytes that are not code (at most {RECIPES_MAX_DATA_BYTES:,}): move raw runs out "
        f"of the tree and cite their commit in RESULTS.md; largest: {[str(p.relative_to(ROOT)) for p in largest]}")
    assert not (ROOT / "recipes" / "data").exists(), "inputs live in data/bench/, not recipes/data/"


def test_core_imports_no_command():
    bad = []
    for name, targets in import_graph().items():
        if name.startswith(COMMANDS) or name in COMMAND_LEVEL_CORE:
            continue
        bad += [f"{name} -> {t}" for t in targets if t.startswith(COMMANDS)]
    assert not bad, "core modules import command subpackages: " + ", ".join(bad)


def test_no_top_level_ops_or_patches_imports():
    bad = []
    for path in list(module_files().values()) + sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("ops", "patches")]
    assert not bad, bad


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``{qualified name: lines}`` of the functions and methods in ``path`` over ``limit`` lines (from ``def`` to
    their last line, docstring included, decorators not)."""
    found = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > limit:
                    found[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def test_no_function_over_the_line_cap():
    over = {f"{path.relative_to(ROOT).as_posix()}:{name}": lines for path in module_files().values()
            for name, lines in long_functions(path).items()}
    new = {name: lines for name, lines in over.items() if name not in LONG_FUNCTIONS}
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines (split them): {new}"
    gone = sorted(LONG_FUNCTIONS - set(over))
    assert not gone, f"now under the cap: take them off LONG_FUNCTIONS: {gone}"


def test_no_package_file_over_the_line_cap():
    over = {str(path.relative_to(ROOT)): n for path in module_files().values()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert not over, f"package files over {MAX_FILE_LINES} lines (split them by concept or layer): {over}"


def test_the_line_cap_checker_sees_nested_functions_and_methods(tmp_path):
    source = tmp_path / "long.py"
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    source.write_text(f"class A:\n    def method(self):\n{body}\n\n"
                      f"def outer():\n    def inner():\n{body}\n    return inner\n\n"
                      "def short():\n    return 1\n")
    assert long_functions(source) == {"A.method": 81, "outer": 83, "outer.inner": 81}


REFERENCES = ("hf_openjev.packing.naive_layout",)  # kept for tests and recipes; the package runs the fast one


def test_the_package_never_runs_a_reference():
    graph = import_graph()
    assert set(REFERENCES) <= set(graph), "a reference module is missing"
    bad = [f"{name} -> {t}" for name, targets in graph.items() for t in targets & set(REFERENCES)]
    assert not bad, "the package imports a reference kept for tests: " + ", ".join(bad)


def test_the_checker_sees_circles_and_command_imports():
    """The rules above can fail: a hand-made graph with a circle and a core -> command import is caught."""
    graph = {"hf_openjev.a": {"hf_openjev.b"}, "hf_openjev.b": {"hf_openjev.export.merge"},
             "hf_openjev.export.merge": {"hf_openjev.a"}}
    assert find_cycle(graph) == ["hf_openjev.a", "hf_openjev.b", "hf_openjev.export.merge", "hf_openjev.a"]
    assert find_cycle({"p": {"p.sub"}, "p.sub": {"p"}}) is None  # a package re-exporting its submodule
    tree = {"hf_openjev.x": ROOT / "hf_openjev" / "model.py"}
    assert "hf_openjev.checkpoint.files" in imports_of("hf_openjev.model", tree["hf_openjev.x"], set(module_files()))


@pytest.mark.parametrize("code", [
    "import hf_openjev, hf_openjev.packing.planner, hf_openjev.contract",
    "import hf_openjev.fp8.option, hf_openjev.checkpoint.fp8_scheme, hf_openjev.checkpoint",
    "import hf_openjev.tokenizer.prefix_cuts, hf_openjev.tokenizer.token_floor, hf_openjev.work_tokens",
    "from hf_openjev.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
])
def test_light_imports_load_no_torch(code):
    check = code + "\nimport sys\nheavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n" \
                   "assert not heavy, heavy"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT / "tests")
    assert result.returncode == 0, result.stderr


def test_pipeline_registers_when_transformers_loads():
    code = ("import hf_openjev\nfrom transformers import pipeline\n"
            "from transformers.pipelines import PIPELINE_REGISTRY\n"
            "assert PIPELINE_REGISTRY.supported_tasks['jev-decision']['impl'].__name__ == 'JevDecisionPipeline'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "tests")
    assert result.returncode == 0, result.stderr

"""The repository's own data (``data/`` at its root: JevBench with its licence) and the recipes loaded as modules.
Nothing here reads outside the checkout."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def repo_path(relative: str) -> Path:
    """``<repo>/<relative>``; a missing file is an error, never a skip."""
    path = REPO / relative
    if not path.exists():
        raise FileNotFoundError(f"{relative} is missing from the checkout at {REPO}; restore it with git")
    return path


JEVBENCH_EASY = repo_path("data/jevbench-sample/easy.jsonl")


def committed_oracle_path(shape: str) -> Path:
    """The committed fp32 oracle of a bench shape (``data/bench/oracle_<shape>.json.gz``, gzip-compressed JSON)."""
    return repo_path(f"data/bench/oracle_{shape}.json.gz")


def read_committed_oracle(shape: str) -> dict:
    """The committed oracle of ``shape``, read (and its format checked) by the package's own oracle reader."""
    from hf_openjev.fidelity_check.gate import load_oracle

    return load_oracle(committed_oracle_path(shape))


def load_recipe(name: str):
    """A script of ``recipes/`` imported as a module (they are scripts, not part of the package), with ``recipes/``
    on ``sys.path`` as ``python recipes/<name>.py`` has it, so that its ``benchlib`` imports resolve."""
    recipes = REPO / "recipes"
    if str(recipes) not in sys.path:
        sys.path.insert(0, str(recipes))
    path = recipes / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module

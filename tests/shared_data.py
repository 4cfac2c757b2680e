"""Where the project's shared data lies (a ``shared/`` copy inside the checkout, which device runs carry; else
``shared/`` beside the checkout, CI's layout; else /work/shared), and the recipes loaded as modules."""

import importlib.util
import sys
from pathlib import Path

_CANDIDATES = (Path(__file__).resolve().parents[1] / "shared", Path(__file__).resolve().parents[2] / "shared",
               Path("/work/shared"))


def shared_path(relative: str) -> Path:
    """The first existing ``<shared>/<relative>``; a missing file is an error, never a skip."""
    for root in _CANDIDATES:
        if (root / relative).exists():
            return root / relative
    raise FileNotFoundError(f"{relative} not found under {', '.join(map(str, _CANDIDATES))}")


JEVBENCH_EASY = shared_path("data/jevbench-sample/easy.jsonl")


def load_recipe(name: str):
    """A script of ``recipes/`` imported as a module (they are scripts, not part of the package), with ``recipes/``
    on ``sys.path`` as ``python recipes/<name>.py`` has it, so that its ``benchlib`` imports resolve."""
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    if str(recipes) not in sys.path:
        sys.path.insert(0, str(recipes))
    path = recipes / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module

"""Registering ``pipeline("jev-decision")`` without importing torch at ``import hf_openjev``.

Registering needs ``transformers.pipelines``, which imports torch (seconds). ``import hf_openjev`` must stay cheap
(``hf-openjev --help``, the planner), so the registration runs right after Transformers loads its pipelines:
at once if they are already loaded, otherwise from an import hook that fires once and removes itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_PIPELINES = "transformers.pipelines"


def register_when_transformers_loads() -> None:
    """Register ``jev-decision`` now if Transformers' pipelines are loaded, else as soon as they load."""
    if _PIPELINES in sys.modules:
        from .pipeline import register_pipeline

        register_pipeline()
    elif not any(isinstance(finder, _PipelinesHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PipelinesHook())


class _PipelinesHook(importlib.abc.MetaPathFinder):
    """Finds ``transformers.pipelines`` through the other finders and registers the pipeline once it has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _PIPELINES:
            return None
        sys.meta_path.remove(self)  # once: the lookup below (and every later import) goes to the other finders
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            from .pipeline import register_pipeline

            register_pipeline()

        spec.loader.exec_module = exec_then_register
        return spec

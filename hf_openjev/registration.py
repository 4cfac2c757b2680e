"""Registering ``pipeline("jev-decision")`` without importing torch at ``import hf_openjev``.

Registering needs ``transformers.pipelines``, which imports torch (seconds). ``import hf_openjev`` must stay cheap
(``hf-openjev --help``, the planner), so the registration runs right after Transformers loads its pipelines:
at once if they are already loaded, otherwise from an import hook that fires once and removes itself.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys

_PIPELINES = "transformers.pipelines"
_TASK = "jev-decision"


def register_when_transformers_loads() -> None:
    """Register ``jev-decision`` now if Transformers' pipelines are loaded, else as soon as they load."""
    if _PIPELINES in sys.modules:
        from .pipeline import register_pipeline

        register_pipeline()
        check_paths_before_transformers()
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
            check_paths_before_transformers()
            own = sys.modules.get(f"{__package__}.pipeline")
            if own is not None and not hasattr(own, "register_pipeline"):
                return  # ``import hf_openjev.pipeline`` is loading Transformers' pipelines: it registers at its end
            from .pipeline import register_pipeline

            register_pipeline()

        spec.loader.exec_module = exec_then_register
        return spec


def check_paths_before_transformers() -> None:
    """Make ``pipeline("jev-decision", model=PATH, device=...)`` check PATH and the device before Transformers.

    Transformers' ``pipeline()`` resolves a string model through the Hub client and ``AutoConfig`` before the
    pipeline class sees it, so a mistyped path ended in "Repo id must be in the form ..." and a published package
    in "Unrecognized model ... model_type". This wraps ``transformers.pipelines.pipeline`` (once; idempotent) so that,
    for this task only, :func:`hf_openjev.devices.check_device` and
    :func:`hf_openjev.checkpoint.manifest.check_export_dir` (the check ``eval`` and ``serve`` use) run first and raise
    their one-line ``ValueError``; ``allow_unknown_shape=True`` goes to the loader (``model_kwargs``,
    :mod:`hf_openjev.family`); every other task goes straight to Transformers. ``from transformers import pipeline``
    done before ``import hf_openjev`` keeps the unwrapped function (the pipeline class still checks the device).
    """
    import transformers.pipelines as pipelines

    original = pipelines.pipeline
    if getattr(original, "_hf_openjev_checks", False):
        return

    @functools.wraps(original)
    def pipeline(task=None, model=None, *args, **kwargs):
        if task == _TASK:
            from .checkpoint.manifest import check_export_dir
            from .devices import check_device

            check_device(kwargs.get("device"))
            if isinstance(model, (str, os.PathLike)):
                check_export_dir(model)
            if "allow_unknown_shape" in kwargs:  # a loader option: it reaches JevModel.from_pretrained
                kwargs["model_kwargs"] = {**(kwargs.get("model_kwargs") or {}),
                                          "allow_unknown_shape": kwargs.pop("allow_unknown_shape")}
        return original(task, model, *args, **kwargs)

    pipeline._hf_openjev_checks = True
    pipelines.pipeline = pipeline
    top = sys.modules.get("transformers")
    if top is not None and top.__dict__.get("pipeline") is original:  # already resolved by the lazy module
        top.pipeline = pipeline

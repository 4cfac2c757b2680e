"""hf_openjev: serve Open-Jev decision models with Hugging Face Transformers.

Importing the package registers ``pipeline("jev-decision")`` with Transformers (as soon as Transformers loads its
pipelines: ``import hf_openjev`` itself imports neither torch nor Transformers). The model-facing names below load
on first use.
"""

from .errors import CheckpointError, InferenceError, RequestError, UsageError
from .registration import register_when_transformers_loads

__version__ = "0.1.0"
_LAZY = {"JevModel": "model", "load_export": "model", "load_reference": "model",
         "JevDecisionPipeline": "pipeline", "register_pipeline": "pipeline", "FastPathOptions": "fast_options"}
__all__ = ["CheckpointError", "InferenceError", "RequestError", "UsageError", *sorted(_LAZY), "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'hf_openjev' has no attribute {name!r}")


register_when_transformers_loads()

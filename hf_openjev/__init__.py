"""hf_openjev: serve Open-Jev decision models with Hugging Face Transformers.

Importing the package registers ``pipeline("jev-decision")`` with Transformers.
"""

from .errors import CheckpointError, InferenceError, RequestError
from .model import JevModel, load_export, load_reference
from .pipeline import JevDecisionPipeline, register_pipeline

__version__ = "0.1.0"
__all__ = ["CheckpointError", "InferenceError", "JevDecisionPipeline", "JevModel", "RequestError", "load_export",
           "load_reference", "register_pipeline", "__version__"]

register_pipeline()

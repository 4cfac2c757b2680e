"""``pipeline("jev-decision")``: the Transformers Pipeline over the contract and the scorer.

```python
import hf_openjev
from transformers import pipeline

jev = pipeline("jev-decision", model="path/to/export", device="cuda", dtype="bfloat16")
jev({"state": "...", "questions": {"q": {"type": "noul", "instructions": "..."}}})
```
"""

from __future__ import annotations

from transformers import Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from .model import JevModel, load_export, resolve_dtype
from .scoring import build_answer, prepare_request, score_prepared, use_fast_path

TASK = "jev-decision"


def _checked_int(name: str, value, minimum: int) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; else a ValueError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "a non-negative integer (0: never)"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value


class JevDecisionPipeline(Pipeline):
    """One request dict -> one response dict (contract §6); a list of requests -> a list of responses.

    Call options: ``fast`` (None: the fast path on CUDA, the reference path elsewhere), ``batch_size`` (candidates
    per reference forward, default 32), and three fast-path options: ``share_tails`` (True: common prefixes are
    shared exactly, not only up to their last multiple of 64 tokens; default False), ``min_shared_tokens`` (the
    shortest prefix worth sharing; default 64, 16 measured best with ``share_tails``) and ``dense_attention_tokens``
    (a pack level of one sequence at least this long, with no prefix, runs its attention as one dense causal call,
    cuDNN on CUDA; default 2048, 0: never). The reference path ignores all three. Invalid requests raise
    ``hf_openjev.RequestError`` before any model work; with a list, every request is validated before the first
    one runs.
    """

    _load_tokenizer = False
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_video_processor = False

    def __init__(self, model, *args, dtype=None, batch_size=None, **kwargs):
        # ``batch_size`` is the reference path's candidates per forward, not Transformers' input batching
        # (which needs a tokenizer-collated model): keep it away from the base class.
        self._reference_batch_size = batch_size
        if not isinstance(model, JevModel):
            source = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
            if not source:
                raise TypeError("jev-decision needs a merged export directory or a hf_openjev.JevModel")
            model = load_export(source, dtype=dtype)  # re-raises the real CheckpointError if the export is bad
        elif dtype is not None and dtype != "auto":
            model.backbone.to(resolve_dtype(dtype))  # in place: a loaded model is not copied
        kwargs.pop("torch_dtype", None)
        super().__init__(model, *args, **kwargs)

    def _sanitize_parameters(self, fast=None, reference_batch_size=None, share_tails=None, min_shared_tokens=None,
                             dense_attention_tokens=None, **unknown):
        if unknown:
            raise TypeError(f"unknown jev-decision option(s): {', '.join(sorted(unknown))}")
        forward = {"fast": fast, "fast_options": {}}
        if share_tails is not None:
            if not isinstance(share_tails, bool):
                raise ValueError(f"share_tails must be True or False, got {share_tails!r}")
            forward["fast_options"]["share_tails"] = share_tails
        if min_shared_tokens is not None:
            forward["fast_options"]["min_shared_tokens"] = _checked_int("min_shared_tokens", min_shared_tokens, 1)
        if dense_attention_tokens is not None:
            forward["fast_options"]["dense_attention_tokens"] = _checked_int(
                "dense_attention_tokens", dense_attention_tokens, 0)
        batch = reference_batch_size or getattr(self, "_reference_batch_size", None)
        if batch is not None:
            forward["reference_batch_size"] = _checked_int("batch_size", batch, 1)
        return {}, forward, {}

    def __call__(self, inputs, **kwargs):
        if "batch_size" in kwargs:
            kwargs["reference_batch_size"] = kwargs.pop("batch_size")
        if isinstance(inputs, list):
            if not inputs:
                return []
            for request in inputs:  # fail before doing work: validate every request first
                prepare_request(self.model, request)
        return super().__call__(inputs, **kwargs)

    def preprocess(self, request):
        return prepare_request(self.model, request)

    def _forward(self, prepared, fast=None, reference_batch_size=32, fast_options=None):
        result = score_prepared(self.model, [prepared], fast=fast, batch_size=reference_batch_size,
                                **(fast_options or {}))
        method = "fast" if use_fast_path(self.model, fast) else "reference"
        return {"prepared": prepared, "scores": result.scores[0], "seconds": result.seconds,
                "prefix_cache": result.prefix_cache[0], "method": method}

    def postprocess(self, output):
        return build_answer(self.model, output["prepared"], output["scores"], seconds=output["seconds"],
                            prefix_cache=output["prefix_cache"], method=output["method"])


def register_pipeline() -> None:
    """Register ``jev-decision`` with Transformers (idempotent: re-registering replaces the same entry)."""
    if TASK in PIPELINE_REGISTRY.supported_tasks and PIPELINE_REGISTRY.supported_tasks[TASK]["impl"] is JevDecisionPipeline:
        return
    PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=JevDecisionPipeline, pt_model=JevModel, type="text")

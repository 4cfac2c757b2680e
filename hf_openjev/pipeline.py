"""``pipeline("jev-decision")``: the Transformers Pipeline over the contract and the scorer.

```python
import hf_openjev
from transformers import pipeline

jev = pipeline("jev-decision", model="path/to/export", device="cuda", dtype="bfloat16")
jev({"state": "...", "questions": {"q": {"type": "noul", "instructions": "..."}}})
```
"""

from __future__ import annotations

import torch
from transformers import Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from .dtypes import resolve_dtype
from .fast_options import FastPathOptions, check_int
from .model import JevModel, load_export
from .scoring import build_answer, prepare_path, prepare_request, prepare_requests, score_prepared, use_fast_path
from .work_tokens import DEFAULT_BATCH_TOKENS, split_by_tokens, task_cost

TASK = "jev-decision"
DEFAULT_INPUTS_PER_BATCH = 16  # requests per scoring call for a list, as hf-openjev eval's default


class JevDecisionPipeline(Pipeline):
    """One request dict -> one response dict (docs/contract.md §6); a list of requests -> a list of responses.

    ``batch_size`` is inputs per batch (default 16): on the fast path a list is scored ``batch_size`` requests at a
    time, each batch ONE fast-path plan whose packs and shared prefixes span its requests (as ``hf-openjev eval``
    and the server batch), so three requests cost about one call, not three; answers are the same as one at a time
    up to floating-point rounding of differently shaped kernels. On the reference path each request runs its own
    right-padded forwards of ``reference_batch_size`` candidates (default: ``batch_size`` when it is given, else
    32: the meaning ``batch_size`` had before, so reference answers do not change).

    Options, at construction or per call: ``fast`` (None: the fast path on CUDA, the reference path elsewhere),
    ``batch_size`` and ``reference_batch_size`` (above), ``fast_options`` (a
    :class:`~hf_openjev.fast_options.FastPathOptions`) and any of its option names, which change the model's defaults
    (a 2B's own: every candidate alone with dense attention, :data:`~hf_openjev.fast_options.MEMBER_DEFAULTS`;
    the package's elsewhere) only where named, e.g. ``share_tails`` (default
    True: common prefixes are shared exactly; False: only up to their last multiple of 64 tokens),
    ``min_shared_tokens`` (the shortest prefix worth sharing; default 16, 64 suits ``share_tails=False``) or
    ``dense_attention_tokens`` (a pack level of one sequence at least this long, with no prefix, runs its attention
    as one dense causal call, cuDNN on CUDA; default 2048, 0: never); names given per call change the pipeline's
    options for that call, except ``fp8``, which only construction sets: it swaps the model's projections for good.
    The reference path ignores the fast-path options. Invalid options raise ValueError and invalid requests
    ``hf_openjev.RequestError``, before any model work; with a list, every request is validated before the first
    one runs.

    ``fp8`` (``"all"`` / ``"no-gdn"``: FP8 projections) is opt-in: it about halves the weights and is faster than
    the bf16 fast path, but it does not pass the fidelity gate against the fp32 oracle (its decisions move far
    more than stock bf16's; figures in recipes/RESULTS.md). A pipeline for the fast path given a model on the CPU
    swaps its projections there, before moving it to its device, so the device never holds the bf16 weights.

    Constructing the pipeline for the fast path (on CUDA, or anywhere with ``fast=True``) patches the given model
    in place (:func:`hf_openjev.patches.apply_patches` with the pipeline's options; revertible with
    :func:`hf_openjev.patches.revert_patches`, except FP8). A pipeline constructed for the reference path runs the
    fast path per call (``fast=True``) only on a model already patched.
    """

    _load_tokenizer = False
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_video_processor = False

    def __init__(self, model, *args, dtype=None, batch_size=None, reference_batch_size=None, **kwargs):
        # ``batch_size`` batches inputs here (one scoring call per batch), not through Transformers' collating
        # DataLoader (which needs a tokenizer-collated model): keep it away from the base class.
        from .devices import check_device

        check_device(kwargs.get("device"))  # a CUDA device without CUDA: one clear ValueError, not torch's assert
        if dtype is not None and dtype != "auto":
            resolve_dtype(dtype)  # a bad name ("bf16"): one line, before anything loads
        self._inputs_per_batch = None if batch_size is None else check_int("batch_size", batch_size, 1)
        self._reference_batch_size = (None if reference_batch_size is None else
                                      check_int("reference_batch_size", reference_batch_size, 1))
        if not isinstance(model, JevModel):
            source = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
            if not source:
                raise TypeError("jev-decision needs a merged export directory or a hf_openjev.JevModel")
            model = load_export(source, dtype=dtype)  # re-raises the real CheckpointError if the export is bad
        elif dtype is not None and dtype != "auto":
            model.backbone.to(resolve_dtype(dtype))  # in place: a loaded model is not copied
        kwargs.pop("torch_dtype", None)
        _prepare_fp8_before_moving(model, kwargs)
        super().__init__(model, *args, **kwargs)  # moves the model to the pipeline's device

    def _sanitize_parameters(self, fast=None, reference_batch_size=None, fast_options=None, **named):
        unknown = sorted(set(named) - set(FastPathOptions.names()))
        if unknown:
            raise TypeError(f"unknown jev-decision option(s): {', '.join(unknown)}")
        if fast_options is not None and not isinstance(fast_options, FastPathOptions):
            raise TypeError(f"fast_options must be a hf_openjev.fast_options.FastPathOptions, got {fast_options!r}")
        forward = {} if fast is None else {"fast": fast}
        if not hasattr(self, "_forward_params"):  # construction (Pipeline.__init__ calls this once, before any call)
            from .patches import read_options

            self._fast_options = (fast_options or read_options(self.model)).replace(**named)
            prepare_path(self.model, fast, self._fast_options)  # the fast path patches the model here, never later
        elif fast_options is not None or named:  # a bad value: ValueError naming the option, before model work
            forward["options"] = (fast_options or self._fast_options).replace(**named)
            if forward["options"].fp8 != self._fast_options.fp8:
                raise ValueError(f"fp8 is chosen when the pipeline is constructed (it swaps the model's projections "
                                 f"for good), not per call: this one runs fp8={self._fast_options.fp8!r}")
        batch = reference_batch_size or getattr(self, "_reference_batch_size", None)
        if batch is not None:
            forward["reference_batch_size"] = check_int("reference_batch_size", batch, 1)
        return {}, forward, {}

    def __call__(self, inputs, **kwargs):
        batch = kwargs.pop("batch_size", None)
        batch = self._inputs_per_batch if batch is None else check_int("batch_size", batch, 1)
        reference = kwargs.pop("reference_batch_size", None) or self._reference_batch_size or batch
        if reference is not None:  # batch_size alone: also the reference forward's size, as before
            kwargs["reference_batch_size"] = reference
        if not isinstance(inputs, list):
            return super().__call__(inputs, **kwargs)
        if not inputs:
            return []
        _, forward, _ = self._sanitize_parameters(**kwargs)
        forward = {**self._forward_params, **forward}  # the construction's options, as Pipeline.__call__ merges them
        return self._answer_list(inputs, batch or DEFAULT_INPUTS_PER_BATCH, **forward)

    def _answer_list(self, inputs: list, per_batch: int, fast=None, reference_batch_size=32, options=None) -> list:
        """Every request validated first (the first invalid one named by its index), then scored: on the fast path
        at most ``per_batch`` requests and :data:`~hf_openjev.work_tokens.DEFAULT_BATCH_TOKENS` tokens (a bigger
        request alone) per :func:`~hf_openjev.scoring.score_prepared` call (one plan), on the reference path one
        request per call (its own padded forwards, bounded by tokens, whatever its company)."""
        prepared = prepare_requests(self.model, inputs)
        if not use_fast_path(self.model, fast):
            per_batch = 1
        answers = []
        with torch.no_grad():
            for chunk in split_by_tokens(prepared, lambda p: task_cost(p, "fast"), max_items=per_batch,
                                         max_tokens=DEFAULT_BATCH_TOKENS):
                result = score_prepared(self.model, chunk, fast=fast, batch_size=reference_batch_size,
                                        options=options or self._fast_options)
                answers.extend(build_answer(self.model, p, s, seconds=result.seconds, prefix_cache=c,
                                            method=result.path)
                               for p, s, c in zip(chunk, result.scores, result.prefix_cache))
        return answers

    def save_pretrained(self, save_directory, **kwargs):
        """Write the merged export this pipeline's model was loaded from to ``save_directory`` (a new or empty
        directory), loadable with ``pipeline("jev-decision", model=save_directory)``: see
        :mod:`hf_openjev.save_export` (checked before writing; never a partial directory)."""
        from .checkpoint.save_export import save_export_copy

        return save_export_copy(self.model, save_directory)

    def preprocess(self, request):
        return prepare_request(self.model, request)

    def _forward(self, prepared, fast=None, reference_batch_size=32, options=None):
        result = score_prepared(self.model, [prepared], fast=fast, batch_size=reference_batch_size,
                                options=options or self._fast_options)
        return {"prepared": prepared, "scores": result.scores[0], "seconds": result.seconds,
                "prefix_cache": result.prefix_cache[0], "method": result.path}

    def postprocess(self, output):
        return build_answer(self.model, output["prepared"], output["scores"], seconds=output["seconds"],
                            prefix_cache=output["prefix_cache"], method=output["method"])


def _prepare_fp8_before_moving(model: JevModel, kwargs: dict) -> None:
    """When the pipeline's ``fp8`` (or ``fast_options.fp8``) is on, the pipeline will run the fast path and
    ``model`` is still on the CPU: swap its projections for ``Fp8Linear`` there (each bf16 weight freed as its FP8
    module takes its place), so that ``Pipeline.__init__`` moves only the FP8 model to the device. Anything else is
    left to ``_sanitize_parameters`` (which validates the options and patches the model on its device)."""
    fast_options = kwargs.get("fast_options")
    fp8 = kwargs.get("fp8", fast_options.fp8 if isinstance(fast_options, FastPathOptions) else "off")
    fp8 = FastPathOptions(fp8=fp8).fp8  # a bad mode: ValueError naming the option, before any work
    if fp8 == "off" or model.device.type != "cpu":
        return
    fast = kwargs.get("fast")
    if fast is False or (fast is None and _pipeline_device(kwargs.get("device")).type != "cuda"):
        return  # the reference path: fp8 does not apply
    from .fp8.prepare import prepare_model_for_fp8

    prepare_model_for_fp8(model, fp8)


def _pipeline_device(device) -> torch.device:
    """The device ``Pipeline.__init__`` puts the model on, for the devices this project runs on (CPU, CUDA):
    None and a GPU ordinal mean CUDA when it is available (Transformers' ``device=0`` default), -1 the CPU."""
    if device is None:
        device = 0
    if isinstance(device, int):
        return torch.device(f"cuda:{device}") if device >= 0 and torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


class _TaskEntry(dict):
    """The registry's entry for ``jev-decision``: it has no default model, and asking for one (``pipeline(TASK)``
    without ``model=``) is a one-line UsageError instead of Transformers' bare ``KeyError: 'default'``."""

    def __missing__(self, key):
        if key == "default":
            from .errors import UsageError

            raise UsageError(f'{TASK} has no default model: pass model=, a merged export directory or a '
                             f'hf_openjev.JevModel (pipeline("{TASK}", model="path/to/export"))')
        raise KeyError(key)


def register_pipeline() -> None:
    """Register ``jev-decision`` with Transformers (idempotent: re-registering replaces the same entry)."""
    entry = PIPELINE_REGISTRY.supported_tasks.get(TASK)
    if isinstance(entry, _TaskEntry) and entry["impl"] is JevDecisionPipeline:
        return
    PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=JevDecisionPipeline, pt_model=JevModel, type="text")
    PIPELINE_REGISTRY.supported_tasks[TASK] = _TaskEntry(PIPELINE_REGISTRY.supported_tasks[TASK])


register_pipeline()  # importing this module loads Transformers' pipelines: the task is registered with it

"""From request dicts to response dicts: validate, tokenize, score (reference or fast path), answer.

The steps are split so that the pipeline, the evaluation command and the server (which batches several
requests into one forward) share them:

``prepare_request`` (validation + tokenization, no model work) -> ``score_prepared`` (one forward plan over
one or many prepared requests) -> ``build_answer`` (docs/contract.md §5/§6).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from .contract import ParsedRequest, answers_from_scores, build_response, parse_request, tokenize_candidates
from .errors import InferenceError


@dataclass
class PreparedRequest:
    """A validated request with every candidate tokenized (``chat_prefix + prompt + chat_suffix``)."""

    parsed: ParsedRequest
    tokens: list[list[list[int]]]  # [question][candidate] -> token ids

    @property
    def input_tokens(self) -> int:
        return sum(len(seq) for question in self.tokens for seq in question)

    @property
    def sequences(self) -> list[list[int]]:
        return [seq for question in self.tokens for seq in question]


@dataclass
class ScoreResult:
    scores: list[list[list[float]]]  # per request, per question, per candidate
    seconds: float
    path: Literal["fast", "reference"]  # the path that ran (the response's metadata.method)
    prefix_cache: list[dict] = field(default_factory=list)  # per request


def prepare_request(model, request) -> PreparedRequest:
    """docs/contract.md §2 items 2..7: raises ``RequestError`` before any model work."""
    return tokenize_request(model, parse_request(request, served_models=model.served_model_names))


def tokenize_request(model, parsed: ParsedRequest, *, max_total_tokens: int | None = None, fast: bool | None = None,
                     options=None) -> PreparedRequest:
    """docs/contract.md §2 item 7 for a validated request: every candidate tokenized, or ``RequestError`` for the first one
    over ``model.max_length``. Over-long texts stop at a clean prefix already over the limit where the model's
    tokenizer allows it (:func:`hf_openjev.tokenizer.tokenizer_analysis.prove_clean_cuts`); the verdict and the token counts of
    accepted requests are those of full tokenization; texts without clean cuts are bounded from their bytes
    (:mod:`hf_openjev.tokenizer.token_floor`). Where that tokenizer's clean cuts split its ids
    (:func:`hf_openjev.tokenizer.tokenizer_analysis.prove_clean_splits`), the request's shared text (the chat prefix,
    the state) is tokenized once, not once per candidate, with the same ids. ``max_total_tokens``: the request's
    token budget, counted as the work of the path that will score it (``fast``, :func:`use_fast_path`; on the fast path with ``options``' prefix sharing,
    each shared prefix once: :func:`hf_openjev.work_tokens.count_work_tokens`); 413 past it, tokenization stopped
    as soon as a lower bound of that work is past it (:func:`~hf_openjev.contract.tokenize_candidates`)."""
    own = _own_tokenizer(model)
    shares = max_total_tokens is not None and _shares_prefixes(model, fast, options)
    tokens = tokenize_candidates(parsed, model.encode, chat_prefix=model.chat_prefix,
                                 chat_suffix=model.chat_suffix, max_length=model.max_length,
                                 clean_cut=_clean_cut_for(model) if own else None,
                                 token_floor=_token_floor_for(model) if own else None,
                                 max_total_tokens=max_total_tokens, shares_prefixes=shares,
                                 split_shared=own and _splits_for(model), encode_many=model.encode_many if own else None)
    if shares:  # the floor let it through; the plan's exact count decides
        from .contract import token_budget_error
        from .work_tokens import count_work_tokens

        work = count_work_tokens(tokens, fast=True, options=_path_options(model, options))
        if work > max_total_tokens:
            raise token_budget_error(work, max_total_tokens, shared_once=True)
    return PreparedRequest(parsed, tokens)


def _shares_prefixes(model, fast: bool | None, options) -> bool:
    """Whether the path ``fast`` selects computes shared prefixes once (the fast path with ``shared_prefix`` on)."""
    device = getattr(model, "device", None)
    if fast is None and device is None:  # a stand-in without a device: the reference path
        return False
    return use_fast_path(model, fast) and _path_options(model, options).shared_prefix


def _path_options(model, options):
    """``options``, else the options the model is patched with, else the defaults."""
    if options is not None:
        return options
    from .patches import read_options

    return read_options(model)


def _own_tokenizer(model) -> bool:
    """Whether ``model.encode`` is :class:`~hf_openjev.model.JevModel`'s own (its tokenizer, no special tokens);
    a stand-in's ``encode`` is tokenized in full."""
    from .model import JevModel

    return isinstance(model, JevModel) and "encode" not in vars(model) and type(model).encode is JevModel.encode


def _clean_cut_for(model):
    """The model's clean-cut finder (:func:`hf_openjev.tokenizer.tokenizer_analysis.prove_clean_cuts`), or None."""
    from .tokenizer.tokenizer_analysis import prove_clean_cuts

    return prove_clean_cuts(model.tokenizer) if _own_tokenizer(model) else None


def _token_floor_for(model):
    """The model's byte-level token floor (:func:`hf_openjev.tokenizer.tokenizer_analysis.prove_token_floor`), or None."""
    from .tokenizer.tokenizer_analysis import prove_token_floor

    return prove_token_floor(model.tokenizer) if _own_tokenizer(model) else None


def _splits_for(model) -> bool:
    """Whether the model's tokenizer splits at clean cuts
    (:func:`hf_openjev.tokenizer.tokenizer_analysis.prove_clean_splits`); a stand-in's ``encode``: False."""
    from .tokenizer.tokenizer_analysis import prove_clean_splits

    return _own_tokenizer(model) and prove_clean_splits(model.tokenizer)


def prove_tokenizer_shortcuts(model) -> None:
    """Run (and cache) the proofs behind :func:`tokenize_request`'s shortcuts (the clean cuts, the byte floor for
    over-long texts, and the clean splits that tokenize a request's shared text once) now rather than on the first
    request, which would otherwise wait for them: a few seconds with the real Qwen3.5 tokenizer the first time (recipes/RESULTS.md), then read from the disk cache
    (:mod:`hf_openjev.tokenizer.tokenizer_analysis`). A stand-in's ``encode`` has none: nothing to do."""
    if _own_tokenizer(model):
        _clean_cut_for(model)
        _token_floor_for(model)
        _splits_for(model)


def use_fast_path(model, fast: bool | None) -> bool:
    """Whether ``fast`` means the fast path for ``model``: ``None`` is the fast path on CUDA, the reference path
    elsewhere. The one rule: :func:`score_prepared` applies it to every call (its ``ScoreResult.path`` says what
    ran), and :func:`prepare_path` when a model is set up."""
    if fast is None:
        return model.device.type == "cuda"
    return bool(fast)


def prepare_requests(model, requests: Sequence) -> list[PreparedRequest]:
    """:func:`prepare_request` of every request of a list, in order; the first invalid one raises its
    ``RequestError`` naming its index (``request [i]``), before any model work."""
    from .errors import RequestError, name_list_item

    prepared = []
    for index, request in enumerate(requests):
        try:
            prepared.append(prepare_request(model, request))
        except RequestError as exc:
            raise name_list_item(exc, index) from None
    return prepared


def prepare_path(model, fast: bool | None = None, options=None) -> str:
    """Set ``model`` up for the path that ``fast`` selects and return it (``"fast"`` or ``"reference"``): for the
    fast path, :func:`~hf_openjev.patches.apply_patches` with ``options`` (a
    :class:`~hf_openjev.fast_options.FastPathOptions`; default: the options the model is patched with, else the
    defaults), in place."""
    if not use_fast_path(model, fast):
        return "reference"
    from .patches import apply_patches, read_options

    apply_patches(model, options if options is not None else read_options(model))
    return "fast"


def score_prepared(model, prepared: Sequence[PreparedRequest], *, fast: bool | None = None,
                   batch_size: int = 32, options=None, batch_tokens: int | None = None) -> ScoreResult:
    """Score every candidate of every prepared request; failures become ``InferenceError``.

    ``fast``: see :func:`use_fast_path`; the fast path needs a model set up by
    :func:`~hf_openjev.patches.apply_patches` (else a RuntimeError naming it, before any work) and runs with
    ``options`` (a :class:`~hf_openjev.fast_options.FastPathOptions`; default: the ones the model was patched
    with). ``batch_size``: candidates per reference forward; ``batch_tokens``: the padded size of one reference
    forward (default :data:`hf_openjev.work_tokens.DEFAULT_BATCH_TOKENS`). The reference path ignores
    ``options``, the fast path ``batch_size`` and ``batch_tokens`` (its callers bound what they give it)."""
    from .reference import score_reference
    from .work_tokens import DEFAULT_BATCH_TOKENS

    path = "fast" if use_fast_path(model, fast) else "reference"
    if path == "fast":
        from .fast_path import score_fast
        from .patches import require_patches

        require_patches(model)  # a set-up error, not an inference failure
    start = time.perf_counter()
    try:
        if path == "fast":
            flat, caches = score_fast(model, [p.tokens for p in prepared], options)
        else:
            sequences = [seq for p in prepared for seq in p.sequences]
            flat = score_reference(model, sequences, batch_size=batch_size,
                                   max_batch_tokens=batch_tokens or DEFAULT_BATCH_TOKENS)
            caches = [{"enabled": False, "mode": "none", "shared_tokens": 0} for _ in prepared]
        if not all(math.isfinite(s) for s in flat):
            raise InferenceError("the model produced a non-finite score")
    except InferenceError:
        raise
    except Exception as exc:  # docs/contract.md §2: any failure inside inference is a 500
        raise InferenceError(f"model inference failed: {exc}") from exc
    seconds = time.perf_counter() - start
    it = iter(flat)
    nested = [[[next(it) for _ in question] for question in p.tokens] for p in prepared]
    return ScoreResult(nested, seconds, path, caches)


def build_answer(model, prepared: PreparedRequest, scores: list[list[float]], *, seconds: float,
                 prefix_cache: dict, method: str, extra_metadata: dict | None = None) -> dict:
    """The response dict (docs/contract.md §6)."""
    answers = answers_from_scores(prepared.parsed, scores, model.temperature)
    metadata = {
        "method": method,
        "temperature": model.temperature,
        "candidate_sequences": prepared.parsed.candidate_count,
        "inference_seconds": seconds,
        "max_length": model.max_length,
        "base_revision": model.manifest.base_revision,
        "prefix_cache": prefix_cache,
    }
    if extra_metadata:
        metadata.update(extra_metadata)
    return build_response(model_id=model.model_id, answers=answers, input_tokens=prepared.input_tokens,
                          metadata=metadata)


def answer_requests(model, requests: Sequence, *, fast: bool | None = None, batch_size: int = 32,
                    options=None) -> list[dict]:
    """Validate all requests first (nothing runs if one is invalid), then score them together and answer
    (``fast``, ``batch_size``, ``options``: as :func:`score_prepared`)."""
    prepared = prepare_requests(model, requests)
    result = score_prepared(model, prepared, fast=fast, batch_size=batch_size, options=options)
    return [build_answer(model, p, s, seconds=result.seconds, prefix_cache=c, method=result.path)
            for p, s, c in zip(prepared, result.scores, result.prefix_cache)]

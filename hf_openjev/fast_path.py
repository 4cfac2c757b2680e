"""The fast path: plan (prefix tree + packs), run each pack through the patched backbone, head in fp32.

``score_fast(model, requests_tokens, options)`` scores ``requests_tokens[r][q][c]`` (token ids) and returns the flat
scores in request/question/candidate order plus one ``prefix_cache`` report per request. The model must have been
set up with :func:`~hf_openjev.patches.apply_patches`. On CUDA (``cuda_graphs``, on by default) every pack that
``graph_ready`` accepts (at most ``graph_tokens``, no prefix state handed on or received) is padded to its shape
bucket (the fixed token steps, or with ``measured_buckets`` the record's ``buckets``: the model shape's measured GEMM
cost table, :mod:`.packing.bucket_policy`) and replayed from the record's graph cache; other packs run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .family import text_model_of
from .fast_options import FastPathOptions
from .packing.pack_context import build_pack_context
from .packing.planner import plan_with_options
from .patches.cuda_graphs import graph_ready
from .patches.record import require_patches


@torch.inference_mode()  # no autograd dispatch keys: less host time per op call (recipes/RESULTS.md s28)
def score_fast(model, requests_tokens: Sequence[Sequence[Sequence[Sequence[int]]]],
               options: FastPathOptions | None = None) -> tuple[list[float], list[dict]]:
    """Score every candidate with the patched backbone.

    ``options``: the :class:`~hf_openjev.fast_options.FastPathOptions` of this call (default: the ones the model
    was patched with; its ``fp8`` must be the model's). A model that :func:`~hf_openjev.patches.apply_patches` has
    not set up is refused (RuntimeError). Packs replay CUDA graphs when ``options.cuda_graphs`` is on and the
    record holds a graph cache (``apply_patches`` creates it on a CUDA model). Inside
    :func:`~hf_openjev.patches.warming_up` nothing is answered: every score is 0.0."""
    record = require_patches(model)
    options = options if options is not None else record.options
    if options.fp8 != record.options.fp8:  # the modules are what apply_patches made them; a call cannot change them
        raise ValueError(f"fp8={options.fp8!r} for one call on a model set up with fp8={record.options.fp8!r}: FP8 is "
                         "chosen when the model is set up (apply_patches), not per call")
    plan = plan_with_options(requests_tokens, options)
    text_model = text_model_of(model)
    graphs = record.graphs if options.cuda_graphs else None
    buckets = record.buckets if options.measured_buckets else None  # None: the fixed token steps
    remaining_children: dict[int, int] = {}
    for pack in plan.packs:
        for seg in pack.external:
            remaining_children[seg] = remaining_children.get(seg, 0) + 1
    store = {}
    pack_scores: list[torch.Tensor] = []  # per pack with scored rows: [N] fp32, still on the device
    leaf_index: dict[int, int] = {}  # scored segment id -> its index in the packs' scores, concatenated
    for pack in plan.packs:
        graphed = graphs is not None and graph_ready(plan, pack, options.graph_tokens)
        ctx = build_pack_context(plan, pack, store, model.device, options, pad=graphed, buckets=buckets)
        if graphed:
            rows = graphs.run(ctx)[: len(ctx.leaf_ids)]  # a static buffer: the head reads it right away
        else:  # [N, hidden]; inside a warm-up maybe a probe of a few layers (PackGraphs.eager_layers)
            rows = text_model(pack=ctx, layers=graphs.eager_layers(pack) if graphs is not None else None)
        if ctx.leaf_ids:
            pack_scores.append(model.head(rows.float()).squeeze(-1))  # [N] fp32
            leaf_index.update((seg, len(leaf_index)) for seg in ctx.leaf_ids)
        store.update(ctx.exported)
        for seg in pack.external:  # free prefix states no later pack reads
            remaining_children[seg] -= 1
            if remaining_children[seg] == 0:
                del store[seg]
    order = sorted((s.request, s.leaf, s.id) for s in plan.segments if s.leaf is not None)
    scores = pack_scores[0] if len(pack_scores) == 1 else torch.cat(pack_scores) if pack_scores else None
    values = scores.tolist() if scores is not None else []  # the one device synchronisation
    if graphs is not None and not graphs.answering:  # a warm-up: rows are zeros, stale outputs or probes
        values = [0.0] * len(values)  # (PackGraphs.warming), so its scores are 0.0, never garbage
    flat = [values[leaf_index[seg_id]] for _, _, seg_id in order]
    caches = [{"enabled": options.shared_prefix, "mode": "prefix-tree" if options.shared_prefix else "none",
               "shared_tokens": shared} for shared in plan.shared_tokens]
    return flat, caches

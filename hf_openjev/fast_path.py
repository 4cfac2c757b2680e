"""The fast path: plan (prefix tree + packs), run each pack through the patched backbone, head in fp32.

``score_fast(model, requests_tokens)`` scores ``requests_tokens[r][q][c]`` (token ids) and returns the flat
scores in request/question/candidate order plus one ``prefix_cache`` report per request. On CUDA (patch option
``cuda_graphs``, on by default) every pack that ``graph_ready`` accepts is padded to its shape bucket and replayed
as a CUDA graph; other packs run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .patches.cuda_graphs import PackGraphs, graph_ready
from .patches.pack_context import DENSE_ATTENTION_TOKENS, build_pack_context
from .patches.record import apply_patches, patch_record, text_model_of
from .planner import (DEFAULT_MAX_SEQUENCES, DEFAULT_MAX_TOKENS, DEFAULT_MIN_SHARED_TOKENS, DEFAULT_SHARE_TAILS,
                      plan_requests)


@torch.no_grad()
def score_fast(model, requests_tokens: Sequence[Sequence[Sequence[Sequence[int]]]], *,
               min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS, max_sequences: int = DEFAULT_MAX_SEQUENCES,
               max_tokens: int = DEFAULT_MAX_TOKENS, share_tails: bool = DEFAULT_SHARE_TAILS,
               dense_attention_tokens: int = DENSE_ATTENTION_TOKENS) -> tuple[list[float], list[dict]]:
    """Score every candidate with the patched backbone (patches are applied with defaults if absent).

    Planner options as in :func:`~hf_openjev.planner.plan_requests`; ``dense_attention_tokens``: a pack level of one
    sequence at least this long (and no prefix) runs its attention as one dense causal call (cuDNN on CUDA;
    0: never; :data:`~hf_openjev.patches.pack_context.DENSE_ATTENTION_TOKENS`)."""
    record = patch_record(model) or apply_patches(model)
    options = record.options
    plan = plan_requests(requests_tokens, shared_prefix=options.shared_prefix, min_shared_tokens=min_shared_tokens,
                         max_sequences=max_sequences if options.packed_candidates else 1, max_tokens=max_tokens,
                         share_tails=share_tails)
    text_model = text_model_of(model)
    device = model.device
    remaining_children: dict[int, int] = {}
    for pack in plan.packs:
        for seg in pack.external:
            remaining_children[seg] = remaining_children.get(seg, 0) + 1
    store = {}
    leaf_scores: dict[int, torch.Tensor] = {}
    use_graphs = options.cuda_graphs and device.type == "cuda"
    for pack in plan.packs:
        graphed = use_graphs and graph_ready(plan, pack)
        ctx = build_pack_context(plan, pack, store, device, final_row_mlp=options.final_row_mlp,
                                 compile_elementwise=options.compile_elementwise,
                                 fused_elementwise=options.fused_elementwise, gdn_fp32=options.gdn_fp32,
                                 pad=graphed, dense_attention_tokens=dense_attention_tokens)
        if graphed:
            if record.graphs is None:
                record.graphs = PackGraphs(text_model)
            rows = record.graphs.run(ctx)[: len(ctx.leaf_ids)]  # a static buffer: the head reads it right away
        else:
            rows = text_model(pack=ctx)  # [N, hidden]
        if ctx.leaf_ids:
            scores = model.head(rows.float()).squeeze(-1)  # [N] fp32
            leaf_scores.update(zip(ctx.leaf_ids, scores))
        store.update(ctx.exported)
        for seg in pack.external:  # free prefix states no later pack reads
            remaining_children[seg] -= 1
            if remaining_children[seg] == 0:
                del store[seg]
    order = sorted((s.request, s.leaf, s.id) for s in plan.segments if s.leaf is not None)
    flat = torch.stack([leaf_scores[seg_id] for _, _, seg_id in order]).tolist() if order else []
    caches = [{"enabled": options.shared_prefix, "mode": "prefix-tree" if options.shared_prefix else "none",
               "shared_tokens": shared} for shared in plan.shared_tokens]
    return flat, caches

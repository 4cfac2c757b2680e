"""The fast layout (hf_openjev.packing.layout, with its cache) against its reference (hf_openjev.packing.naive_layout)
on random plans: tails, nested tails, splits with received and handed-on states, padding, merged or per-level GDN
calls, dense levels, a bucket policy. (These are packing/layout.py's tests; tests/test_layout.py holds the
package's import rules.)

- the template a new shape gets, ``layout.lay_out_template``, equals ``naive_layout.record_template`` of the
  reference's host layout (``naive_layout.lay_out_pack``) field by field and byte by byte;
- the context ``pack_context.build_pack_context`` gives (a new shape, or a shape seen before with other token
  ids: a layout-cache hit) equals ``naive_layout.build_naive_pack_context``'s tensor by tensor.
"""

from __future__ import annotations

import random

import pytest
import torch
from same_layouts import assert_same_context, assert_same_template

from hf_openjev.fast_options import FastPathOptions
from hf_openjev.packing import naive_layout as nl
from hf_openjev.packing.bucket_policy import table_policy
from hf_openjev.packing.layout import lay_out_template
from hf_openjev.packing.layout_cache import TEMPLATES, fill_template
from hf_openjev.packing.layout_steps import SegmentState, index_external
from hf_openjev.packing.pack_context import PackContext, attach_external_states, build_pack_context
from hf_openjev.packing.planner import plan_requests

torch.set_num_threads(1)

PLAN_OPTIONS = [dict(), dict(share_tails=False, min_shared_tokens=64), dict(min_shared_tokens=4),
                dict(max_sequences=2), dict(max_sequences=3, max_tokens=150), dict(shared_prefix=False)]


def _random_requests(rng: random.Random) -> list:
    """1-3 requests of 1-2 questions of 1-6 candidates: a shared state, a question head, own suffixes (random
    lengths, 0 included, so prefixes are shared, tails cut or nothing shared)."""
    requests = []
    for _ in range(rng.randint(1, 3)):
        state = [rng.randrange(5, 400) for _ in range(rng.choice([0, 3, 38, 64, 70, 130, 200]))]
        questions = []
        for _ in range(rng.randint(1, 2)):
            head = state + [rng.randrange(5, 400) for _ in range(rng.choice([0, 5, 20, 70]))]
            questions.append([head + [rng.randrange(5, 400) for _ in range(rng.randint(1, 50))]
                              for _ in range(rng.randint(1, 6))])
        requests.append(questions)
    return requests


def _random_shape(rng: random.Random) -> list:
    """A batch's shape: per request, (prefix, per question (head, [suffixes]))."""
    return [(rng.choice([0, 10, 40, 64, 70, 130]),
             [(rng.choice([0, 5, 20, 70]), [rng.randint(1, 40) for _ in range(rng.randint(1, 5))])
              for _ in range(rng.randint(1, 2))]) for _ in range(rng.randint(1, 3))]


def _requests_of_shape(shape: list, rng: random.Random) -> list:
    """Token ids of ``shape``: shared where the shape shares, random elsewhere (new ids each call)."""
    out = []
    for prefix_len, questions in shape:
        prefix = [rng.randrange(5, 400) for _ in range(prefix_len)]
        out.append([])
        for head_len, suffixes in questions:
            head = prefix + [rng.randrange(5, 400) for _ in range(head_len)]
            out[-1].append([head + [rng.randrange(5, 400) for _ in range(n)] for n in suffixes])
    return out


def _store_for(plan, pack, store: dict) -> None:
    """Exported states of earlier packs (random values, two layers) for ``pack.external``."""
    for seg in pack.external:
        if seg not in store:
            length = plan.segments[seg].end
            store[seg] = SegmentState(length, gdn={0: torch.randn(2, 3, 3)}, conv={0: torch.randn(4, 2)},
                                      key={1: torch.randn(length, 1, 2)}, value={1: torch.randn(length, 1, 2)})


@pytest.mark.parametrize("plan_options", PLAN_OPTIONS)
def test_list_templates_equal_the_reference_templates_on_random_plans(plan_options):
    rng = random.Random(5)
    compared, kinds = 0, set()
    for _ in range(12):
        plan = plan_requests(_random_requests(rng), **plan_options)
        store: dict = {}
        dense = rng.choice([0, 16, 2048])
        options = FastPathOptions(dense_attention_tokens=dense)
        for pack in plan.packs:
            _store_for(plan, pack, store)
            for pad in [False] if (pack.external or pack.export) else [False, True]:
                for merge in (True, False):
                    new = lay_out_template(plan, pack, store, pad=pad, merge_levels=merge,
                                           dense_attention_tokens=dense)
                    ctx, layout, bank = nl.lay_out_pack(plan, pack, store, options, pad=pad, merge_levels=merge)
                    assert_same_template(new, nl.record_template(ctx, layout, bank, plan, pack))
                    filled = fill_template(new, plan, pack, "cpu", options, PackContext)
                    attach_external_states(filled, store, index_external(pack, store))
                    assert_same_context(filled, nl.build_naive_pack_context(plan, pack, store, "cpu", options,
                                                                             pad=pad, merge_levels=merge))
                    compared += 1
                    kinds |= {"gathered" for call in ctx.gdn_calls if call.rows is not None}
                    kinds |= {"chain" for level in ctx.levels if level.chain_index is not None}
                    kinds |= {"dense" for level in ctx.levels if level.dense}
                    kinds |= {"export"} if pack.export else set()
                    kinds |= {"received"} if pack.external else set()
                    kinds |= {"source"} if any(call.source is not None for call in ctx.gdn_calls) else set()
    assert compared >= 24
    if plan_options.get("max_sequences"):
        assert {"export", "received"} <= kinds
    if not plan_options:  # the default plans: tails (gathered calls) and padded, shared-prefix levels
        assert {"gathered", "source", "dense"} <= kinds


@pytest.mark.parametrize("plan_options", [dict(), dict(share_tails=False, min_shared_tokens=64),
                                          dict(max_sequences=2), dict(max_sequences=3, max_tokens=120)])
def test_cached_contexts_equal_the_reference_contexts_on_random_plans(plan_options):
    rng = random.Random(11)
    TEMPLATES.clear()
    compared = hits = exported = received = 0
    for _ in range(10):
        shape, dense = _random_shape(rng), rng.choice([0, 16, 2048])
        for _ in range(2):  # the same shape with other token ids: the second round hits the cache
            plan = plan_requests(_requests_of_shape(shape, rng), **plan_options)
            store: dict = {}
            for pack in plan.packs:
                _store_for(plan, pack, store)
                pads = [False] if (pack.external or pack.export) else [False, True]
                for pad in pads:
                    for merge in (True, False):
                        options = FastPathOptions(dense_attention_tokens=dense)
                        before = TEMPLATES.hits
                        cached = build_pack_context(plan, pack, store, "cpu", options, pad=pad, merge_levels=merge)
                        hits += TEMPLATES.hits > before
                        reference = nl.build_naive_pack_context(plan, pack, store, "cpu", options, pad=pad,
                                                                merge_levels=merge)
                        assert_same_context(cached, reference)
                        compared += 1
                exported += bool(pack.export)
                received += bool(pack.external)
    assert compared >= 40 and hits >= compared // 3
    if plan_options.get("max_sequences"):
        assert exported and received  # split trees: states handed on and received were compared


def test_a_nested_tail_plan_gathers_its_chains_and_matches_the_reference():
    nested = plan_requests([[[list(range(100, 140)) + list(range(200, 220)) + [c] for c in (1, 2)],
                             [list(range(100, 140)) + list(range(300, 320)) + [c] for c in (3, 4)]]],
                           share_tails=True, min_shared_tokens=8)
    pack = nested.packs[0]
    for pad in (False, True):
        new = lay_out_template(nested, pack, {}, pad=pad, merge_levels=True, dense_attention_tokens=2048)
        ctx, layout, bank = nl.lay_out_pack(nested, pack, {}, FastPathOptions(), pad=pad, merge_levels=True)
        assert any(level.chain_index is not None for level in ctx.levels)  # split chains: a gathered block
        assert_same_template(new, nl.record_template(ctx, layout, bank, nested, pack))


def test_list_templates_equal_the_reference_templates_under_a_bucket_policy():
    rng = random.Random(7)
    policy = table_policy("2b")
    for _ in range(6):
        requests = [[[[rng.randrange(5, 400) for _ in range(rng.choice([3, 38, 70]))] * 1
                      + [rng.randrange(5, 400) for _ in range(rng.randint(1, 60))] for _ in range(rng.randint(1, 5))]]]
        plan = plan_requests(requests)
        for pack in plan.packs:
            if pack.external or pack.export:
                continue
            new = lay_out_template(plan, pack, {}, pad=True, merge_levels=True, dense_attention_tokens=2048,
                                   buckets=policy)
            ctx, layout, bank = nl.lay_out_pack(plan, pack, {}, FastPathOptions(), pad=True, merge_levels=True,
                                                buckets=policy)
            assert_same_template(new, nl.record_template(ctx, layout, bank, plan, pack))
            assert ctx.levels[-1].hi in policy.rows  # the pack ends on a measured row count

"""Equality of two layouts of one pack, for the tests that compare the fast layout with its reference
(test_layout_reference.py, test_layout_cache.py, test_pack_context.py): templates field by field and byte by byte,
contexts tensor by tensor."""

from __future__ import annotations

import dataclasses

import torch

from hf_openjev.packing.layout_steps import GdnCall


def assert_same_holder(new, old, new_fields, old_fields) -> None:
    """A template's LevelSpec / GdnCall: equal non-tensor fields, the same slot for each tensor field."""
    assert type(new) is type(old) and dict(new_fields) == dict(old_fields)
    assert tuple(name for name, _ in new_fields) == tuple(name for name, _ in old_fields)
    for f in dataclasses.fields(old):
        value = getattr(old, f.name)
        if isinstance(value, torch.Tensor):
            assert getattr(new, f.name) is None and f.name in dict(new_fields), f.name
        else:
            assert getattr(new, f.name) == value and f.name not in dict(new_fields), f.name


def assert_same_template(new, old) -> None:
    assert new.layout == old.layout
    assert new.host.dtype == old.host.dtype == torch.uint8 and torch.equal(new.host, old.host)
    for name in ("token_runs", "context_fields", "leaf_positions", "exports", "key_tail", "n_external"):
        assert getattr(new, name) == getattr(old, name), name
    for news, olds in ((new.levels, old.levels), (new.gdn_calls, old.gdn_calls)):
        assert len(news) == len(olds)
        for (n, n_fields), (o, o_fields) in zip(news, olds):
            assert_same_holder(n, o, n_fields, o_fields)


def assert_same_context(a, b) -> None:
    """Two contexts of one pack: the same tensors (values, dtypes, shapes), fields, exports and received states."""
    assert a.graph_key == b.graph_key and a.leaf_ids == b.leaf_ids and a.n_external == b.n_external
    assert a.options == b.options
    for x, y in zip(a.static_tensors(), b.static_tensors(), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    assert {d: t.shape for d, t in a.inputs.items()} == {d: t.shape for d, t in b.inputs.items()}
    for xs, ys in ((a.levels, b.levels), (a.gdn_calls, b.gdn_calls)):
        for x, y in zip(xs, ys, strict=True):
            for f in dataclasses.fields(x):
                u, v = getattr(x, f.name), getattr(y, f.name)
                assert (torch.equal(u, v) and u.dtype == v.dtype if isinstance(u, torch.Tensor) else u == v), f.name
            if isinstance(x, GdnCall) and x.rows is None:  # a call that shares its level's metadata still does
                assert x.cu_seqlens is a.levels[x.first].cu_seqlens
    assert a.exports.keys() == b.exports.keys()
    for seg, (row, chain, length) in a.exports.items():
        assert (row, length) == (b.exports[seg][0], b.exports[seg][2]) and torch.equal(chain, b.exports[seg][1])
    for name in ("external_gdn", "external_conv", "external_key", "external_value"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

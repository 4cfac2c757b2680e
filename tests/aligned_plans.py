"""The aligned layout, for tests that describe it: every shared prefix cut at a multiple of 64 tokens and shared
from 64 tokens (``share_tails=False, min_shared_tokens=64``, the planner's default until exact sharing passed the
fidelity gate and became the default). ``plan_requests`` / ``build_tree`` here default to it; a test of tails or
of the defaults passes its options, or calls ``hf_openjev.packing.planner`` directly."""

from __future__ import annotations

from hf_openjev.packing import planner

ALIGNED = {"share_tails": False, "min_shared_tokens": 64}


def plan_requests(*args, **kwargs):
    return planner.plan_requests(*args, **{**ALIGNED, **kwargs})


def build_tree(*args, **kwargs):
    return planner.build_tree(*args, **{**ALIGNED, **kwargs})

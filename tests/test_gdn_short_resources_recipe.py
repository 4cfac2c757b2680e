"""recipes/gdn_short_resources.py without triton: reading cuobjdump's resource line, the default variant names."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.fixture
def recipe(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # gdn_short_check, imported for its names, sets it without CUDA
    monkeypatch.syspath_prepend(str(RECIPES))
    module = importlib.import_module("gdn_short_resources")
    yield module
    for name in ("gdn_short_resources", "gdn_short_check"):
        sys.modules.pop(name, None)


def test_resource_line_is_read(recipe):
    text = """
Resource usage:
 Function _gdn_wy_state_kernel:
  REG:255 STACK:2424 SHARED:1024 LOCAL:0 CONSTANT[0]:632 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    assert recipe.parse_resource_usage(text) == dict(registers=255, stack=2424, shared=1024)
    with pytest.raises(ValueError, match="REG"):
        recipe.parse_resource_usage("Resource usage:\n")


def test_default_variants_are_names_the_check_recipe_parses(recipe):
    from gdn_short_check import parse_variant

    for name in recipe.VARIANTS.split(","):
        assert parse_variant(name)["precision"]

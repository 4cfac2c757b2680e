"""`hf-openjev serve`'s command line in tests: its parser, and a guard that fails a test if anything loads or
starts before the check under test has refused the arguments."""

from __future__ import annotations

import argparse

from hf_openjev.serve import cli as serve_cli


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return parser


def forbid_loading(monkeypatch, check: str) -> None:
    """Make loading an export or starting uvicorn fail the test, naming ``check`` (what should have come first)."""
    import uvicorn

    def refuse(*args, **kwargs):
        raise AssertionError(f"loaded (or started) before the {check}")

    monkeypatch.setattr("hf_openjev.model.load_export", refuse)
    monkeypatch.setattr(uvicorn.Server, "run", refuse)

"""Turning the third-party progress bars off for a while: Transformers' weight-loading bar (and the Hub's), which
``--no-progress`` must hide as it hides hf_openjev's own bars."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    """With ``enabled`` False, Transformers' and huggingface_hub's tqdm bars are off inside the block and restored
    as they were after it; with ``enabled`` True, nothing changes."""
    if enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()

"""Capture the fast path's CUDA graphs before serving: one forward per request shape of a token-shape file.

The first pack of a new shape bucket captures a CUDA graph (about a second per bucket at the 27B shape, and the
231 JevBench requests need over a hundred buckets; recipes/RESULTS.md). A server that warms up on its traffic's shapes pays that at start, not on
its first requests. A shape file is the JevBench manifest's format (``data/bench/jevbench231-shapes.json``)::

    {"requests": [{"prefix_tokens": 38, "suffix_tokens": [43, 37, 40]}, ...]}

Each entry becomes one request of one question whose candidates are a shared prefix of ``prefix_tokens`` random
ids followed by their own ``suffix_tokens[i]`` random ids: the packs (and so the graph buckets) of a real request
with those token counts. Requests batched together by the server form other packs; those capture on first use.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from ..errors import InputFileError

FIRST_ID = 1000  # random ids from here up (or from half a smaller vocabulary): clear of the special tokens


def load_shapes(path) -> list[tuple[int, list[int]]]:
    """(prefix tokens, [suffix tokens per candidate]) per request of a shape file; :class:`InputFileError` (a
    ``ValueError``) says what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputFileError(f"warm-up shapes {path}: cannot read a JSON file ({exc})") from exc
    entries = data.get("requests") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InputFileError(f'warm-up shapes {path}: expected {{"requests": [{{"prefix_tokens": int, '
                             f'"suffix_tokens": [int, ...]}}, ...]}} with at least one request')
    shapes = []
    for i, entry in enumerate(entries):
        prefix = entry.get("prefix_tokens") if isinstance(entry, dict) else None
        suffixes = entry.get("suffix_tokens") if isinstance(entry, dict) else None
        if not (isinstance(prefix, int) and prefix >= 0 and isinstance(suffixes, list) and suffixes
                and all(isinstance(n, int) and n >= 1 for n in suffixes)):
            raise InputFileError(f"warm-up shapes {path}: request {i} needs prefix_tokens >= 0 and a non-empty "
                                 f"list of suffix_tokens >= 1, got {entry!r}")
        shapes.append((prefix, list(suffixes)))
    return shapes


def warm_up(model, shapes, options=None, *, seed: int = 0, progress: bool = True,
            compile_threads: int | None = None) -> dict:
    """Set ``model`` up for the fast path and run one fast-path forward per shape (random ids), unanswered
    (:func:`~hf_openjev.patches.warming_up`: captures and first uses, no replay); report what it did.

    ``shapes``: (prefix tokens, [suffix tokens]) pairs (:func:`load_shapes`); shapes longer than the model's
    ``max_length`` are skipped, as the server would refuse such requests. ``options``: the
    :class:`~hf_openjev.fast_options.FastPathOptions` the traffic will be scored with, since they shape the packs
    (default: the options the model is patched with, else the defaults); the model is patched with them
    (:func:`~hf_openjev.patches.apply_patches`). ``compile_threads`` > 0: a compile-ahead pass over the same
    requests first (:func:`~hf_openjev.patches.run_warm_up`: Triton's compiles that many at a time; None: the
    package's default, ``patches.record.COMPILE_THREADS``, 0 until a GPU has measured it). Returns
    ``{"requests", "skipped_too_long", "seconds", "graphs", "compile_ahead"}``
    (``graphs``: the graph cache's ``stats()``, None where the model has none: on the CPU or patched with
    ``cuda_graphs=False``; ``compile_ahead``: that pass's report and seconds, None without one).
    """
    from tqdm.auto import tqdm

    from ..fast_path import score_fast
    from ..patches import apply_patches, read_graph_stats, read_options, run_warm_up
    from ..patches.record import check_compile_threads

    compile_threads = check_compile_threads(compile_threads)  # before anything is patched or built
    options = options if options is not None else read_options(model)
    apply_patches(model, options)
    vocab = model.config.vocab_size
    low = min(FIRST_ID, vocab // 2)
    rng = random.Random(seed)
    runnable = [(p, s) for p, s in shapes if p + max(s) <= model.max_length]
    requests = []
    for prefix_tokens, suffixes in runnable:
        prefix = [rng.randrange(low, vocab) for _ in range(prefix_tokens)]
        requests.append([prefix + [rng.randrange(low, vocab) for _ in range(n)] for n in suffixes])

    def one_pass(stage: str):  # the scores are discarded: captures and first uses only, no answering replays
        for candidates in tqdm(requests, desc=f"hf-openjev {stage}", unit="request", disable=not progress,
                               file=sys.stderr):
            score_fast(model, [[candidates]], options)

    start = time.perf_counter()
    ahead = run_warm_up(model, one_pass, compile_threads=compile_threads)["compile_ahead"]
    return {"requests": len(runnable), "skipped_too_long": len(shapes) - len(runnable),
            "seconds": time.perf_counter() - start, "graphs": read_graph_stats(model), "compile_ahead": ahead}


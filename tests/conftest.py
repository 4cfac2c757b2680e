"""Shared fixtures: one tiny random Open-Jev checkpoint per test session, loaded once in fp32 on CPU.

``tiny_checkpoint`` holds the paths (base, package, merged export) of a checkpoint built by
``hf_openjev.export.tiny.build_tiny_checkpoint``; ``tiny_model`` is its merged export loaded as a ``JevModel``
(fp32, CPU). Tests must not mutate ``tiny_model`` (dtype, device, weights): load a private copy instead.

``qwen_tokenizer`` is the real Qwen3.5 tokenizer (converted once into the disk cache, ``$HF_OPENJEV_CACHE`` or
``~/.cache/hf_openjev``, then read from it); ``qwen_tiny_checkpoint`` / ``qwen_tiny_model`` are the same tiny
model with that tokenizer and 248,320 embedding rows. ``golden_ids()`` reads tests/data/qwen35_golden_ids.json.
"""

from __future__ import annotations

import pytest
import torch

import hf_openjev
from hf_openjev.export.tiny import TinyCheckpoint, build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> TinyCheckpoint:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint) -> hf_openjev.JevModel:
    model = hf_openjev.load_export(tiny_checkpoint.export, dtype="float32", device="cpu")
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    return model


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from hf_openjev.tokenizer.qwen_tokenizer import load_qwen_tokenizer

    return load_qwen_tokenizer()


@pytest.fixture(scope="session")
def qwen_tiny_checkpoint(tmp_path_factory, qwen_tokenizer) -> TinyCheckpoint:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen"), tokenizer="qwen3.5")


@pytest.fixture(scope="session")
def qwen_tiny_model(qwen_tiny_checkpoint) -> hf_openjev.JevModel:
    return hf_openjev.load_export(qwen_tiny_checkpoint.export, dtype="float32", device="cpu")


def golden_ids() -> list[dict]:
    """Four Open-Jev requests and the official Qwen3.5 tokenizer's ids [question][candidate] of each."""
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "data" / "qwen35_golden_ids.json").read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a module of tiny-model tests (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): the tiny
    model gains nothing from threads, and on a shared 2-core box OpenMP spinning makes it 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def process_settings_restored():
    """A test that runs ``serve`` in-process sets torch's CPU threads (:mod:`hf_openjev.serve.cpu_threads`), freezes
    the objects alive at its start (:mod:`hf_openjev.serve.startup_gc`) and configures logging (the package's level,
    the access log's own handler without propagation) as a server process would: the next test gets the threads,
    the loggers and the collector back as they were (else a later test's ``caplog`` sees no access line)."""
    import gc
    import logging

    before = torch.get_num_threads()
    package, access = logging.getLogger("hf_openjev"), logging.getLogger("hf_openjev.serve.access")
    saved = (package.level, access.level, list(access.handlers), access.propagate)
    yield
    torch.set_num_threads(before)  # always: a count set on another thread is not visible here, but later threads get it
    if gc.get_freeze_count():
        gc.unfreeze()
    package.setLevel(saved[0])
    access.setLevel(saved[1])
    access.handlers[:] = saved[2]
    access.propagate = saved[3]


def random_token_requests(model, n: int = 3, seed: int = 0) -> list:
    """Token ids [request][question][candidate] with shared prefixes: ``n`` requests of 2, 3, ... candidates."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    out = []
    for r in range(n):
        prefix = torch.randint(10, vocab, (20 + 30 * r,), generator=g).tolist()
        out.append([[prefix + torch.randint(10, vocab, (3 + c,), generator=g).tolist() for c in range(2 + r)]])
    return out


def random_lengths(rng, n: int, lo: int = 1, hi: int = 300) -> list[int]:
    """``n`` sequence lengths drawn from [lo, hi] (the op tests' packings)."""
    return [rng.randint(lo, hi) for _ in range(n)]


# --- independent re-implementations used as oracles (written from docs/contract.md, not from hf_openjev) -------

# docs/contract.md §3: one user turn of the Qwen3.5 chat template, thinking disabled, generation prompt added.
QWEN_CHAT_PREFIX = "<|im_start|>user\n"
QWEN_CHAT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def _spec_render(value) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)


def spec_prompts(request: dict) -> dict[str, list[str]]:
    """docs/contract.md §3, re-derived: question id -> candidate prompts (without chat halves), in request order."""
    state = _spec_render(request["state"])
    out: dict[str, list[str]] = {}
    for qid, q in request["questions"].items():
        text = _spec_render(q["instructions"])
        if q["type"] == "noul" and q.get("criteria") is not None:
            text += "\nYes means: " + _spec_render(q["criteria"]["true"]) + "\nNo means: " + _spec_render(
                q["criteria"]["false"])
        head = "Context:\n" + state + "\n\nQuestion: " + text + "\n"
        tail = "\nIs this proposed answer correct? Answer Yes or No."
        if q["type"] == "choice":
            options = [k if d is None else k + ": " + _spec_render(d) for k, d in q["criteria"].items()]
            out[qid] = [head + "Proposed answer: " + o + tail for o in options]
        elif q["type"] == "score":
            out[qid] = [head + "Proposed answer: " + _spec_render(level) + tail for level in q["criteria"]]
        else:
            out[qid] = [head + "Is the answer to this question yes? Answer Yes or No."]
    return out


@torch.no_grad()
def independent_score(model, ids: list[int]) -> float:
    """One unpadded sequence alone: the backbone's final-norm output at the last token -> fp32 head (float64 sum)."""
    captured = []
    handle = model.backbone.norm.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        out = model.backbone(input_ids=torch.tensor([ids], device=model.device), use_cache=False)
    finally:
        handle.remove()
    assert len(captured) == 1, "the final norm must run exactly once per forward"
    # the final norm is already applied in last_hidden_state: the head reads it as is
    assert torch.equal(out.last_hidden_state, captured[0])
    h = captured[0][0, -1].double()
    w = model.head.weight.detach().double().reshape(-1)
    return float(h @ w + model.head.bias.detach().double()[0])


def spec_softmax(scores, temperature):
    import math

    top = max(scores)
    e = [math.exp((s - top) / temperature) for s in scores]
    return [x / sum(e) for x in e]


@pytest.fixture(scope="session")
def spec():
    """The oracles above, for test files that prefer a fixture to importing conftest."""
    import types

    return types.SimpleNamespace(prefix=QWEN_CHAT_PREFIX, suffix=QWEN_CHAT_SUFFIX, prompts=spec_prompts,
                                 score=independent_score, softmax=spec_softmax)

"""Export verification: merged tensors against PEFT's ``merge_and_unload()``, and a score probe of the export
against the unmerged PEFT reference (see :mod:`hf_openjev.export`, 'Verification')."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from dataclasses import dataclass

import torch

from ..contract import KINDS
from .examples import DEMO_REQUESTS

# Probe requests: every question type, several candidates, multilingual and structured state.
PROBE_REQUESTS = [
    DEMO_REQUESTS[0],  # every question type in one request
    {
        "state": {"ticket": 4471, "messages": ["Das Paket kam beschädigt an.", "Bitte ersetzen."]},
        "questions": {
            "replace": {"type": "noul", "instructions": "Does the customer ask for a replacement?"},
            "tone": {"type": "choice", "instructions": "What is the tone?",
                     "criteria": {"calm": None, "angry": None}},
        },
    },
    {
        "state": "Über naïve café — 日本語のテキスト, emoji 🙂 and numbers 0123456789.",
        "questions": {"severity": {"type": "score", "instructions": "Rate the severity from low to high.",
                                   "criteria": ["low", "medium", "high", "critical"]}},
    },
]


def bf16_ulp_distance(x: torch.Tensor, y: torch.Tensor) -> int:
    """Largest distance between two bf16 tensors in units in the last place (0 means bitwise identical)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        magnitude = bits & 0x7FFF
        return torch.where(bits < 0, -magnitude, magnitude)  # +0 and -0 both map to 0

    if x.shape != y.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
    if x.numel() == 0:
        return 0
    return int((ordered(x.to(torch.bfloat16)) - ordered(y.to(torch.bfloat16))).abs().max())


def peft_merge_and_unload(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, rank: int,
                          alpha: float) -> torch.Tensor:
    """What PEFT's ``merge_and_unload()`` makes of one ``nn.Linear`` holding ``weight`` with LoRA ``(a, b)``.

    The linear keeps ``weight``'s dtype (bf16 for the published bases); the adapter is fp32, as in the reference.
    """
    from peft import LoraConfig, get_peft_model
    from torch import nn

    holder = nn.Module()
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    holder.proj = linear
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=["proj"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(holder, config, autocast_adapter_dtype=True)
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(a)
        layer.lora_B["default"].weight.copy_(b)
    if layer.lora_A["default"].weight.dtype != torch.float32:
        raise RuntimeError("PEFT did not keep the adapter in fp32")
    merged = model.merge_and_unload()
    return merged.proj.weight.detach()


@dataclass
class TensorCheck:
    """Merged tensors against PEFT ``merge_and_unload()`` on the same inputs."""

    modules: int = 0
    bitwise: int = 0
    max_ulp: int = 0
    worst_module: str | None = None

    def describe(self) -> str:
        if self.modules == 0:
            return "merged tensors: not compared with PEFT (verification off)"
        if self.bitwise == self.modules:
            how = "bitwise identical"
        else:
            how = (f"{self.bitwise} bitwise identical, the others within {self.max_ulp} bf16 ulp "
                   f"(worst: {self.worst_module})")
        return f"merged tensors vs PEFT merge_and_unload() on the same inputs: {self.modules} modules, {how}"


@dataclass
class ProbeCheck:
    """Export vs the unmerged PEFT reference on :data:`PROBE_REQUESTS` (CPU, fp32, ``fast=False``)."""

    ran: bool = False
    skipped_reason: str = ""
    requests: int = 0
    candidates: int = 0
    max_abs_dscore: float = float("nan")  # end to end: each side with its own tokenizer
    max_abs_dp: float = float("nan")
    decision_flips: int = 0
    token_mismatches: int = 0  # probe candidates the export's and the base's tokenizers tokenize differently
    same_tokens_max_abs_dscore: float = float("nan")  # the weights alone: both score the reference's token ids
    same_tokens_max_abs_dp: float = float("nan")
    export_tokenizer: str = ""
    reference_tokenizer: str = ""
    seconds: float = 0.0

    def describe(self) -> list[str]:
        if not self.ran:
            return [f"score probe skipped: {self.skipped_reason}"]
        out = [f"score probe (export vs unmerged PEFT reference, CPU fp32, fast=False, {self.requests} requests, "
               f"{self.candidates} candidates): max |Δscore| = {self.max_abs_dscore:.3e}, "
               f"max |Δp| = {self.max_abs_dp:.3e}, decision flips = {self.decision_flips}"]
        if self.token_mismatches:
            out.append(
                f"WARNING: {self.token_mismatches} of {self.candidates} probe candidates tokenize differently when "
                f"the tokenizer is loaded from the export ({self.export_tokenizer}) than from the base "
                f"({self.reference_tokenizer}), although the tokenizer files are identical (Transformers picks the "
                "tokenizer class from config.json's model_type); on the same token ids: max |Δscore| = "
                f"{self.same_tokens_max_abs_dscore:.3e}, max |Δp| = {self.same_tokens_max_abs_dp:.3e}")
        return out


def _flat_probabilities(response: dict) -> tuple[list[float], list[str]]:
    """Every candidate probability of a response, and its decisions ``"<qid>:<label>"`` (the table's rule)."""
    values, decisions = [], []
    for qid, answer in response["answers"].items():
        kind = KINDS[answer["type"]]
        values.extend(kind.probabilities(answer))
        decisions.append(f"{qid}:{kind.decision(answer)}")
    return values, decisions


@contextlib.contextmanager
def _quiet_transformers():
    """Silence Transformers' load reports, warnings and progress bars while the probe loads two models."""
    from transformers.utils import logging as hf_logging

    from ..progress_bars import progress_bars

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with progress_bars(False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _compare(responses_a, responses_b) -> tuple[float, int]:
    dp, flips = 0.0, 0
    for response_a, response_b in zip(responses_a, responses_b):
        p_a, d_a = _flat_probabilities(response_a)
        p_b, d_b = _flat_probabilities(response_b)
        dp = max([dp] + [abs(x - y) for x, y in zip(p_a, p_b)])
        flips += sum(x != y for x, y in zip(d_a, d_b))
    return dp, flips


def run_probe(export_dir, base_dir, package_dir, requests=None, *, manifest=None) -> ProbeCheck:
    """Answer probe requests with the export and with the unmerged reference (CPU, fp32, reference path).

    End to end: each model tokenizes with its own tokenizer (the export's from the export directory, the
    reference's from the base directory) and answers through the steps of ``answer_requests(fast=False)``
    (``prepare_request`` -> ``score_prepared`` -> ``build_answer``, called one by one so that the raw head scores
    can be compared as well as the probabilities). When the two tokenizers disagree on a probe candidate, that
    is reported (``token_mismatches``) and the export also scores the reference's token ids (``same_tokens_*``),
    so the merge and the tokenizer loading can be told apart. ``manifest``: the export's manifest when it is not
    written yet (the export command writes it only after this verification).
    """
    from ..model import load_export, load_reference
    from ..scoring import build_answer, prepare_request, score_prepared

    requests = PROBE_REQUESTS if requests is None else requests
    start = time.perf_counter()
    models = []
    with _quiet_transformers():
        # allow_unknown_shape: the export's plan has checked the shape (or was told to allow it); ``manifest``: the
        # export's, not yet written (it is written only after verification)
        for model in (load_export(export_dir, dtype="float32", device="cpu", manifest=manifest,
                                  allow_unknown_shape=True),
                      load_reference(base_dir, package_dir, dtype="float32", device="cpu",
                                     allow_unknown_shape=True)):
            # The probe requests are fixed; score them whatever --max-length the export was given.
            model.manifest = dataclasses.replace(model.manifest, max_length=16384)
            models.append(model)
    export_model, reference_model = models

    def answer(model, prepared):
        result = score_prepared(model, prepared, fast=False)
        responses = [build_answer(model, p, s, seconds=result.seconds, prefix_cache=c, method="reference")
                     for p, s, c in zip(prepared, result.scores, result.prefix_cache)]
        return [s for req in result.scores for q in req for s in q], responses

    with torch.no_grad():
        prepared = [[prepare_request(m, r) for r in requests] for m in models]
        (export_scores, export_responses), (reference_scores, reference_responses) = (
            answer(m, p) for m, p in zip(models, prepared))
        sequences = [[seq for p in per_model for seq in p.sequences] for per_model in prepared]
        mismatches = sum(a != b for a, b in zip(*sequences)) + abs(len(sequences[0]) - len(sequences[1]))
        check = ProbeCheck(ran=True, requests=len(requests), candidates=len(reference_scores),
                           max_abs_dscore=max(abs(x - y) for x, y in zip(export_scores, reference_scores)),
                           token_mismatches=mismatches)
        check.max_abs_dp, check.decision_flips = _compare(export_responses, reference_responses)
        if mismatches:
            same_scores, same_responses = answer(export_model, prepared[1])
            check.same_tokens_max_abs_dscore = max(abs(x - y) for x, y in zip(same_scores, reference_scores))
            check.same_tokens_max_abs_dp, _ = _compare(same_responses, reference_responses)
            check.export_tokenizer = type(export_model.tokenizer).__name__
            check.reference_tokenizer = type(reference_model.tokenizer).__name__
        else:
            check.same_tokens_max_abs_dscore, check.same_tokens_max_abs_dp = check.max_abs_dscore, check.max_abs_dp
    del export_model, reference_model, models
    check.seconds = time.perf_counter() - start
    return check

"""pipeline("jev-decision"): registration, loading, request validation before model work, response shape."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import QWEN_CHAT_PREFIX, QWEN_CHAT_SUFFIX, independent_score, spec_prompts, spec_softmax
from repo_data import JEVBENCH_EASY as JEVBENCH
from transformers import pipeline

import hf_openjev
from hf_openjev import InferenceError, JevDecisionPipeline, JevModel, RequestError
from hf_openjev.checkpoint.tiny import TINY_MODEL_ID, TINY_TEMPERATURE

RESPONSE_KEYS = ["model", "answers", "usage", "metadata"]
METADATA_KEYS = ["method", "temperature", "candidate_sequences", "inference_seconds", "max_length", "base_revision",
                 "prefix_cache"]
ANSWER_KEYS = {"choice": ["type", "choice", "probabilities", "confidence"],
               "score": ["type", "score", "probabilities", "confidence", "legend"],
               "noul": ["type", "noul"]}

REQUEST = {
    "state": {"ticket": 4471, "messages": ["Das Paket kam beschädigt an.", "Bitte ersetzen."], "amount": 12.5},
    "questions": {
        "intent": {"type": "choice", "instructions": "Which intent?",
                   "criteria": {"track_order": "Wants to know where an order is", "refund": None,
                                "replace": {"what": "the item", "why": ["damaged"]}}},
        "severity": {"type": "score", "instructions": ["Rate", "the severity"],
                     "criteria": ["low", {"level": "medium"}, "high", "critical"]},
        "damaged": {"type": "noul", "instructions": "Was the item damaged?",
                    "criteria": {"true": "it arrived broken", "false": {"state": "intact"}}},
        "german": {"type": "noul", "instructions": "Is the message in German?"},
        "only": {"type": "choice", "instructions": "Pick one", "criteria": {"single": None}},
    },
}


@pytest.fixture(scope="module")
def jev(tiny_model):
    return pipeline("jev-decision", model=tiny_model, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def fast_jev(tiny_model):
    """A pipeline set up for the fast path on the CPU (constructing it patches the model); afterwards the
    session's model goes back to the classes it was loaded with, for the test files that run later."""
    from hf_openjev.patches import revert_patches

    yield pipeline("jev-decision", model=tiny_model, device="cpu", dtype="float32", fast=True)
    revert_patches(tiny_model)


def expected_input_tokens(model, request) -> int:
    return sum(len(model.tokenizer(QWEN_CHAT_PREFIX + p + QWEN_CHAT_SUFFIX, add_special_tokens=False)["input_ids"])
               for prompts in spec_prompts(request).values() for p in prompts)


def check_shape(response, request, model_id=TINY_MODEL_ID):
    """docs/contract.md §6 shape, key order, sums; returns nothing, asserts everything."""
    assert list(response) == RESPONSE_KEYS
    assert response["model"] == model_id
    assert list(response["answers"]) == list(request["questions"])
    assert response["usage"] == {"input_tokens": response["usage"]["input_tokens"], "output_tokens": 0}
    assert list(response["usage"]) == ["input_tokens", "output_tokens"]
    meta = response["metadata"]
    assert list(meta) == METADATA_KEYS
    assert meta["method"] == "reference"
    assert meta["temperature"] == TINY_TEMPERATURE
    assert meta["candidate_sequences"] == sum(len(p) for p in spec_prompts(request).values())
    assert isinstance(meta["inference_seconds"], float) and meta["inference_seconds"] >= 0
    assert meta["max_length"] == 4096
    assert meta["base_revision"] == ""
    assert meta["prefix_cache"] == {"enabled": False, "mode": "none", "shared_tokens": 0}
    for qid, answer in response["answers"].items():
        q = request["questions"][qid]
        assert list(answer) == ANSWER_KEYS[q["type"]]
        assert answer["type"] == q["type"]
        if q["type"] == "noul":
            assert isinstance(answer["noul"], float) and 0.0 < answer["noul"] < 1.0
            continue
        p = answer["probabilities"]
        labels = list(q["criteria"]) if q["type"] == "choice" else [str(i) for i in range(len(q["criteria"]))]
        assert list(p) == labels
        assert all(isinstance(v, float) and 0.0 < v <= 1.0 for v in p.values())
        assert math.fsum(p.values()) == pytest.approx(1.0, abs=1e-12)
        best = max(range(len(labels)), key=lambda i: (p[labels[i]], -i))  # first argmax
        n = len(labels)
        if q["type"] == "choice":
            assert answer["choice"] == labels[best]
            expected = 1.0 if n == 1 else (p[labels[best]] - 1 / n) / (1 - 1 / n)
            assert answer["confidence"] == pytest.approx(expected, abs=1e-12)
        else:
            assert answer["score"] == pytest.approx(sum(i * p[str(i)] for i in range(n)), abs=1e-12)
            assert answer["legend"] == {str(i): level for i, level in enumerate(q["criteria"])}
            u = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
            spread = sum(p[str(i)] * abs(i - best) for i in range(n))
            assert answer["confidence"] == pytest.approx(max(0.0, 1 - spread / u), abs=1e-12)


# --- registration and construction -------------------------------------------------------------------------------

def test_registered_on_import_in_a_fresh_interpreter():
    code = ("from transformers.pipelines import PIPELINE_REGISTRY as R\n"
            "assert 'jev-decision' not in R.get_supported_tasks()\n"
            "import hf_openjev\n"
            "impl = R.supported_tasks['jev-decision']['impl']\n"
            "print(impl.__module__, impl.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hf_openjev.pipeline JevDecisionPipeline"
    # registering again is idempotent
    hf_openjev.register_pipeline()
    from transformers.pipelines import PIPELINE_REGISTRY
    assert PIPELINE_REGISTRY.supported_tasks["jev-decision"]["impl"] is JevDecisionPipeline


def test_importing_the_pipeline_module_first_registers_it_and_checks_paths():
    # hf_openjev.pipeline imported before anything loaded Transformers' pipelines: the import hook fires while the
    # module is still importing (it used to fail there with a circular ImportError)
    code = ("import hf_openjev.pipeline\n"
            "from transformers.pipelines import PIPELINE_REGISTRY as R\n"
            "import transformers.pipelines as pipelines\n"
            "impl = R.supported_tasks['jev-decision']['impl']\n"
            "print(impl.__name__, pipelines.pipeline._hf_openjev_checks)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "JevDecisionPipeline True"


def test_pipeline_from_an_export_dir(tiny_checkpoint, tiny_model, jev):
    from_dir = pipeline("jev-decision", model=str(tiny_checkpoint.export), device="cpu", dtype="float32")
    assert isinstance(from_dir, JevDecisionPipeline)
    assert isinstance(from_dir.model, JevModel) and from_dir.model is not tiny_model
    assert from_dir.model.dtype == torch.float32 and from_dir.model.device.type == "cpu"
    ours, theirs = from_dir(REQUEST), jev(REQUEST)
    for r in (ours, theirs):
        r["metadata"].pop("inference_seconds")
    assert ours == theirs


def test_pipeline_dtype_bf16_from_dir(tiny_checkpoint):
    jev_bf16 = pipeline("jev-decision", model=str(tiny_checkpoint.export), device="cpu", dtype="bfloat16")
    assert jev_bf16.model.dtype == torch.bfloat16
    assert jev_bf16.model.head.weight.dtype == torch.float32
    check_shape(jev_bf16(REQUEST), REQUEST)


def test_pipeline_from_a_bad_export_raises_the_checkpoint_error(tiny_checkpoint, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint.export, bad)
    (bad / "open_jev_export.json").write_text("{")
    with pytest.raises(hf_openjev.CheckpointError, match="is not valid JSON"):
        pipeline("jev-decision", model=str(bad), device="cpu", dtype="float32")


# --- answers -------------------------------------------------------------------------------------------------------

def test_one_request_against_an_independent_computation(jev, tiny_model):
    response = jev(REQUEST)
    check_shape(response, REQUEST)
    assert response["usage"]["input_tokens"] == expected_input_tokens(tiny_model, REQUEST)
    prompts = spec_prompts(REQUEST)
    assert response["metadata"]["candidate_sequences"] == 3 + 4 + 1 + 1 + 1
    T = TINY_TEMPERATURE
    for qid, q in REQUEST["questions"].items():
        scores = [independent_score(tiny_model, tiny_model.encode(QWEN_CHAT_PREFIX + p + QWEN_CHAT_SUFFIX))
                  for p in prompts[qid]]
        answer = response["answers"][qid]
        if q["type"] == "noul":
            assert answer["noul"] == pytest.approx(spec_softmax([0.0, scores[0]], T)[1], abs=1e-6)
        else:
            p = spec_softmax(scores, T)
            assert list(answer["probabilities"].values()) == pytest.approx(p, abs=1e-6)
    assert response["answers"]["only"] == {"type": "choice", "choice": "single", "probabilities": {"single": 1.0},
                                           "confidence": 1.0}
    assert response["answers"]["severity"]["legend"] == {"0": "low", "1": {"level": "medium"}, "2": "high",
                                                         "3": "critical"}
    json.dumps(response, allow_nan=False)  # plain JSON-serialisable, finite


def test_candidate_order_is_request_order(jev):
    forward = {"state": "s", "questions": {"q": {"type": "choice", "instructions": "i",
                                                   "criteria": {"b": None, "a": "x", "c": None}}}}
    backward = {"state": "s", "questions": {"q": {"type": "choice", "instructions": "i",
                                                    "criteria": {"c": None, "a": "x", "b": None}}}}
    p1 = jev(forward)["answers"]["q"]["probabilities"]
    p2 = jev(backward)["answers"]["q"]["probabilities"]
    assert list(p1) == ["b", "a", "c"] and list(p2) == ["c", "a", "b"]
    assert {k: round(v, 6) for k, v in p1.items()} == {k: round(v, 6) for k, v in p2.items()}


def test_a_list_gives_a_list_in_order(jev):
    small = {"state": "hello", "questions": {"x": {"type": "noul", "instructions": "yes?"}}}
    responses = jev([REQUEST, small, REQUEST])
    assert isinstance(responses, list) and len(responses) == 3
    single = jev(small)
    assert responses[1]["answers"] == single["answers"]
    assert responses[1]["usage"] == single["usage"]
    assert responses[0]["answers"] == responses[2]["answers"]
    check_shape(responses[0], REQUEST)
    check_shape(responses[1], small)


def test_an_empty_list_gives_an_empty_list(jev):
    assert jev([]) == []


def test_batch_size_option_sets_the_reference_batch(jev, tiny_model):
    shapes = []
    handle = tiny_model.backbone.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        jev(REQUEST, batch_size=4)
        assert [s[0] for s in shapes] == [4, 4, 2]
        shapes.clear()
        jev(REQUEST)
        assert [s[0] for s in shapes] == [10]
    finally:
        handle.remove()


def test_exact_prefix_sharing_is_a_call_option_of_the_fast_path(fast_jev):
    jev = fast_jev
    reference = jev(REQUEST, fast=False)
    aligned = jev(REQUEST, fast=True, share_tails=False, min_shared_tokens=64)
    exact = jev(REQUEST, fast=True, share_tails=True, min_shared_tokens=1)
    shared = [r["metadata"]["prefix_cache"]["shared_tokens"] for r in (aligned, exact)]
    assert shared[1] > shared[0] and shared[1] % 64 != 0  # the exact common prefixes, not their multiples of 64
    for response in (aligned, exact):
        for qid, answer in reference["answers"].items():
            got = response["answers"][qid]
            for key in ("probabilities", "confidence", "score", "noul"):
                if key in answer:
                    assert got[key] == pytest.approx(answer[key], abs=1e-4)
    ignored = jev(REQUEST, fast=False, share_tails=True)  # the reference path shares nothing either way
    assert ignored["metadata"]["prefix_cache"]["shared_tokens"] == 0


def test_dense_attention_is_a_call_option_of_the_fast_path(fast_jev, monkeypatch):
    from hf_openjev import fast_path

    jev = fast_jev
    seen = []  # the options each call changed from the defaults
    real = fast_path.score_fast
    monkeypatch.setattr(fast_path, "score_fast", lambda model, tokens, options: seen.append(
        options.to_dict(changed_only=True)) or real(model, tokens, options))
    default, dense = jev(REQUEST, fast=True), jev(REQUEST, fast=True, dense_attention_tokens=1)
    assert seen == [{}, {"dense_attention_tokens": 1}]
    for qid, answer in default["answers"].items():  # CPU, fp32: the same answers (reference kernels)
        for key in ("probabilities", "score", "noul"):
            if key in answer:
                assert dense["answers"][qid][key] == pytest.approx(answer[key], abs=1e-5)


@pytest.mark.parametrize("options, message", [
    (dict(share_tails="yes"), "share_tails must be True or False"),
    (dict(dense_attention_tokens=-1), "dense_attention_tokens must be a non-negative integer"),
    (dict(dense_attention_tokens=2048.0), "dense_attention_tokens must be a non-negative integer"),
    (dict(min_shared_tokens=0), "min_shared_tokens must be a positive integer"),
    (dict(min_shared_tokens=True), "min_shared_tokens must be a positive integer"),
    (dict(min_shared_tokens=16.0), "min_shared_tokens must be a positive integer"),
])
def test_bad_sharing_options_fail_before_model_work(jev, no_model_work, options, message):
    with pytest.raises(ValueError, match=message):
        jev(REQUEST, fast=True, **options)
    assert no_model_work == []


def test_constructing_for_the_fast_path_patches_the_model_and_a_call_never_does(tiny_checkpoint):
    from hf_openjev.fast_options import FastPathOptions
    from hf_openjev.patches import patch_record

    own = hf_openjev.load_export(tiny_checkpoint.export, dtype=torch.float32)
    reference = pipeline("jev-decision", model=own, device="cpu", dtype="float32")
    assert patch_record(own) is None  # CPU default: the reference path, nothing patched
    with pytest.raises(RuntimeError, match="apply_patches"):
        reference(REQUEST, fast=True)
    assert patch_record(own) is None
    fast = pipeline("jev-decision", model=own, device="cpu", dtype="float32", fast=True, share_tails=True)
    assert patch_record(own).options == FastPathOptions(share_tails=True)  # at construction, with its options
    assert fast(REQUEST)["metadata"]["method"] == "fast"  # fast=True at construction is the pipeline's default
    assert fast(REQUEST, fast=False)["metadata"]["method"] == "reference"
    assert reference(REQUEST, fast=True)["metadata"]["method"] == "fast"  # the model is patched now


def test_unknown_option(jev):
    with pytest.raises(TypeError, match="unknown jev-decision option"):
        jev(REQUEST, temperature=1.0)


# --- the model field -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [TINY_MODEL_ID, "open-jev", "jev-latest", None])
def test_served_model_names(jev, name):
    request = {"model": name, "state": "s", "questions": {"q": {"type": "noul", "instructions": "i"}}}
    assert jev(request)["model"] == TINY_MODEL_ID


@pytest.mark.parametrize("name", ["gpt-4", "", "Open-Jev", "open-jev-27b-v1.1", 7])
def test_other_model_names_are_rejected(jev, name):
    request = {"model": name, "state": "s", "questions": {"q": {"type": "noul", "instructions": "i"}}}
    with pytest.raises(RequestError) as info:
        jev(request)
    assert info.value.status == 422
    assert info.value.message == "requested model is not loaded"
    assert str(info.value) == f"requested model is not loaded ({info.value.detail})"  # it names the served names
    assert "is not served here" in str(info.value)


# --- invalid requests fail before any model work -------------------------------------------------------------------

@pytest.fixture
def no_model_work(monkeypatch, tiny_model):
    """Record (and forbid) every scoring call and backbone forward."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append("scorer")
        raise AssertionError("the scorer must not run for an invalid request")

    monkeypatch.setattr("hf_openjev.pipeline.score_prepared", refuse)
    monkeypatch.setattr("hf_openjev.scoring.score_prepared", refuse)
    monkeypatch.setattr("hf_openjev.reference.score_reference", refuse)
    handle = tiny_model.backbone.register_forward_pre_hook(lambda *_: calls.append("forward"))
    yield calls
    handle.remove()


GOOD = {"state": "s", "questions": {"q": {"type": "noul", "instructions": "i"}}}


@pytest.mark.parametrize("request_, message", [
    ([1], "request body must be a JSON object"),
    ({"questions": {}}, "request requires state"),
    ({"state": 3, "questions": {}}, "state must be text, a JSON object, or an array"),
    ({"state": "s", "questions": []}, "questions must be an object"),
    ({"state": "s", "questions": {}}, "questions must be nonempty and within the server question limit"),
    ({"state": "s", "questions": {"q": {"type": "choice", "instructions": "i", "criteria": []}}},
     "Choice requires an object"),
    ({"state": "s", "questions": {"q": {"type": "score", "instructions": "i", "criteria": ["one"]}}},
     "Score requires 2 to 10 descriptive levels"),
    ({"state": "s", "questions": {"q": {"type": "noul", "instructions": "i", "criteria": {"true": "y"}}}},
     "Noul criteria must contain true and false descriptions"),
    ({"state": "s", "questions": {"q": {"type": "rank", "instructions": "i"}}},
     "question type must be choice, score, or noul"),
])
def test_invalid_request_raises_before_model_work(jev, no_model_work, request_, message):
    with pytest.raises(RequestError) as info:
        jev(request_[0] if isinstance(request_, list) else request_)
    assert info.value.message == message and info.value.status == 422
    assert str(info.value) == (f"{message} ({info.value.detail})" if info.value.detail else message)
    assert no_model_work == []


def test_a_bad_third_request_stops_the_whole_list(jev, no_model_work):
    bad = {"state": "s", "questions": {"q": {"type": "score", "instructions": "i", "criteria": "low..high"}}}
    with pytest.raises(RequestError, match=r"^Score requires an array \(request \[2\]: question 'q': ") as info:
        jev([GOOD, GOOD, bad, GOOD])
    assert info.value.message == "Score requires an array"
    assert no_model_work == []


def test_an_over_long_candidate_fails_untruncated(jev, tiny_model, no_model_work):
    state = "Über naïve café 🙂 " * 900
    request = {"state": "s", "questions": {"short": {"type": "noul", "instructions": "i"},
                                           "long": {"type": "choice", "instructions": "i",
                                                    "criteria": {"a": None, "b": None}}}}
    request["questions"]["long"]["criteria"]["b"] = state
    n = len(tiny_model.encode(QWEN_CHAT_PREFIX + spec_prompts(request)["long"][1] + QWEN_CHAT_SUFFIX))
    assert n > 4096
    with pytest.raises(RequestError) as info:
        jev([GOOD, request])
    assert info.value.message == f"question long: {n} tokens exceeds max_length=4096; no silent truncation"
    assert str(info.value) == f"{info.value.message} (request [1])"  # the list item, by index
    assert info.value.status == 422
    assert no_model_work == []


# --- inference failures ------------------------------------------------------------------------------------------

def test_a_failure_inside_inference_is_a_500(jev, tiny_model, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    # on the instance's __dict__: undo then deletes it (setattr would pin the class's forward, maybe a patched one,
    # on the session's model for the test files that run later)
    monkeypatch.setitem(tiny_model.backbone.__dict__, "forward", boom)
    with pytest.raises(InferenceError) as info:
        jev(GOOD)
    assert info.value.status == 500
    assert str(info.value) == "model inference failed: CUDA out of memory"


def test_a_non_finite_score_is_an_inference_error(tiny_model):
    head = torch.nn.Linear(64, 1).float()
    with torch.no_grad():
        head.weight.copy_(tiny_model.head.weight)
        head.bias.fill_(float("nan"))
    broken = JevModel(tiny_model.backbone, head, tiny_model.tokenizer, tiny_model.manifest, method="merged")
    jev_broken = pipeline("jev-decision", model=broken, device="cpu")
    with pytest.raises(InferenceError) as info:
        jev_broken(GOOD)
    assert info.value.status == 500
    assert str(info.value) == "the model produced a non-finite score"


# --- JevBench easy tier ----------------------------------------------------------------------------------------------

def jevbench_request(task: dict) -> dict:
    q = dict(task["question"])
    if q["type"] == "choice":
        q["criteria"] = {label: task["question"]["criteria"][label] for label in task["labels"]}
    elif q["type"] == "score":
        assert task["labels"] == [str(i) for i in range(len(q["criteria"]))]
    return {"state": task["state"], "questions": {task["id"]: q}}


def test_jevbench_easy_sample(jev, tiny_model):
    tasks = [json.loads(line) for line in JEVBENCH.read_text().splitlines() if line.strip()]
    assert len(tasks) == 48
    requests = [jevbench_request(t) for t in tasks]
    responses = jev(requests)
    assert len(responses) == 48
    kinds = {}
    for task, request, response in zip(tasks, requests, responses):
        check_shape(response, request)
        assert response["usage"]["input_tokens"] == expected_input_tokens(tiny_model, request)
        answer = response["answers"][task["id"]]
        kinds[answer["type"]] = kinds.get(answer["type"], 0) + 1
        if answer["type"] == "choice":
            assert list(answer["probabilities"]) == task["labels"]
            assert answer["choice"] in task["labels"]
    assert kinds == {"choice": 36, "noul": 12}
    # answers depend on the task: not every task gets the same probabilities
    nouls = {round(r["answers"][t["id"]]["noul"], 9) for t, r in zip(tasks, responses) if "noul" in r["answers"][t["id"]]}
    assert len(nouls) == 12


# --- a list is one batch (issue 28, finding 10) --------------------------------------------------------------------

def _scoring_calls(monkeypatch):
    import hf_openjev.pipeline as pipeline_module

    calls = []
    real = pipeline_module.score_prepared

    def spy(model, prepared, **kwargs):
        calls.append((len(prepared), kwargs.get("batch_size")))
        return real(model, prepared, **kwargs)

    monkeypatch.setattr(pipeline_module, "score_prepared", spy)
    return calls


def test_a_list_is_packed_batch_size_requests_per_fast_path_plan(fast_jev, monkeypatch):
    from test_server import COMPANY_TOL, assert_same_answers

    requests = [REQUEST, GOOD, {"state": "other", "questions": REQUEST["questions"]}]
    alone = [fast_jev(r) for r in requests]
    calls = _scoring_calls(monkeypatch)
    together = fast_jev(requests, batch_size=3)
    assert [n for n, _ in calls] == [3]  # one plan for the three, not three
    for got, want in zip(together, alone):
        assert_same_answers(got, want, tol=COMPANY_TOL)
    calls.clear()
    fast_jev(requests, batch_size=2)
    assert [n for n, _ in calls] == [2, 1]
    calls.clear()
    fast_jev(requests)  # default: up to 16 inputs per batch
    assert [n for n, _ in calls] == [3]


def test_on_the_reference_path_batch_size_alone_keeps_its_answers(jev, tiny_model, monkeypatch):
    requests = [REQUEST, GOOD]
    before = [jev(r, reference_batch_size=4) for r in requests]  # candidates per forward, under its own name
    shapes = []
    handle = tiny_model.backbone.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)[0]), with_kwargs=True)
    try:
        calls = _scoring_calls(monkeypatch)
        after = jev(requests, batch_size=4)
    finally:
        handle.remove()
    assert [a["answers"] for a in after] == [b["answers"] for b in before]  # bit for bit
    assert calls == [(1, 4), (1, 4)] and shapes == [4, 4, 2, 1]  # each request its own forwards of 4
    with pytest.raises(ValueError, match="batch_size"):
        jev(requests, batch_size=0)


def test_a_fast_path_plan_is_bounded_by_tokens_too(fast_jev, monkeypatch):
    import hf_openjev.pipeline as pipeline_module
    from hf_openjev.scoring import prepare_request
    from hf_openjev.work_tokens import task_cost

    requests = [REQUEST, GOOD, {"state": "other", "questions": REQUEST["questions"]}]
    costs = [task_cost(prepare_request(fast_jev.model, r), "fast") for r in requests]
    monkeypatch.setattr(pipeline_module, "DEFAULT_BATCH_TOKENS", costs[0] + costs[1] - 1)
    calls = _scoring_calls(monkeypatch)
    fast_jev(requests, batch_size=16)
    sizes = [n for n, _ in calls]
    assert sizes[0] == 1 and sum(sizes) == 3 and len(sizes) >= 2  # 16 requests a plan by count alone: [3]

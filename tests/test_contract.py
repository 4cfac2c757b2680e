"""Tests for hf_openjev.contract against docs/contract.md."""

from __future__ import annotations

import math

import pytest

from hf_openjev.contract import (
    ParsedRequest,
    Question,
    answers_from_scores,
    build_response,
    parse_request,
    render,
    tokenize_candidates,
)
from hf_openjev.errors import RequestError

T = 2.5343690298472983
TOL = 1e-12

HEAD = "Context:\nThe state\n\nQuestion: Which team?\n"
YES_NO = "\nIs this proposed answer correct? Answer Yes or No."
NOUL_TAIL = "Is the answer to this question yes? Answer Yes or No."

MSG_TEXT = "instructions and descriptions must be text, an object, or an array"


def choice(*keys, instructions="Which team?"):
    return {"type": "choice", "instructions": instructions, "criteria": {k: None for k in keys}}


def score(*levels, instructions="How bad?"):
    return {"type": "score", "instructions": instructions, "criteria": list(levels)}


def noul(instructions="Is it urgent?", criteria=None):
    q = {"type": "noul", "instructions": instructions}
    if criteria is not None:
        q["criteria"] = criteria
    return q


def req(questions, state="The state", **extra):
    return {"state": state, "questions": questions, **extra}


def error_of(request, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(request, **kwargs)
    assert isinstance(info.value, ValueError)
    return info.value


def assert_error(request, message, status=422, **kwargs):
    err = error_of(request, **kwargs)
    assert err.message == message
    assert str(err) == (f"{message} ({err.detail})" if err.detail else message)  # an uncaught one names the detail
    assert err.status == status


# --------------------------------------------------------------------------------------------------- render (§3)


def test_render_string_verbatim():
    assert render("a\n\"b\" ü  {x}") == "a\n\"b\" ü  {x}"
    assert render("") == ""


def test_render_nested_objects_sorted_unicode_floats():
    value = {"z": [3, 1, {"b": 1.0, "a": "é"}], "a": {"y": 0.1, "x": None, "w": True}, "m": 1e20}
    assert render(value) == (
        '{"a": {"w": true, "x": null, "y": 0.1}, "m": 1e+20, "z": [3, 1, {"a": "é", "b": 1.0}]}'
    )


def test_render_array_in_order_and_unicode_kept():
    assert render(["b", "a", "日本", 2.5, -0.0]) == '["b", "a", "日本", 2.5, -0.0]'
    assert render([]) == "[]"
    assert render({}) == "{}"


# -------------------------------------------------------------------------------------------------- prompts (§3)


def test_choice_prompts_byte_exact_null_string_object_array_descriptions():
    crit = {
        "zeta": None,
        "alpha": "money",
        "mid": {"b": 2, "a": "ü"},
        "arr": [2, 1],
    }
    parsed = parse_request(req({"q1": {"type": "choice", "instructions": "Which team?", "criteria": crit}}))
    (q,) = parsed.questions
    assert q.id == "q1" and q.type == "choice" and q.legend is None
    assert q.labels == ("zeta", "alpha", "mid", "arr")  # request order, never sorted
    assert q.prompts == (
        HEAD + "Proposed answer: zeta" + YES_NO,
        HEAD + "Proposed answer: alpha: money" + YES_NO,
        HEAD + 'Proposed answer: mid: {"a": "ü", "b": 2}' + YES_NO,
        HEAD + "Proposed answer: arr: [2, 1]" + YES_NO,
    )
    assert q.prompts[0] == (
        "Context:\nThe state\n\nQuestion: Which team?\nProposed answer: zeta\n"
        "Is this proposed answer correct? Answer Yes or No."
    )


def test_score_prompts_byte_exact_level_index_not_shown():
    levels = ["none", {"sev": "high", "code": 3}, ["x", "y"]]
    parsed = parse_request(req({"s": {"type": "score", "instructions": "Which team?", "criteria": levels}}))
    (q,) = parsed.questions
    assert q.type == "score"
    assert q.labels == ("0", "1", "2")
    assert q.prompts == (
        HEAD + "Proposed answer: none" + YES_NO,
        HEAD + 'Proposed answer: {"code": 3, "sev": "high"}' + YES_NO,
        HEAD + 'Proposed answer: ["x", "y"]' + YES_NO,
    )
    assert q.legend == {"0": "none", "1": {"sev": "high", "code": 3}, "2": ["x", "y"]}
    assert list(q.legend) == ["0", "1", "2"]


def test_noul_prompt_byte_exact_without_and_with_criteria():
    parsed = parse_request(
        req(
            {
                "plain": noul("Is it urgent?"),
                "crit": noul({"ask": "urgent?"}, {"true": "it is urgent", "false": {"k": ["not", "urgent"]}}),
                "nullcrit": {"type": "noul", "instructions": "Is it urgent?", "criteria": None},
            },
            state={"b": 1, "a": "ß"},
        )
    )
    plain, crit, nullcrit = parsed.questions
    s = '{"a": "ß", "b": 1}'
    assert plain.type == "noul" and plain.labels == ("yes",) and plain.legend is None
    assert plain.prompts == (
        "Context:\n" + s + "\n\nQuestion: Is it urgent?\nIs the answer to this question yes? Answer Yes or No.",
    )
    assert crit.prompts == (
        "Context:\n" + s + '\n\nQuestion: {"ask": "urgent?"}\nYes means: it is urgent\nNo means: {"k": ["not", "urgent"]}\n'
        + NOUL_TAIL,
    )
    assert nullcrit.prompts == plain.prompts


def test_state_array_and_instruction_object_rendered():
    parsed = parse_request(req({"q": choice("a", instructions={"q": "which", "lang": "fr"})}, state=[{"y": 1, "x": 2}, "t"]))
    assert parsed.questions[0].prompts == (
        'Context:\n[{"x": 2, "y": 1}, "t"]\n\nQuestion: {"lang": "fr", "q": "which"}\nProposed answer: a' + YES_NO,
    )


def test_question_order_and_candidate_order_kept():
    questions = {
        "zz": choice("c", "a", "b"),
        "aa": score("3", "1", "2"),
        "mm": noul(),
        "10": choice("y", "x"),
        "2": choice("only"),
    }
    parsed = parse_request(req(questions))
    assert isinstance(parsed, ParsedRequest)
    assert [q.id for q in parsed.questions] == ["zz", "aa", "mm", "10", "2"]
    assert parsed.questions[0].labels == ("c", "a", "b")
    assert [p.split("Proposed answer: ")[1].split("\n")[0] for p in parsed.questions[1].prompts] == ["3", "1", "2"]
    assert parsed.questions[3].labels == ("y", "x")
    assert parsed.candidate_count == 3 + 3 + 1 + 2 + 1
    assert parsed.model is None


def test_model_accepted_when_served_or_absent_or_null():
    assert parse_request(req({"q": noul()}, model="open-jev"), served_models={"open-jev", "base"}).model == "open-jev"
    assert parse_request(req({"q": noul()}, model=None)).model is None
    assert parse_request(req({"q": noul()})).model is None


def test_question_is_frozen():
    q = parse_request(req({"q": noul()})).questions[0]
    assert isinstance(q, Question)
    with pytest.raises(Exception):
        q.id = "other"  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------- errors (§2)


@pytest.mark.parametrize("body", [[], "x", 3, None, True, [{"state": "s"}]])
def test_top_level_not_object(body):
    assert_error(body, "request body must be a JSON object")


def test_model_not_loaded():
    assert_error(req({"q": noul()}, model="other"), "requested model is not loaded", served_models={"open-jev"})
    assert_error(req({"q": noul()}, model="open-jev"), "requested model is not loaded")
    assert_error(req({"q": noul()}, model=5), "requested model is not loaded", served_models={"open-jev"})


def test_model_checked_before_state():
    assert_error({"model": "nope", "state": 5}, "requested model is not loaded", served_models={"m"})


def test_state_missing():
    assert_error({"questions": {"q": noul()}}, "request requires state")
    assert_error({}, "request requires state")


@pytest.mark.parametrize("state", [True, False, None, 0, 1.5, -3])
def test_state_wrong_type(state):
    assert_error(req({"q": noul()}, state=state), "state must be text, a JSON object, or an array")


def test_bad_state_and_bad_questions_reports_state():
    assert_error({"state": True, "questions": "nope"}, "state must be text, a JSON object, or an array")
    assert_error({"questions": []}, "request requires state")


@pytest.mark.parametrize("questions", [None, [], "q", 3, [noul()], True])
def test_questions_not_object(questions):
    assert_error(req(questions), "questions must be an object")


def test_questions_missing():
    assert_error({"state": "s"}, "questions must be an object")


def test_questions_empty_or_too_many():
    assert_error(req({}), "questions must be nonempty and within the server question limit")
    too_many = {f"q{i}": noul() for i in range(4097)}
    assert_error(req(too_many), "questions must be nonempty and within the server question limit")
    ok = {f"q{i}": noul() for i in range(4096)}
    assert parse_request(req(ok)).candidate_count == 4096


def test_question_count_checked_before_question_definitions():
    too_many = {f"q{i}": 5 for i in range(4097)}
    assert_error(req(too_many), "questions must be nonempty and within the server question limit")


@pytest.mark.parametrize("definition", [None, "choice", 1, ["type"], True])
def test_question_definition_not_object(definition):
    assert_error(req({"q": definition}), "question definition must be an object")


@pytest.mark.parametrize("instructions", [None, 1, 2.5, True, False])
def test_instructions_wrong_type(instructions):
    assert_error(req({"q": choice("a", instructions=instructions)}), MSG_TEXT)


def test_instructions_missing():
    assert_error(req({"q": {"type": "noul"}}), MSG_TEXT)


def test_instructions_checked_before_type_and_criteria():
    assert_error(req({"q": {"type": "bogus", "instructions": 3}}), MSG_TEXT)
    assert_error(req({"q": {"type": "choice", "instructions": None, "criteria": []}}), MSG_TEXT)


@pytest.mark.parametrize("qtype", ["bogus", None, 3, "Choice", "", ["choice"]])
def test_question_type_invalid(qtype):
    assert_error(req({"q": {"type": qtype, "instructions": "i", "criteria": {"a": None}}}),
                 "question type must be choice, score, or noul")


def test_question_type_missing():
    assert_error(req({"q": {"instructions": "i"}}), "question type must be choice, score, or noul")


@pytest.mark.parametrize("criteria", [None, ["a"], "a", 3, True])
def test_choice_criteria_not_object(criteria):
    assert_error(req({"q": {"type": "choice", "instructions": "i", "criteria": criteria}}), "Choice requires an object")


def test_choice_criteria_missing():
    assert_error(req({"q": {"type": "choice", "instructions": "i"}}), "Choice requires an object")


def test_choice_count_limits():
    msg = "Choice requires between 1 and 255 candidates"
    assert_error(req({"q": choice()}), msg)
    assert_error(req({"q": choice(*[f"o{i}" for i in range(256)])}), msg)
    parsed = parse_request(req({"q": choice(*[f"o{i}" for i in range(255)])}))
    assert parsed.candidate_count == 255


@pytest.mark.parametrize("description", [1, 0.5, True, False])
def test_choice_bad_description(description):
    assert_error(req({"q": {"type": "choice", "instructions": "i", "criteria": {"a": None, "b": description}}}), MSG_TEXT)


def test_choice_count_checked_before_descriptions():
    crit = {f"o{i}": 1 for i in range(256)}
    assert_error(req({"q": {"type": "choice", "instructions": "i", "criteria": crit}}),
                 "Choice requires between 1 and 255 candidates")


@pytest.mark.parametrize("criteria", [None, {"0": "a", "1": "b"}, "ab", 2])
def test_score_not_array(criteria):
    assert_error(req({"q": {"type": "score", "instructions": "i", "criteria": criteria}}), "Score requires an array")


def test_score_missing_criteria():
    assert_error(req({"q": {"type": "score", "instructions": "i"}}), "Score requires an array")


def test_score_count_limits():
    msg = "Score requires 2 to 10 descriptive levels"
    assert_error(req({"q": score()}), msg)
    assert_error(req({"q": score("a")}), msg)
    assert_error(req({"q": score(*"abcdefghijk")}), msg)
    assert parse_request(req({"q": score(*"abcdefghij")})).candidate_count == 10
    assert parse_request(req({"q": score("a", "b")})).candidate_count == 2


@pytest.mark.parametrize("level", [None, 1, 2.0, True])
def test_score_bad_level(level):
    assert_error(req({"q": score("a", level, "c")}), MSG_TEXT)


def test_score_count_checked_before_levels():
    assert_error(req({"q": score(None)}), "Score requires 2 to 10 descriptive levels")


@pytest.mark.parametrize(
    "criteria",
    [
        {},
        {"true": "y"},
        {"false": "n"},
        {"true": "y", "false": "n", "maybe": "m"},
        {"True": "y", "False": "n"},
        "yes",
        ["true", "false"],
        3,
    ],
)
def test_noul_bad_criteria(criteria):
    assert_error(req({"q": {"type": "noul", "instructions": "i", "criteria": criteria}}),
                 "Noul criteria must contain true and false descriptions")


@pytest.mark.parametrize("criteria", [{"true": None, "false": "n"}, {"true": "y", "false": 0}, {"true": True, "false": "n"}])
def test_noul_bad_criteria_values(criteria):
    assert_error(req({"q": {"type": "noul", "instructions": "i", "criteria": criteria}}), MSG_TEXT)


def test_first_bad_question_reported_before_second():
    questions = {
        "good": noul(),
        "bad1": {"type": "score", "instructions": "i", "criteria": ["only"]},
        "bad2": {"type": "choice", "instructions": "i", "criteria": []},
    }
    assert_error(req(questions), "Score requires 2 to 10 descriptive levels")
    questions = {"bad2": questions["bad2"], "bad1": questions["bad1"]}
    assert_error(req(questions), "Choice requires an object")
    assert_error(req({"a": noul(), "b": 7, "c": {"type": "x", "instructions": "i"}}), "question definition must be an object")


def test_candidate_limit_exact_and_over():
    # 257 choices x 255 = 65535, then one noul = 65536 (ok), another noul = 65537 (too many).
    questions = {f"c{i}": choice(*[f"o{j}" for j in range(255)]) for i in range(257)}
    questions["n1"] = noul()
    parsed = parse_request(req(questions))
    assert parsed.candidate_count == 65536
    questions["n2"] = noul()
    assert_error(req(questions), "request exceeds the candidate limit")


def test_candidate_limit_checked_after_the_question_that_crosses_it():
    questions = {f"c{i}": choice(*[f"o{j}" for j in range(255)]) for i in range(257)}
    questions["cross"] = choice("a", "b")  # total 65537 after this question
    questions["bad"] = {"type": "score", "instructions": "i", "criteria": ["x"]}  # later error is never reached
    assert_error(req(questions), "request exceeds the candidate limit")
    # A bad question before the crossing one wins.
    bad_first = {"bad": questions["bad"], **{k: v for k, v in questions.items() if k != "bad"}}
    assert_error(req(bad_first), "Score requires 2 to 10 descriptive levels")
    # The crossing question itself is fully validated first.
    crossing_bad = {f"c{i}": choice(*[f"o{j}" for j in range(255)]) for i in range(257)}
    crossing_bad["cross"] = {"type": "choice", "instructions": "i", "criteria": {"a": None, "b": 1}}
    assert_error(req(crossing_bad), MSG_TEXT)


# -------------------------------------------------------------------------------------------- tokenization (§2.7)


def char_encode(text):
    return [ord(c) for c in text]


def test_tokenize_shapes_wrapping_and_order():
    parsed = parse_request(req({"b": choice("x", "y"), "a": noul()}))
    seen = []

    def encode(text):
        seen.append(text)
        return char_encode(text)

    ids = tokenize_candidates(parsed, encode, chat_prefix="<P>", chat_suffix="<S>", max_length=10_000)
    assert seen == ["<P>" + p + "<S>" for q in parsed.questions for p in q.prompts]
    assert [len(q) for q in ids] == [2, 1]
    assert ids[0][1] == char_encode("<P>" + parsed.questions[0].prompts[1] + "<S>")
    assert sum(len(c) for q in ids for c in q) == sum(len(t) for t in seen)


def test_tokenize_exact_max_length_passes_and_one_over_fails():
    parsed = parse_request(req({"q": noul()}))
    n = len("<" + parsed.questions[0].prompts[0] + ">")
    ids = tokenize_candidates(parsed, char_encode, chat_prefix="<", chat_suffix=">", max_length=n)
    assert len(ids[0][0]) == n
    with pytest.raises(RequestError) as info:
        tokenize_candidates(parsed, char_encode, chat_prefix="<", chat_suffix=">", max_length=n - 1)
    assert info.value.status == 422
    assert info.value.message == f"question q: {n} tokens exceeds max_length={n - 1}; no silent truncation"


def test_tokenize_names_first_offending_question_and_stops():
    parsed = parse_request(
        req({"short": noul("a"), "long1": choice("x", "a much much longer option"), "long2": noul("z" * 500)})
    )
    lengths = [[len(p) for p in q.prompts] for q in parsed.questions]
    limit = lengths[0][0]
    assert lengths[1][0] > limit and lengths[1][1] > lengths[1][0]
    calls = []

    def encode(text):
        calls.append(text)
        return char_encode(text)

    with pytest.raises(RequestError) as info:
        tokenize_candidates(parsed, encode, chat_prefix="", chat_suffix="", max_length=limit)
    assert str(info.value) == (
        f"question long1: {lengths[1][0]} tokens exceeds max_length={limit}; no silent truncation"
    )
    assert len(calls) == 2  # nothing after the first offender is tokenized


def test_tokenize_nothing_over_max_length_passes():
    parsed = parse_request(req({f"q{i}": noul("x" * i) for i in range(20)}))
    for limit in range(150, 190):
        try:
            ids = tokenize_candidates(parsed, char_encode, chat_prefix="", chat_suffix="", max_length=limit)
        except RequestError as err:
            assert "exceeds max_length=%d" % limit in err.message
            continue
        assert all(len(c) <= limit for q in ids for c in q)


# -------------------------------------------------------------------------------------------------- answers (§5)


def approx(a, b):
    return math.isclose(a, b, rel_tol=0.0, abs_tol=TOL)


P3 = [0.21343437444688138, 0.3166841593736535, 0.4698814661794651]


def parsed_for(questions):
    return parse_request(req(questions))


def test_worked_example_choice_three():
    parsed = parsed_for({"t": choice("billing", "security", "technical")})
    ans = answers_from_scores(parsed, [[-2.0, -1.0, 0.0]], T)["t"]
    assert list(ans) == ["type", "choice", "probabilities", "confidence"]
    assert ans["type"] == "choice"
    assert ans["choice"] == "technical"
    assert list(ans["probabilities"]) == ["billing", "security", "technical"]
    for got, want in zip(ans["probabilities"].values(), P3):
        assert approx(got, want)
    assert approx(ans["confidence"], 0.20482219926919762)


def test_worked_example_score_three():
    parsed = parsed_for({"s": score("low", {"mid": 1}, "high")})
    ans = answers_from_scores(parsed, [[-2, -1, 0]], T)["s"]
    assert list(ans) == ["type", "score", "probabilities", "confidence", "legend"]
    assert ans["type"] == "score"
    assert approx(ans["score"], 1.2564470917325836)
    assert list(ans["probabilities"]) == ["0", "1", "2"]
    for got, want in zip(ans["probabilities"].values(), P3):
        assert approx(got, want)
    assert ans["confidence"] == 0.0
    assert ans["legend"] == {"0": "low", "1": {"mid": 1}, "2": "high"}
    assert list(ans["legend"]) == ["0", "1", "2"]


def test_worked_example_noul():
    ans = answers_from_scores(parsed_for({"n": noul()}), [[1.0]], T)["n"]
    assert list(ans) == ["type", "noul"]
    assert ans["type"] == "noul"
    assert approx(ans["noul"], 0.5973836777434065)


def test_worked_example_choice_tie_first_wins():
    ans = answers_from_scores(parsed_for({"c": choice("first", "second")}), [[0.0, 0.0]], T)["c"]
    assert ans["choice"] == "first"
    assert ans["probabilities"] == {"first": 0.5, "second": 0.5}
    assert approx(ans["confidence"], 0.0)
    # Tie resolved by request order, not key order.
    ans = answers_from_scores(parsed_for({"c": choice("zeta", "alpha")}), [[1.5, 1.5]], T)["c"]
    assert ans["choice"] == "zeta"


@pytest.mark.parametrize("s", [0.0, -50.0, 1234.5, 1e-300])
def test_worked_example_choice_single(s):
    ans = answers_from_scores(parsed_for({"c": choice("only")}), [[s]], T)["c"]
    assert ans == {"type": "choice", "choice": "only", "probabilities": {"only": 1.0}, "confidence": 1.0}


def test_worked_example_score_four():
    parsed = parsed_for({"s": score("a", "b", "c", "d")})
    ans = answers_from_scores(parsed, [[0.3, 2.0, -1.0, 0.5]], T)["s"]
    want = [0.2156753093268454, 0.42180894648084993, 0.12913080615523984, 0.2333849380370648]
    assert list(ans["probabilities"]) == ["0", "1", "2", "3"]
    for got, w in zip(ans["probabilities"].values(), want):
        assert approx(got, w)
    assert approx(ans["score"], 1.380225372902524)
    assert approx(ans["confidence"], 0.18842400844378515)


def test_all_worked_examples_in_one_request_kept_in_order():
    parsed = parsed_for(
        {
            "z": choice("billing", "security", "technical"),
            "y": score("a", "b", "c"),
            "x": noul(),
            "w": choice("first", "second"),
            "v": choice("only"),
            "u": score("a", "b", "c", "d"),
        }
    )
    answers = answers_from_scores(
        parsed, [[-2, -1, 0], [-2, -1, 0], [1.0], [0, 0], [7.0], [0.3, 2.0, -1.0, 0.5]], T
    )
    assert list(answers) == ["z", "y", "x", "w", "v", "u"]
    assert answers["z"]["choice"] == "technical"
    assert approx(answers["y"]["score"], 1.2564470917325836)
    assert approx(answers["x"]["noul"], 0.5973836777434065)
    assert answers["w"]["choice"] == "first"
    assert answers["v"]["confidence"] == 1.0
    assert approx(answers["u"]["confidence"], 0.18842400844378515)


def test_answers_independent_per_question():
    # Same scores for one question give the same answer regardless of other questions' scores.
    alone = answers_from_scores(parsed_for({"a": choice("x", "y")}), [[0.1, 0.4]], T)["a"]
    together = answers_from_scores(parsed_for({"a": choice("x", "y"), "b": choice("p", "q")}), [[0.1, 0.4], [100.0, -100.0]], T)
    assert together["a"] == alone


def test_softmax_stable_for_large_scores():
    ans = answers_from_scores(parsed_for({"c": choice("a", "b"), "n": noul()}), [[1000.0, 1000.0], [-5000.0]], T)
    assert ans["c"]["probabilities"] == {"a": 0.5, "b": 0.5}
    assert ans["n"]["noul"] == 0.0
    ans = answers_from_scores(parsed_for({"n": noul()}), [[5000.0]], T)
    assert ans["n"]["noul"] == 1.0


def test_score_confidence_certain_and_clamped():
    ans = answers_from_scores(parsed_for({"s": score("a", "b")}), [[0.0, 500.0]], 1.0)["s"]
    assert ans["score"] == 1.0 and ans["confidence"] == 1.0
    ans = answers_from_scores(parsed_for({"s": score("a", "b")}), [[0.0, 0.0]], 1.0)["s"]
    # U = 0.5, sum p|i-mode| = 0.5 -> confidence 0.0
    assert ans["score"] == 0.5 and ans["confidence"] == 0.0


def test_temperature_applied():
    a1 = answers_from_scores(parsed_for({"n": noul()}), [[1.0]], 1.0)["n"]["noul"]
    assert approx(a1, 1.0 / (1.0 + math.exp(-1.0)))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_scores_raise_value_error_not_request_error(bad):
    parsed = parsed_for({"c": choice("a", "b")})
    with pytest.raises(ValueError) as info:
        answers_from_scores(parsed, [[0.0, bad]], T)
    assert not isinstance(info.value, RequestError)


def test_score_shape_mismatch_raises():
    parsed = parsed_for({"c": choice("a", "b")})
    with pytest.raises(ValueError):
        answers_from_scores(parsed, [[0.0]], T)
    with pytest.raises(ValueError):
        answers_from_scores(parsed, [], T)


# ------------------------------------------------------------------------------------------------- response (§6)


def test_build_response_key_order():
    answers = {"q": {"type": "noul", "noul": 0.5}}
    meta = {"method": "m", "temperature": T}
    resp = build_response(model_id="Qwen/Base", answers=answers, input_tokens=42, metadata=meta)
    assert list(resp) == ["model", "answers", "usage", "metadata"]
    assert resp["model"] == "Qwen/Base"
    assert resp["answers"] == answers
    assert resp["usage"] == {"input_tokens": 42, "output_tokens": 0}
    assert list(resp["usage"]) == ["input_tokens", "output_tokens"]
    assert resp["metadata"] == meta

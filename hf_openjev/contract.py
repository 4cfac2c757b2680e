"""The Open-Jev decision contract: request validation, prompts, answers and response.

This module implements ``docs/contract.md`` in pure Python (``json`` and ``math`` only; no torch),
so the pipeline, the evaluation command and the HTTP server all share one definition of:

* :func:`parse_request` -- validation in the contract's order (§2 items 2..6, first error wins) and the
  candidate prompts of every question (§3);
* :func:`tokenize_candidates` -- the ``max_length`` check of §2 item 7 (nothing is ever truncated; a huge
  over-long text is refused from a clean prefix already over the limit);
* :func:`answers_from_scores` -- the float64 answers of §5;
* :func:`build_response` -- the response object of §6;
* :data:`KINDS` -- the question kinds: per kind its parser, its answer, how its probabilities are read, THE decision
  rule and THE near-tie rule (docs/design.md "Numerics"), for the pipeline, eval, export verification, the
  fidelity gate and the recipes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence

from hf_openjev.errors import RequestError
from hf_openjev.tokenizer.candidate_tokens import EXACT_COUNT_CHARS, CandidateEncoder

__all__ = [
    "DIFFERING_READINGS",
    "EXACT_COUNT_CHARS",
    "KINDS",
    "KIND_NAMES",
    "MAX_CANDIDATES",
    "MAX_CHOICE_OPTIONS",
    "MAX_QUESTIONS",
    "MAX_SCORE_LEVELS",
    "MIN_SCORE_LEVELS",
    "NEAR_TIE_MARGIN",
    "ParsedRequest",
    "Question",
    "QuestionKind",
    "RequestError",
    "answers_from_scores",
    "build_response",
    "candidate_prompt",
    "noul_prompt",
    "parse_request",
    "question_head",
    "render",
    "shared_head",
    "token_budget_error",
    "tokenize_candidates",
]

# --- limits (docs/contract.md §1) ----------------------------------------------------------------------------------
MAX_QUESTIONS = 4096
MAX_CANDIDATES = 65536
MAX_CHOICE_OPTIONS = 255
MIN_SCORE_LEVELS = 2
MAX_SCORE_LEVELS = 10

# --- error messages (docs/contract.md §2) --------------------------------------------------------------------------
MSG_NOT_OBJECT = "request body must be a JSON object"
MSG_MODEL = "requested model is not loaded"
MSG_STATE_MISSING = "request requires state"
MSG_STATE_TYPE = "state must be text, a JSON object, or an array"
MSG_QUESTIONS_TYPE = "questions must be an object"
MSG_QUESTIONS_COUNT = "questions must be nonempty and within the server question limit"
MSG_DEFINITION = "question definition must be an object"
MSG_TEXT = "instructions and descriptions must be text, an object, or an array"
MSG_CHOICE_TYPE = "Choice requires an object"
MSG_CHOICE_COUNT = "Choice requires between 1 and 255 candidates"
MSG_SCORE_TYPE = "Score requires an array"
MSG_SCORE_COUNT = "Score requires 2 to 10 descriptive levels"
MSG_NOUL_CRITERIA = "Noul criteria must contain true and false descriptions"
MSG_TYPE = "question type must be choice, score, or noul"
MSG_CANDIDATES = "request exceeds the candidate limit"
MSG_TOO_MANY_TOKENS = "request exceeds the server's input token limit"  # then ": <n> tokens > max_request_tokens=<m>"

# --- prompt pieces (docs/contract.md §3) ---------------------------------------------------------------------------
_PROPOSED = "Proposed answer: "
_PROPOSED_TAIL = "\nIs this proposed answer correct? Answer Yes or No."
_NOUL_TAIL = "Is the answer to this question yes? Answer Yes or No."


def _is_text(value: Any) -> bool:
    """True for a string, JSON object or JSON array (contract: "text, an object, or an array").

    Numbers, booleans and ``None`` are not. A Python tuple counts as an array (``json.dumps`` writes it as one).
    """
    return isinstance(value, (str, dict, list, tuple))


def _is_array(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _kind(value: Any) -> str:
    """What a value is, in JSON words, for error details (``"an array"``, ``"a number"``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "an array"
    return f"a {type(value).__name__}"


def _field(definition: dict, key: str) -> str:
    """``"<key> is missing"`` or ``"<key> is <kind>"`` for a question field."""
    return f"{key} is missing" if key not in definition else f"{key} is {_kind(definition[key])}"


def render(value: Any) -> str:
    """Render a state, instructions, description or level as prompt text (docs/contract.md §3).

    A string is used verbatim; an object or array becomes ``json.dumps(v, ensure_ascii=False, sort_keys=True)``
    (keys sorted recursively, arrays kept in order, unicode kept, floats as Python prints them).
    """
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def shared_head(state_text: str) -> str:
    """The start of every candidate prompt of a request: ``"Context:\\n" + S + "\\n\\nQuestion:"`` (a space follows)."""
    return "Context:\n" + state_text + "\n\nQuestion:"


def question_head(state_text: str, question_text: str) -> str:
    """The head shared by every candidate of a question: ``"Context:\\n" + S + "\\n\\nQuestion: " + Q + "\\n"``."""
    return shared_head(state_text) + " " + question_text + "\n"


def candidate_prompt(head: str, option: str) -> str:
    """A choice or score candidate prompt for one rendered OPTION."""
    return head + _PROPOSED + option + _PROPOSED_TAIL


def noul_prompt(head: str) -> str:
    """The single noul (yes/no) candidate prompt."""
    return head + _NOUL_TAIL


@dataclass(frozen=True)
class Question:
    """One validated question with its candidate prompts, in request order.

    ``labels`` are the choice option keys in request order, ``"0".."n-1"`` for a score, ``("yes",)`` for a noul.
    ``prompts`` holds one user prompt per candidate (same order as ``labels``), without the chat prefix/suffix.
    ``legend`` is ``{"0": level0, ...}`` (levels as given) for a score, else ``None``.
    """

    id: str
    type: str
    labels: tuple[str, ...]
    prompts: tuple[str, ...]
    legend: dict | None = None


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: the requested model (or ``None``) and its questions in request order; ``shared_text``:
    the start of every candidate prompt (:func:`shared_head`), "" when not known (a request built by hand)."""

    model: str | None
    questions: tuple[Question, ...]
    shared_text: str = ""

    @property
    def candidate_count(self) -> int:
        """Total number of candidate sequences over all questions."""
        return sum(len(q.prompts) for q in self.questions)


def _parse_question(qid: str, definition: Any, state_text: str) -> Question:
    """Validate one question (docs/contract.md §2 item 6) and build its prompts (§3), by its kind's parser.

    Every error carries the contract's message plus a ``detail`` naming the question and the field.
    """
    where = f"question {qid!r}"
    if not isinstance(definition, dict):
        raise RequestError(MSG_DEFINITION, detail=f"{where}: the definition is {_kind(definition)}, not an object "
                                                  "with type, instructions and criteria")
    instructions = definition.get("instructions")
    if not _is_text(instructions):
        raise RequestError(MSG_TEXT, detail=f"{where}: {_field(definition, 'instructions')}; instructions must be "
                                            "text, an object or an array")
    qtype = definition.get("type")
    kind = KINDS.get(qtype) if isinstance(qtype, str) else None
    if kind is None:
        got = f"type is {qtype!r}" if isinstance(qtype, str) else _field(definition, "type")
        raise RequestError(MSG_TYPE, detail=f"{where}: {got}; use 'choice', 'score' or 'noul'")
    return kind.parse(qid, definition, state_text)


def _parse_choice(qid: str, definition: dict, state_text: str) -> Question:
    where, criteria = f"question {qid!r}", definition.get("criteria")
    if not isinstance(criteria, dict):
        raise RequestError(MSG_CHOICE_TYPE, detail=f"{where}: {_field(definition, 'criteria')}; a choice question "
                                                   "needs an object mapping each option to its description "
                                                   "(or null)")
    if not 1 <= len(criteria) <= MAX_CHOICE_OPTIONS:
        raise RequestError(MSG_CHOICE_COUNT, detail=f"{where}: criteria has {len(criteria)} options; a choice "
                                                    f"question needs 1 to {MAX_CHOICE_OPTIONS}")
    head = question_head(state_text, render(definition["instructions"]))
    labels, prompts = [], []
    for key, description in criteria.items():
        if not isinstance(key, str):
            raise RequestError(MSG_CHOICE_TYPE, detail=f"{where}: option key {key!r} is not a string")
        if description is None:
            option = key
        elif _is_text(description):
            option = key + ": " + render(description)
        else:
            raise RequestError(MSG_TEXT, detail=f"{where}: the description of option {key!r} is "
                                                f"{_kind(description)}; use text, an object, an array or null")
        labels.append(key)
        prompts.append(candidate_prompt(head, option))
    return Question(qid, "choice", tuple(labels), tuple(prompts), None)


def _parse_score(qid: str, definition: dict, state_text: str) -> Question:
    where, criteria = f"question {qid!r}", definition.get("criteria")
    if not _is_array(criteria):
        raise RequestError(MSG_SCORE_TYPE, detail=f"{where}: {_field(definition, 'criteria')}; a score question "
                                                  f"needs an array of {MIN_SCORE_LEVELS} to {MAX_SCORE_LEVELS} "
                                                  "levels, lowest first")
    if not MIN_SCORE_LEVELS <= len(criteria) <= MAX_SCORE_LEVELS:
        raise RequestError(MSG_SCORE_COUNT, detail=f"{where}: criteria has {len(criteria)} levels; a score "
                                                   f"question needs {MIN_SCORE_LEVELS} to {MAX_SCORE_LEVELS}")
    head = question_head(state_text, render(definition["instructions"]))
    prompts = []
    for i, level in enumerate(criteria):
        if not _is_text(level):
            raise RequestError(MSG_TEXT, detail=f"{where}: level {i} is {_kind(level)}; a level must be text, "
                                                "an object or an array")
        prompts.append(candidate_prompt(head, render(level)))
    labels = tuple(str(i) for i in range(len(criteria)))
    legend = {str(i): level for i, level in enumerate(criteria)}
    return Question(qid, "score", labels, tuple(prompts), legend)


def _parse_noul(qid: str, definition: dict, state_text: str) -> Question:
    where, criteria = f"question {qid!r}", definition.get("criteria")
    question_text = render(definition["instructions"])
    # ``criteria`` is optional; absent and null both mean "no criteria".
    if criteria is not None:
        if not isinstance(criteria, dict) or set(criteria) != {"true", "false"}:
            got = (f"has keys {sorted(map(str, criteria))}" if isinstance(criteria, dict)
                   else f"is {_kind(criteria)}")
            raise RequestError(MSG_NOUL_CRITERIA, detail=f"{where}: criteria {got}; a noul question takes "
                                                         "criteria {\"true\": ..., \"false\": ...} or none")
        for key in ("true", "false"):
            if not _is_text(criteria[key]):
                raise RequestError(MSG_TEXT, detail=f"{where}: criteria.{key} is {_kind(criteria[key])}; use "
                                                    "text, an object or an array")
        question_text += "\nYes means: " + render(criteria["true"]) + "\nNo means: " + render(criteria["false"])
    head = question_head(state_text, question_text)
    return Question(qid, "noul", NOUL_CANDIDATES, (noul_prompt(head),), None)


def parse_request(request: Any, *, served_models: Collection[str] = ()) -> ParsedRequest:
    """Validate a decoded request and build every candidate prompt.

    Checks follow docs/contract.md §2 items 2..6 in order and the first error wins; each raises
    :class:`~hf_openjev.errors.RequestError` (status 422) with the contract's exact message and a ``detail`` that
    names the question and field at fault (served model names, for an unknown ``model``). Decoding the JSON
    body (and the 413/415 checks) is the server's job. ``model`` given (not ``None``) and not in
    ``served_models`` is rejected. The candidate limit is checked after each question.
    """
    if not isinstance(request, dict):
        raise RequestError(MSG_NOT_OBJECT, detail=f"the request is {_kind(request)}")

    model = request.get("model")
    if model is not None and (not isinstance(model, str) or model not in served_models):
        served = ", ".join(repr(name) for name in dict.fromkeys(served_models)) or "none"
        asked = repr(model) if isinstance(model, str) else _kind(model)
        raise RequestError(MSG_MODEL, detail=f"model {asked} is not served here; served: {served} (or leave model "
                                             "out)")

    if "state" not in request:
        raise RequestError(MSG_STATE_MISSING, detail="the request has no state field")
    state = request["state"]
    if not _is_text(state):
        raise RequestError(MSG_STATE_TYPE, detail=f"state is {_kind(state)}")

    questions = request.get("questions")
    if not isinstance(questions, dict) or not all(isinstance(k, str) for k in questions):
        got = _field(request, "questions") if not isinstance(questions, dict) else "a question id is not a string"
        raise RequestError(MSG_QUESTIONS_TYPE, detail=f"{got}; questions must map question ids to definitions")
    if not 1 <= len(questions) <= MAX_QUESTIONS:
        raise RequestError(MSG_QUESTIONS_COUNT, detail=f"questions has {len(questions)} entries; 1 to "
                                                       f"{MAX_QUESTIONS} are accepted")

    state_text = render(state)
    parsed: list[Question] = []
    total = 0
    for qid, definition in questions.items():
        question = _parse_question(qid, definition, state_text)
        parsed.append(question)
        total += len(question.prompts)
        if total > MAX_CANDIDATES:
            raise RequestError(MSG_CANDIDATES, detail=f"question {qid!r} brings the request to {total} candidate "
                                                      f"sequences, over the limit of {MAX_CANDIDATES}")
    return ParsedRequest(model=model, questions=tuple(parsed), shared_text=shared_head(state_text))


def tokenize_candidates(
    parsed: ParsedRequest,
    encode: Callable[[str], list[int]],
    *,
    chat_prefix: str,
    chat_suffix: str,
    max_length: int,
    clean_cut: Callable[[str, int], int | None] | None = None,
    token_floor: Callable[[str], int] | None = None,
    max_total_tokens: int | None = None,
    shares_prefixes: bool = False,
    split_shared: bool = False,
    encode_many: Callable[[list[str]], list[list[int]]] | None = None,
) -> list[list[list[int]]]:
    """Tokenize every candidate, question by question, candidate by candidate (docs/contract.md §2 item 7).

    The text is ``chat_prefix + prompt + chat_suffix``; ``encode`` must add no special tokens. The first sequence
    longer than ``max_length`` raises ``RequestError("question <id>: <n> tokens exceeds max_length=<m>; no silent
    truncation")``; nothing is truncated. Returns token ids per question per candidate: each the whole text's ids.

    ``split_shared``: ``encode`` is proven to split at clean cuts
    (:func:`hf_openjev.tokenizer.tokenizer_analysis.prove_clean_splits`): ``chat_prefix + parsed.shared_text`` is
    tokenized once and each candidate's rest on its own
    (:class:`~hf_openjev.tokenizer.candidate_tokens.CandidateEncoder`); a request of one candidate is tokenized whole
    (one call, nothing to share). ``encode_many`` (only with ``split_shared``): several texts' ids in one call, for
    long texts tokenized in pieces on the tokenizer's threads
    (:func:`~hf_openjev.tokenizer.candidate_tokens.cut_into_pieces`), and for a short request's candidates, all in
    one call before they are checked one by one (``CandidateEncoder.tokenize_together``).

    ``clean_cut(text, start, end)``: the first position ``start <= c <= end`` where ``encode(text[:c])`` is a prefix of
    ``encode(text)``, or None (:func:`hf_openjev.tokenizer.tokenizer_analysis.prove_clean_cuts`). With it, a candidate of more
    than ``EXACT_COUNT_CHARS * max_length`` characters is first tokenized in growing prefixes ending at such cuts, and
    rejected as soon as one has more than ``max_length`` tokens: the verdict is the full tokenization's (a clean
    prefix's count is a lower bound of the whole's), ``<n>`` is then that prefix's count (a lower bound, already over
    ``max_length``, not the exact count) and the seconds of tokenizing megabytes are saved. Accepted candidates, and
    every candidate of at most ``EXACT_COUNT_CHARS * max_length`` characters, are tokenized in full (exact ``<n>``).
    ``token_floor(text)``: a lower bound of the text's token count from its bytes
    (:func:`hf_openjev.tokenizer.tokenizer_analysis.prove_token_floor`), tried first on such long candidates, so that a text without
    clean cuts (digits, CJK) is refused without tokenizing it either.

    ``max_total_tokens``: the request's budget over all its sequences; tokenization stops at the first candidate
    that takes the running total past it, with ``RequestError`` (status 413, :data:`MSG_TOO_MANY_TOKENS`) naming
    the count so far and the limit: at most ``max_total_tokens + max_length`` tokens are ever computed.
    ``shares_prefixes``: the budget counts the fast path's work (shared prefixes once), through a running lower bound
    of it (:class:`~hf_openjev.work_tokens.WorkFloor`); the exact count is the caller's, once every candidate is
    tokenized (:func:`hf_openjev.scoring.tokenize_request`). Default: every sequence in full (the reference path).
    """
    from .work_tokens import WorkFloor

    encoder = CandidateEncoder(encode, chat_prefix=chat_prefix, chat_suffix=chat_suffix, max_length=max_length,
                               clean_cut=clean_cut, token_floor=token_floor,
                               shared=parsed.shared_text if split_shared and parsed.candidate_count > 1 else None,
                               encode_many=encode_many if split_shared else None)
    encoder.tokenize_together(prompt for question in parsed.questions for prompt in question.prompts)
    result: list[list[list[int]]] = []
    floor = WorkFloor(shares_prefixes)
    for question in parsed.questions:
        per_question: list[list[int]] = []
        for prompt in question.prompts:
            ids = encoder.encode(question.id, prompt)
            per_question.append(ids)
            total = floor.add(len(result), ids)
            if max_total_tokens is not None and total > max_total_tokens:
                raise token_budget_error(total, max_total_tokens, question.id, shared_once=shares_prefixes)
        result.append(per_question)
    return result


def token_budget_error(count: int, limit: int, question_id=None, *, shared_once: bool) -> RequestError:
    """The 413 of a request whose work is at least ``count`` tokens, over ``limit`` (``max_request_tokens``), past it
    at question ``question_id`` (None: the whole request);
    ``shared_once``: counted as the fast path computes it (shared prefixes once), else every sequence in full."""
    what = "tokens of work (shared prefixes once)" if shared_once else "input tokens"
    where = "the request" if question_id is None else f"question {question_id!r}"
    return RequestError(f"{MSG_TOO_MANY_TOKENS}: at least {count} {what} > max_request_tokens={limit}", status=413,
                        detail=f"{where} takes the request past {limit} {what}; send fewer questions or "
                               "candidates, or shorter texts")


def _softmax(scores: Sequence[float], temperature: float) -> list[float]:
    """``softmax_T`` in float64 with max subtraction (docs/contract.md §5)."""
    top = max(scores)
    exps = [math.exp((s - top) / temperature) for s in scores]
    total = 0.0
    for e in exps:
        total += e
    return [e / total for e in exps]


def first_argmax(values: Sequence[float]) -> int:
    """The first index of the largest value: the contract's decision for choice and score questions."""
    best = 0
    for i in range(1, len(values)):
        if values[i] > values[best]:
            best = i
    return best


def _choice_answer(question: Question, scores: list[float], temperature: float) -> dict:
    p = _softmax(scores, temperature)
    best = first_argmax(p)
    n = len(p)
    confidence = 1.0 if n == 1 else (p[best] - 1.0 / n) / (1.0 - 1.0 / n)
    return {
        "type": "choice",
        "choice": question.labels[best],
        "probabilities": dict(zip(question.labels, p)),
        "confidence": confidence,
    }


def _score_answer(question: Question, scores: list[float], temperature: float) -> dict:
    p = _softmax(scores, temperature)
    n = len(p)
    expected = 0.0
    for i, pi in enumerate(p):
        expected += i * pi
    mode = first_argmax(p)
    centre = (n - 1) / 2.0
    spread = 0.0
    for i in range(n):
        spread += abs(i - centre)
    u = spread / n
    dispersion = 0.0
    for i, pi in enumerate(p):
        dispersion += pi * abs(i - mode)
    confidence = max(0.0, 1.0 - dispersion / u)
    return {
        "type": "score",
        "score": expected,
        "probabilities": dict(zip(question.labels, p)),
        "confidence": confidence,
        "legend": dict(question.legend or {}),
    }


def _noul_answer(question: Question, scores: list[float], temperature: float) -> dict:
    return {"type": "noul", "noul": _softmax([0.0, scores[0]], temperature)[1]}


# --- the question kinds: one table, read by every caller ------------------------------------------------------------

NOUL_CANDIDATES = ("yes",)  # a noul question's one candidate
NOUL_DECISIONS = ("no", "yes")  # what a noul question decides between: logits [0, s] (docs/contract.md §5)
NEAR_TIE_MARGIN = 0.02  # a decision whose top-two probability margin is below this is a near-tie (every kind)


@dataclass(frozen=True)
class QuestionKind:
    """One question kind of docs/contract.md, with every reading of it that the package and the recipes use.

    ``parse(qid, definition, state_text) -> Question``: validation and prompts (§2 item 6, §3);
    ``answer(question, scores [n candidates], temperature) -> dict``: the answer of §5;
    ``probabilities(answer) -> [p per candidate]`` in the candidates' order (noul: ``[p_yes]``), what fidelity
    entries and oracles store; ``decisions``: the labels a kind decides between when they are fixed (noul: no, yes),
    None when they are the candidates' (``answer["probabilities"]``'s keys); ``fixed_candidates``: a kind's
    candidate labels when every question of it has the same ones (noul: yes), else None; ``index_criteria(n)``: the
    criteria of a synthetic question of ``n`` candidates named by their index (the benchmark's workload).
    """

    name: str
    parse: Callable[[str, dict, str], Question]
    answer: Callable[[Question, list[float], float], dict]
    probabilities: Callable[[Mapping], list[float]]
    index_criteria: Callable[[int], Any]
    decisions: tuple[str, ...] | None = None
    fixed_candidates: tuple[str, ...] | None = None

    def distribution(self, probabilities: Sequence[float]) -> list[float]:
        """``[p per candidate]`` -> ``[p per decision label]``: noul ``[p_yes]`` -> ``[1 - p_yes, p_yes]``."""
        if self.decisions is None:
            return [float(p) for p in probabilities]
        if len(probabilities) != 1:
            raise ValueError(f"a {self.name} question has one probability (p_yes), got {len(probabilities)}")
        return [1.0 - float(probabilities[0]), float(probabilities[0])]

    def labels(self, answer: Mapping) -> tuple[str, ...]:
        """The decision labels of an answer, in :meth:`distribution`'s order."""
        return self.decisions if self.decisions is not None else tuple(answer["probabilities"])

    def decide(self, probabilities: Sequence[float]) -> int:
        """THE decision rule (docs/design.md "Numerics"): the first arg-max of :meth:`distribution`, an index into
        :meth:`labels`. For noul that is "yes" (1) iff ``p_yes > 0.5``: exactly 0.5 is "no", the first label."""
        return first_argmax(self.distribution(probabilities))

    def margin(self, probabilities: Sequence[float]) -> float:
        """Top-two margin of :meth:`distribution` (noul: ``|p_yes - p_no| = 2 |p - 0.5|``; one option: its p)."""
        top = sorted(self.distribution(probabilities), reverse=True) + [0.0]
        return top[0] - top[1]

    def near_tie(self, probabilities: Sequence[float]) -> bool:
        """THE near-tie rule: the decision's top-two margin < :data:`NEAR_TIE_MARGIN`."""
        return self.margin(probabilities) < NEAR_TIE_MARGIN

    def decision(self, answer: Mapping) -> str:
        """The label an answer decides (choice: its ``choice``; score: the mode's level; noul: "yes" / "no")."""
        return self.labels(answer)[self.decide(self.probabilities(answer))]


def _candidate_probabilities(answer: Mapping) -> list[float]:
    return [float(p) for p in answer["probabilities"].values()]


def _noul_probabilities(answer: Mapping) -> list[float]:
    return [float(answer["noul"])]


KINDS: dict[str, QuestionKind] = {kind.name: kind for kind in (
    QuestionKind("choice", _parse_choice, _choice_answer, _candidate_probabilities,
                 lambda n: {f"o{i}": None for i in range(n)}),
    QuestionKind("score", _parse_score, _score_answer, _candidate_probabilities,
                 lambda n: [f"level {i}" for i in range(n)]),
    QuestionKind("noul", _parse_noul, _noul_answer, _noul_probabilities, lambda n: None,
                 decisions=NOUL_DECISIONS, fixed_candidates=NOUL_CANDIDATES),
)}
KIND_NAMES = tuple(KINDS)  # the only list of the kinds' names

# Readings that differ from the table on purpose, by who reads them and why.
DIFFERING_READINGS = {
    "hf_openjev.eval.metrics.predict": "exact ties go to the lexicographically smallest label (JevBench's "
                                       "scoring), not the first candidate: differs from decide for a choice "
                                       "question whose tied options are not in sorted order",
}


def answers_from_scores(
    parsed: ParsedRequest, scores: Sequence[Sequence[float]], temperature: float
) -> dict[str, dict]:
    """Turn per-candidate head scores into answers (docs/contract.md §5), in request order.

    ``scores[k][j]`` is the score of candidate ``j`` of question ``k``. All math is float64; each question is
    answered from its own candidates only. Non-finite scores, a bad temperature or a shape mismatch raise
    ``ValueError`` (an inference failure, not a request error).
    """
    temperature = float(temperature)
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ValueError(f"temperature must be a finite positive number, got {temperature!r}")
    if len(scores) != len(parsed.questions):
        raise ValueError(f"expected scores for {len(parsed.questions)} questions, got {len(scores)}")
    answers: dict[str, dict] = {}
    for question, row in zip(parsed.questions, scores):
        values = [float(s) for s in row]
        if len(values) != len(question.prompts):
            raise ValueError(
                f"question {question.id}: expected {len(question.prompts)} scores, got {len(values)}"
            )
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"question {question.id}: non-finite candidate score")
        answers[question.id] = KINDS[question.type].answer(question, values, temperature)
    return answers


def build_response(*, model_id: str, answers: dict, input_tokens: int, metadata: dict) -> dict:
    """The response object of docs/contract.md §6, keys in the contract's order."""
    return {
        "model": model_id,
        "answers": answers,
        "usage": {"input_tokens": int(input_tokens), "output_tokens": 0},
        "metadata": metadata,
    }

"""SystemOne requests: validation, and the Clef prompt with its token spans.

The prompt is tokenized piece by piece exactly as the reference's encode_record does
(the head averages hidden states over the spans of those pieces), from the template
stored in the GGUF file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import RequestError

QUESTION_TYPES = {"noul": 0, "choice": 1, "score": 2}
MAX_QUESTIONS = 64
CHOICE_OPTIONS = (2, 255)
SCORE_LEVELS = (2, 10)
NOUL_OPTIONS = ("true", "false")
Tokenize = Callable[[str], list[int]]
Description = str | dict | list | None


@dataclass(frozen=True)
class Question:
    id: str
    type: str
    instructions: Description
    options: tuple[tuple[str, Description], ...]  # in prompt order (choice: sorted by name)
    levels: tuple[Description, ...] = ()  # score: the criteria list, for the legend
    criteria_order: tuple[str, ...] = ()  # choice: option names as the request lists them

    @property
    def listed(self) -> list[str]:
        """Option names in the request's order, as answers list them."""
        return list(self.criteria_order) or [name for name, _ in self.options]


@dataclass(frozen=True)
class Request:
    model: str | None
    state: str | dict | list
    questions: tuple[Question, ...]


@dataclass(frozen=True)
class EncodedQuestion:
    question: Question
    span: tuple[int, int]  # the instruction tokens
    option_spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class EncodedPrompt:
    request: Request
    tokens: list[int]
    questions: tuple[EncodedQuestion, ...]


def render(value: Any) -> str:
    """Text of a value in the prompt, as the reference renders it."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


# --- Validation -------------------------------------------------------------------------------------------
def _is_description(value: Any) -> bool:
    return value is None or isinstance(value, (str, dict, list))


def _check_description(value: Any, where: str) -> Description:
    if not _is_description(value):
        raise RequestError(f"must be a string, an object, an array or null, not {type(value).__name__}", where)
    return value


def _options(
    qid: str, qtype: str, criteria: Any, template: Mapping[str, str]
) -> tuple[tuple[tuple[str, Description], ...], tuple[Description, ...]]:
    where = f"questions.{qid}.criteria"
    if qtype == "noul":
        if criteria is None:
            criteria = {}
        if not isinstance(criteria, dict) or not set(criteria) <= set(NOUL_OPTIONS):
            raise RequestError('must be null or an object with the keys "true" and/or "false"', where)
        described = {"true": template["noul_true"], "false": template["noul_false"]}
        described |= {k: _check_description(v, f"{where}.{k}") for k, v in criteria.items()}
        return tuple((k, described[k]) for k in NOUL_OPTIONS), ()
    if qtype == "choice":
        low, high = CHOICE_OPTIONS
        if not isinstance(criteria, dict) or not low <= len(criteria) <= high:
            raise RequestError(f"must be an object of {low} to {high} options (option name -> description)", where)
        for name, value in criteria.items():
            if not name:
                raise RequestError("option names must not be empty", where)
            _check_description(value, f"{where}.{name}")
        return tuple(sorted(criteria.items())), ()
    low, high = SCORE_LEVELS
    if not isinstance(criteria, list) or not low <= len(criteria) <= high:
        raise RequestError(f"must be a list of {low} to {high} levels", where)
    levels = tuple(_check_level(v, f"{where}.{i}") for i, v in enumerate(criteria))
    return tuple((str(i), v) for i, v in enumerate(levels)), levels


def _check_level(value: Any, where: str) -> Description:
    # TypeSafe's schema allows no null level (a choice option may be null, a score level may not), and
    # the answer's legend repeats the levels: typesafe-sdk refuses a response whose legend holds a null.
    if value is None:
        raise RequestError("a score level must be a string, an object or an array, not null", where)
    return _check_description(value, where)


def parse_request(body: Any, template: Mapping[str, str]) -> Request:
    """Check a SystemOne request body; raise RequestError naming the field."""
    if not isinstance(body, dict):
        raise RequestError("the request must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("must be a string", "model")
    if "state" not in body:
        raise RequestError("is required", "state")
    state = body["state"]
    if not isinstance(state, (str, dict, list)):
        raise RequestError("must be a string, an object or an array", "state")
    questions = body.get("questions")
    if not isinstance(questions, dict) or not 1 <= len(questions) <= MAX_QUESTIONS:
        raise RequestError(f"must be an object of 1 to {MAX_QUESTIONS} questions", "questions")
    parsed = []
    for qid, q in questions.items():
        if not qid:
            raise RequestError("question ids must not be empty", "questions")
        if not isinstance(q, dict):
            raise RequestError("must be an object", f"questions.{qid}")
        qtype = q.get("type")
        if qtype not in QUESTION_TYPES:
            raise RequestError("must be noul, choice or score", f"questions.{qid}.type")
        instructions = _check_description(q.get("instructions"), f"questions.{qid}.instructions")
        options, levels = _options(qid, qtype, q.get("criteria"), template)
        order = tuple(q["criteria"]) if qtype == "choice" else ()
        parsed.append(Question(qid, qtype, instructions, options, levels, order))
    return Request(model, state, tuple(parsed))


# --- Encoding ---------------------------------------------------------------------------------------------------
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def fill(template: str, **values: str) -> str:
    """`template` with each `{name}` of `values` replaced by its value, in one pass.

    The template comes from the file: it is data, never a format string, so a format spec
    (`{index:>1000000000}`) or a conversion in it is text, not code that runs or allocates.
    Values are inserted as they are, never re-parsed. validate refuses templates with any
    other braces, so for the files it passes this equals str.format.
    """
    return _PLACEHOLDER.sub(lambda m: values.get(m[1], m[0]), template)


def encode(request: Request, template: Mapping[str, str], tokenize: Tokenize) -> EncodedPrompt:
    """Token ids and spans, piece by piece as the reference's encode_record."""
    schema = tokenize(template["schema_header"])
    encoded = []
    for index, q in enumerate(request.questions, start=1):
        schema += tokenize(fill(template["field_header"], index=str(index), id=q.id, type=q.type))
        start = len(schema)
        instructions = q.instructions if q.instructions not in (None, "") else q.id
        schema += tokenize(render(instructions))
        span = (start, len(schema))
        schema += tokenize(template["options_header"])
        option_spans = []
        for option_index, (option_id, description) in enumerate(q.options, start=1):
            schema += tokenize(fill(template["option_header"], index=str(option_index)))
            start = len(schema)
            semantics: dict[str, Any] = {"option_id": option_id}
            if description is not None:
                semantics["description"] = description
            schema += tokenize(render(semantics))
            option_spans.append((start, len(schema)))
            schema += tokenize(template["option_end"])
        schema += tokenize(template["field_end"])
        encoded.append((q, span, option_spans))
    prefix = tokenize(fill(template["prefix"], system=template["system"]))
    state = tokenize(render(request.state))
    suffix = tokenize(template["suffix"])
    offset = len(prefix) + len(state)

    def shift(span: tuple[int, int]) -> tuple[int, int]:
        return (span[0] + offset, span[1] + offset)

    questions = tuple(EncodedQuestion(q, shift(span), tuple(map(shift, spans))) for q, span, spans in encoded)
    return EncodedPrompt(request, prefix + state + schema + suffix, questions)

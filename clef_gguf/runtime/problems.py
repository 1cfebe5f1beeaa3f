"""The runtime's errors as the server's problems: a status, a machine-readable type and a message, or FastAPI's
{loc, msg, type} for a malformed request. Plain data, below the server, so that `clef-gguf decide` writes the very
error objects `clef-gguf serve` answers with (server/problems.py renders them as HTTP).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import PromptTooLongError, RequestError, RequestJsonError

Location = list[str | int]


@dataclass(eq=False)  # exceptions stay hashable
class ApiError(Exception):
    """A non-validation error: its status, a machine-readable type and one line for a person."""

    status: int
    error_type: str
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"detail": {"error_type": self.error_type, "message": self.message}}

    def text(self) -> str:
        return self.message


@dataclass(eq=False)
class Invalid(Exception):
    """A malformed request (422): where, what, and a validation error code."""

    loc: Location
    msg: str
    type: str = "value_error"

    def body(self) -> dict[str, Any]:
        return {"detail": [{"loc": self.loc, "msg": self.msg, "type": self.type}]}

    def text(self) -> str:
        """One line: where, what (["body", "questions", "q", "criteria", 1] -> body.questions.q.criteria.1: ...)."""
        return ".".join(str(part) for part in self.loc) + f": {self.msg}"


def overloaded(message: str, *, close: bool = False) -> ApiError:
    """The one 503: the server is full (intake, queue, replicas); the client may retry in a second."""
    headers = {"Retry-After": "1", **({"Connection": "close"} if close else {})}
    return ApiError(503, "overloaded_error", message, headers)


def internal(error: BaseException) -> ApiError:
    """The one 500: an error the server did not expect, named by its type."""
    return ApiError(500, "api_error", f"internal error: {type(error).__name__}: {error}")


def location(field_path: str | None, body: Any) -> Location:
    """FastAPI-style `loc` of a RequestError's dotted field, e.g. questions.q1.criteria.

    Question ids and option names may themselves hold dots, so the path is split against the
    request it came from: the longest question id of the request that prefixes it wins, and what
    follows `criteria.` is one option name (choice, noul) or a level index (score).
    """
    if not field_path:
        return ["body"]
    head, _, rest = field_path.partition(".")
    if head == "images" and rest.isdigit():  # images.N: the Nth image
        return ["body", "images", int(rest)]
    questions = body.get("questions") if isinstance(body, dict) else None
    if head != "questions" or not rest or not isinstance(questions, dict):
        return ["body", *field_path.split(".")]
    ids = [qid for qid in questions if rest == qid or rest.startswith(f"{qid}.")]
    if not ids:
        return ["body", "questions", rest]
    qid = max(ids, key=len)
    loc: Location = ["body", "questions", qid]
    key, _, option = rest[len(qid) + 1 :].partition(".")
    if key:
        loc.append(key)
    if option:
        criteria = questions[qid].get("criteria") if isinstance(questions[qid], dict) else None
        loc.append(int(option) if isinstance(criteria, list) and option.isdigit() else option)
    return loc


def from_request_error(error: RequestError, body: Any) -> ApiError | Invalid:
    """The HTTP form of the runtime's request errors (PromptTooLongError is one of them)."""
    if isinstance(error, PromptTooLongError):
        return ApiError(413, "prompt_too_long", str(error))
    if isinstance(error, RequestJsonError):  # FastAPI's loc of a syntax error is its offset in the body
        return Invalid(["body", *((error.offset,) if error.offset is not None else error.path)], error.reason, error.kind)
    return Invalid(location(error.field, body), error.reason, "missing" if error.reason == "is required" else "value_error")


def problem_of(error: Exception, body: Any) -> ApiError | Invalid:
    """The problem the server answers an error of deciding `body` with: a RequestError's 4xx (from_request_error),
    and any other (ComputeError, a ModelOutputError's NaN) the server's 500 for an error it did not expect."""
    if isinstance(error, RequestError):
        return from_request_error(error, body)
    return internal(error)


def error_object(problem: ApiError | Invalid) -> dict[str, Any]:
    """A problem as one JSON object: its HTTP status and the server's body ({detail: ...}) for it."""
    return {"status": 422 if isinstance(problem, Invalid) else problem.status, **problem.body()}

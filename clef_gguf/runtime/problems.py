"""The runtime's errors as the server's problems: a row of the problem table (problem_table.py: its status, type,
Workers AI code and headers) and a message, or FastAPI's {loc, msg, type} for a malformed request. Plain data, below
the server, so that `clef-gguf decide` writes the very error objects `clef-gguf serve` answers with
(server/problems.py renders them as HTTP). A new status goes in the table, never here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import (
    AdapterUnavailableError,
    ModelFileError,
    ModelOutputError,
    PromptTooLongError,
    RequestError,
    RequestJsonError,
    SettingsError,
)
from .problem_table import ADAPTER_UNAVAILABLE, INTERNAL, INVALID, OVERLOADED, PROMPT_TOO_LONG, HttpProblem

Location = list[str | int]
# The folders of an absolute path (/srv/tunes/ of /srv/tunes/a.adapter.gguf): where the server keeps its files is
# no client's business, the file's name is. Not after a letter, a dot, a slash or a colon: NaN/Inf, 1/2 and a URL's
# //host/ are no paths.
_FOLDERS = re.compile(r"(?<![\w.~:/-])/(?:[^\s/'\"(),:;]+/)+(?=[^\s/'\"(),:;])")


@dataclass(eq=False)  # exceptions stay hashable
class ApiError(Exception):
    """A non-validation error: its row of the table (`kind`), one line for a person, and its headers: the row's,
    with `headers` on top (ApiError(OVERLOADED, message, {"Connection": "close"}))."""

    kind: HttpProblem
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.headers = {**dict(self.kind.headers), **self.headers}

    @property
    def status(self) -> int:
        return self.kind.status

    @property
    def error_type(self) -> str:
        return self.kind.error_type

    def body(self) -> dict[str, Any]:
        return {"detail": {"error_type": self.error_type, "message": self.message}}

    def text(self) -> str:
        return self.message


@dataclass(eq=False)
class Invalid(Exception):
    """A malformed request (the table's INVALID): where, what, and a validation error code."""

    kind: ClassVar[HttpProblem] = INVALID
    loc: Location
    msg: str
    type: str = "value_error"

    @property
    def status(self) -> int:
        return self.kind.status

    @property
    def headers(self) -> Mapping[str, str]:
        return dict(self.kind.headers)

    def body(self) -> dict[str, Any]:
        return {"detail": [{"loc": self.loc, "msg": self.msg, "type": self.type}]}

    def text(self) -> str:
        """One line: where, what (["body", "questions", "q", "criteria", 1] -> body.questions.q.criteria.1: ...)."""
        return ".".join(str(part) for part in self.loc) + f": {self.msg}"


def overloaded(message: str, *, close: bool = False) -> ApiError:
    """The one OVERLOADED: the server is full (intake, queue, replicas); the client may retry in a second."""
    return ApiError(OVERLOADED, message, {"Connection": "close"} if close else {})


def without_folders(text: str) -> str:
    """A server-side message as a client reads it: each absolute path cut to its file's name."""
    return _FOLDERS.sub("", text)


def internal(error: BaseException) -> ApiError:
    """The one INTERNAL: an error the server did not expect, named by its type (a path in it by its file's name)."""
    return ApiError(INTERNAL, without_folders(f"internal error: {type(error).__name__}: {error}"))


def model_refused(error: Exception, body: Any) -> Invalid:
    """A request naming a model that is served but whose file cannot be used (not an adapter, another base's,
    damaged, a model file): a 422 at the field that named it (Workers AI's `lora`, else `model`), as an unknown name
    gets, the file named without its folder. The request is sound; the client may name another model."""
    named = "lora" if isinstance(body, dict) and body.get("lora") is not None else "model"
    return Invalid(["body", named], without_folders(str(error)), "value_error")


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
        return ApiError(PROMPT_TOO_LONG, str(error))
    if isinstance(error, RequestJsonError):  # FastAPI's loc of a syntax error is its offset in the body
        return Invalid(["body", *((error.offset,) if error.offset is not None else error.path)], error.reason, error.kind)
    return Invalid(location(error.field, body), error.reason, "missing" if error.reason == "is required" else "value_error")


def problem_of(error: Exception, body: Any) -> ApiError | Invalid:
    """The problem the server answers an error of encoding or deciding `body` with: a RequestError's 4xx
    (from_request_error); an adapter whose file is gone or changed for now, ADAPTER_UNAVAILABLE (503, Retry-After); a
    model file that cannot be used (ModelFileError, SettingsError: all a request meets of them is the adapter it
    names), model_refused's 422; any other (ComputeError, a ModelOutputError's NaN) INTERNAL, for an error the server
    did not expect."""
    if isinstance(error, RequestError):
        return from_request_error(error, body)
    if isinstance(error, AdapterUnavailableError):
        return ApiError(ADAPTER_UNAVAILABLE, without_folders(str(error)))
    if isinstance(error, ModelFileError | SettingsError) and not isinstance(error, ModelOutputError):
        return model_refused(error, body)
    return internal(error)


def error_object(problem: ApiError | Invalid) -> dict[str, Any]:
    """A problem as one JSON object: its HTTP status and the server's body ({detail: ...}) for it."""
    return {"status": problem.status, **problem.body()}

"""A request that cannot be decided, as its client reads it: its row of the error table (errors.py: status, System
One type, Workers AI code) and its body, or FastAPI's {loc, msg, type} for a malformed request. No HTTP here: the
server adds its headers and renders it (server/problems.py), and `clef-gguf decide` writes the very same status and
body as the request's error line (error_object), so that both read one table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import INTERNAL, INVALID, ClefError, Problem, RequestError, RequestJsonError

Location = list[str | int]
# The folders of an absolute path (/srv/tunes/ of /srv/tunes/a.adapter.gguf): where the server keeps its files is
# no client's business, the file's name is. Not after a letter, a dot, a slash or a colon: NaN/Inf, 1/2 and a URL's
# //host/ are no paths.
_FOLDERS = re.compile(r"(?<![\w.~:/-])/(?:[^\s/'\"(),:;]+/)+(?=[^\s/'\"(),:;])")


@dataclass(eq=False)  # exceptions stay hashable
class Failure(Exception):
    """A non-validation error: its row of the table (`kind`) and one line for a person."""

    kind: Problem
    message: str

    def body(self) -> dict[str, Any]:
        return {"detail": {"error_type": self.kind.error_type, "message": self.message}}

    def text(self) -> str:
        return self.message


@dataclass(eq=False)
class Invalid(Exception):
    """A malformed request (the table's INVALID): where, what, and a validation error code."""

    kind: ClassVar[Problem] = INVALID
    loc: Location
    msg: str
    type: str = "value_error"

    def body(self) -> dict[str, Any]:
        return {"detail": [{"loc": self.loc, "msg": self.msg, "type": self.type}]}

    def text(self) -> str:
        """One line: where, what (["body", "questions", "q", "criteria", 1] -> body.questions.q.criteria.1: ...)."""
        return ".".join(str(part) for part in self.loc) + f": {self.msg}"


def without_folders(text: str) -> str:
    """A server-side message as a client reads it: each absolute path cut to its file's name."""
    return _FOLDERS.sub("", text)


def internal(error: BaseException) -> Failure:
    """The one INTERNAL: an error the server did not expect, named by its type (a path in it by its file's name)."""
    return Failure(INTERNAL, without_folders(f"internal error: {type(error).__name__}: {error}"))


def model_refused(error: Exception, named_by: str) -> Invalid:
    """A request naming a model that is served but whose file cannot be used (not an adapter, another base's,
    damaged, a model file): a 422 at the field that named it (`named_by`: Workers AI's `lora`, else `model`), as an
    unknown name gets, the file named without its folder. The request is sound; the client may name another model."""
    return Invalid(["body", named_by], without_folders(str(error)), "value_error")


def named_by(body: Any) -> str:
    """The field of a request body, as sent, that names its model: prompt.Request.named_by's rule before parsing."""
    return "lora" if isinstance(body, dict) and body.get("lora") is not None else "model"


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


def from_request_error(error: RequestError, body: Any) -> Failure | Invalid:
    """A request error as its client reads it: a row of its own (PromptTooLongError's, RequestTooLargeError's) with
    its message, else FastAPI's {loc, msg, type} at its field."""
    if error.problem is not INVALID:
        return Failure(error.problem, str(error))
    if isinstance(error, RequestJsonError):  # FastAPI's loc of a syntax error is its offset in the body
        return Invalid(["body", *((error.offset,) if error.offset is not None else error.path)], error.reason, error.kind)
    return Invalid(location(error.field, body), error.reason, "missing" if error.reason == "is required" else "value_error")


def problem_of(error: Exception, body: Any, named: str | None = None) -> Failure | Invalid:
    """What a client is answered for an error of encoding or deciding `body` (the request as sent, or None once it
    is parsed: then `named` is its Request.named_by), by the error's row (errors.py): a RequestError's
    (from_request_error); INVALID for a model file that cannot be used (all a request meets of those is the adapter
    it names: model_refused's 422); INTERNAL for any error the server did not expect (ComputeError, a
    ModelOutputError's NaN, any other exception); any other row with the error's message, its folders cut
    (ADAPTER_UNAVAILABLE: a file gone or changed for now)."""
    if isinstance(error, RequestError):
        return from_request_error(error, body)
    kind = error.problem if isinstance(error, ClefError) else INTERNAL
    if kind is INTERNAL:
        return internal(error)
    if kind is INVALID:
        return model_refused(error, named or named_by(body))
    return Failure(kind, without_folders(str(error)))


def error_object(problem: Failure | Invalid) -> dict[str, Any]:
    """A problem as one JSON object: its row's status and the server's body ({detail: ...}) for it."""
    return {"status": problem.kind.status, **problem.body()}

"""HTTP errors of the server, and the one place where library errors become statuses.

Two shapes, as TypeSafe's API answers: a malformed request gets 422 with `detail` a list of
{loc, msg, type} (FastAPI's shape, which the typesafe-sdk reads); every other error gets
`detail` = {error_type, message}.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import PromptTooLongError, RequestError

Location = list[str | int]


def json_bytes(value: Any) -> bytes:
    """Compact UTF-8 JSON of an error body. A 422 names the field the client sent, and a client can send a
    lone surrogate ("\\ud800") as a key: UTF-8 cannot encode it, so such a body is written with ASCII escapes,
    which is still valid JSON and still decodes to the client's own key."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, allow_nan=False, separators=(",", ":")).encode("ascii")


@dataclass(eq=False)  # exceptions stay hashable
class ApiError(Exception):
    """A non-validation error: its status, a machine-readable type and one line for a person."""

    status: int
    error_type: str
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"detail": {"error_type": self.error_type, "message": self.message}}


@dataclass(eq=False)
class Invalid(Exception):
    """A malformed request (422): where, what, and a validation error code."""

    loc: Location
    msg: str
    type: str = "value_error"

    def body(self) -> dict[str, Any]:
        return {"detail": [{"loc": self.loc, "msg": self.msg, "type": self.type}]}


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
    return Invalid(location(error.field, body), error.reason, "missing" if error.reason == "is required" else "value_error")

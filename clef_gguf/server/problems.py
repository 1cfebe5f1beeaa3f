"""HTTP errors of the server, and the one place where errors become statuses, headers and bodies.

Two shapes, as TypeSafe's API answers: a malformed request gets 422 with `detail` a list of
{loc, msg, type} (FastAPI's shape, which the typesafe-sdk reads); every other error gets
`detail` = {error_type, message}. On Workers AI's routes (workers_ai.py) either keeps its status
and headers (Retry-After included) and becomes `success: false` with `errors: [{code, message}]`,
which is what its clients read. Status, type and code come from the error's row of the error table (errors.py,
where a new status goes); the headers HTTP adds to a row are declared here (ROW_HEADERS), and an ApiError may add its
own on top.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import (
    ADAPTER_UNAVAILABLE,
    BODY_TIMEOUT,
    METHOD_NOT_ALLOWED,
    NOT_FOUND,
    OVERLOADED,
    REQUEST_TOO_LARGE,
    SOURCE_UNAVAILABLE,
    UNAUTHORIZED,
    UNAVAILABLE,
    Problem,
)
from ..runtime.failures import Failure, Invalid
from .observe import response_headers  # (each answer carries its request's id)

# The headers every answer of a row carries. A client may retry an OVERLOADED or an ADAPTER_UNAVAILABLE (a file being
# replaced) in a second, an UNAVAILABLE later; a late body's connection must not be reused (the head late: the protocol
# closes it itself).
_RETRY = (("Retry-After", "1"),)
ROW_HEADERS: dict[Problem, tuple[tuple[str, str], ...]] = {
    UNAUTHORIZED: (("WWW-Authenticate", "Bearer"),),
    BODY_TIMEOUT: (("Connection", "close"),),
    OVERLOADED: _RETRY,
    ADAPTER_UNAVAILABLE: _RETRY,
    # A full temporary disk is freed by an operator or another process's cleanup, not within a second: a client that
    # retried every second would only have the server copy the adapter again and again.
    UNAVAILABLE: (("Retry-After", "10"),),
    # A source that failed is asked again only after its back-off (the first is SOURCE_BACKOFF_S, 10 s).
    SOURCE_UNAVAILABLE: (("Retry-After", "10"),),
}
# The rows of the statuses Starlette raises itself (HTTPException): routing's 404 and 405, and, should a status of
# these rows ever come from it, their types.
_STARLETTE = {row.status: row for row in (UNAUTHORIZED, NOT_FOUND, METHOD_NOT_ALLOWED, REQUEST_TOO_LARGE, OVERLOADED)}


@dataclass(eq=False)  # exceptions stay hashable
class ApiError(Failure):
    """A Failure the server raises itself, with headers of its own on top of its row's
    (ApiError(OVERLOADED, message, {"Connection": "close"}))."""

    extra: Mapping[str, str] = field(default_factory=dict)


def headers_of(problem: Failure | Invalid) -> dict[str, str]:
    """The headers an error is answered with: its row's (ROW_HEADERS), and an ApiError's own on top."""
    return {**dict(ROW_HEADERS.get(problem.kind, ())), **(problem.extra if isinstance(problem, ApiError) else {})}


def starlette_problem(status: int) -> Problem:
    """The row of a status Starlette chose (an HTTPException), as a row of its own: none of the table's headers, the
    exception brings its own (a 405's Allow). A status no row of _STARLETTE has is an invalid_request_error of that
    status."""
    row = _STARLETTE.get(status)
    return Problem(f"HTTP_{status}", status, "invalid_request_error") if row is None else replace(row, name=f"HTTP_{status}")


def overloaded(message: str, *, close: bool = False) -> ApiError:
    """The one OVERLOADED: the server is full (intake, queue, replicas); the client may retry in a second."""
    return ApiError(OVERLOADED, message, {"Connection": "close"} if close else {})


# Cloudflare's REST API answers everything under its root in the envelope, a path that names no route included:
# so does this server for any path under /accounts or /client/v4, however its slashes are doubled.
_WORKERS_AI_PATH = re.compile(r"^/+(?:accounts|client/+v4)(?:/|$)")


def json_bytes(value: Any) -> bytes:
    """Compact UTF-8 JSON of an error body. A 422 names the field the client sent, and a client can send a
    lone surrogate ("\\ud800") as a key: UTF-8 cannot encode it, so such a body is written with ASCII escapes,
    which is still valid JSON and still decodes to the client's own key."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, allow_nan=False, separators=(",", ":")).encode("ascii")


def is_workers_ai_path(path: str) -> bool:
    """Whether a request path is on Workers AI's routes (so its errors get that envelope)."""
    return bool(_WORKERS_AI_PATH.match(path))


def workers_ai_failure(problem: Failure | Invalid) -> dict[str, Any]:
    """Workers AI's envelope of an error: its row's code (Problem.workers_ai_code) and its one line."""
    errors = [{"code": problem.kind.workers_ai_code, "message": problem.text()}]
    return {"result": None, "success": False, "errors": errors, "messages": []}


def render_problem(path: str, problem: Failure | Invalid) -> tuple[int, dict[str, str], bytes]:
    """The one rendering of an error: its status, headers and JSON, in TypeSafe's shape or, on its routes,
    the Workers AI envelope. The HTTP protocol (protocol.py) writes the same for what it refuses itself."""
    body = workers_ai_failure(problem) if is_workers_ai_path(path) else problem.body()
    return problem.kind.status, response_headers(headers_of(problem)), json_bytes(body)

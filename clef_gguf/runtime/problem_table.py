"""Every HTTP problem the server answers, in one table: a named row holds its status, its System One error type,
its Workers AI code and the headers it is always answered with.

A new status goes here, as a new row, and nowhere else. Every raise names a row (`ApiError(REQUEST_TOO_LARGE,
message)`, runtime/problems.py), and the renderers read the row: TypeSafe's shape and Workers AI's envelope
(server/problems.py), the HTTP protocol's own refusals (server/protocol.py), the error objects of
`clef-gguf decide` (runtime/problems.error_object). tests/test_problem_table.py fails on a status written anywhere
else in clef_gguf/. Plain data below the server, so that `clef-gguf decide` and the server read the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class HttpProblem:
    """One row: a kind of error the server answers, whatever message each occurrence carries."""

    name: str  # the row's own name in this module (REQUEST_TOO_LARGE), for tests and reading
    status: int
    error_type: str  # System One's machine-readable type: {"detail": {"error_type", "message"}}
    # Workers AI's own internal code where one fits (developers.cloudflare.com/workers-ai/platform/errors);
    # None: the status is the code
    workers_ai: int | None = None
    headers: tuple[tuple[str, str], ...] = ()  # every answer of this row carries them

    @property
    def workers_ai_code(self) -> int:
        """The code of `errors: [{code, message}]` in Workers AI's envelope."""
        return self.status if self.workers_ai is None else self.workers_ai


# Workers AI's code for an input over a limit, whichever limit it is.
_TOO_LARGE = 3006

# --- a request the server cannot read ---------------------------------------------------------------------------
BAD_HTTP = HttpProblem("BAD_HTTP", 400, "invalid_request_error")  # bytes that are not HTTP/1.1 (protocol.py)
# The client closed its connection before its body ended: nobody reads the answer, but it is typed all the same.
BODY_CUT_OFF = HttpProblem("BODY_CUT_OFF", 400, "invalid_request_error")
URL_TOO_LONG = HttpProblem("URL_TOO_LONG", 414, "request_too_large", _TOO_LARGE)  # --max-url-bytes
HEAD_TOO_LARGE = HttpProblem("HEAD_TOO_LARGE", 431, "request_too_large", _TOO_LARGE)  # --max-head-bytes
# The head late (--header-timeout): the protocol closes the connection itself, so no Connection header.
HEAD_TIMEOUT = HttpProblem("HEAD_TIMEOUT", 408, "request_timeout")
# The body late (--body-timeout, --min-body-rate): the app answers it, and the connection must not be reused.
BODY_TIMEOUT = HttpProblem("BODY_TIMEOUT", 408, "request_timeout", headers=(("Connection", "close"),))
# A body, its text or a line of a JSON Lines file over the limit.
REQUEST_TOO_LARGE = HttpProblem("REQUEST_TOO_LARGE", 413, "request_too_large", _TOO_LARGE)
# A Content-Encoding or a multipart type the server does not read.
UNSUPPORTED_MEDIA = HttpProblem("UNSUPPORTED_MEDIA", 415, "invalid_request_error")

# --- a request the server will not answer -----------------------------------------------------------------------
UNAUTHORIZED = HttpProblem("UNAUTHORIZED", 401, "authentication_error", headers=(("WWW-Authenticate", "Bearer"),))
NOT_FOUND = HttpProblem("NOT_FOUND", 404, "not_found_error")  # a path no route has (Starlette's)
METHOD_NOT_ALLOWED = HttpProblem("METHOD_NOT_ALLOWED", 405, "invalid_request_error")  # Starlette's, with its Allow
NO_SUCH_MODEL = HttpProblem("NO_SUCH_MODEL", 400, "no_such_model", 5007)  # a Workers AI model id not served here

# --- a request read and understood that cannot be decided -------------------------------------------------------
# A malformed request: its body is FastAPI's list of {loc, msg, type} (runtime/problems.Invalid), each entry with
# its own type, so this type is never in a body.
INVALID = HttpProblem("INVALID", 422, "validation_error")
PROMPT_TOO_LONG = HttpProblem("PROMPT_TOO_LONG", 413, "prompt_too_long", _TOO_LARGE)  # over the model's tokens

# --- the server's side ------------------------------------------------------------------------------------------
# The server is full (intake, queue, bodies, replicas) or stopping: a client may retry in a second.
OVERLOADED = HttpProblem("OVERLOADED", 503, "overloaded_error", headers=(("Retry-After", "1"),))
# The adapter a request names is served, but its file cannot be used now: it vanished, shrank or changed while the
# request waited (errors.AdapterUnavailableError). A file being replaced is back in a moment: the client may retry.
ADAPTER_UNAVAILABLE = HttpProblem("ADAPTER_UNAVAILABLE", 503, "model_unavailable_error", headers=(("Retry-After", "1"),))
INTERNAL = HttpProblem("INTERNAL", 500, "api_error")  # an error the server did not expect

ROWS: tuple[HttpProblem, ...] = (
    BAD_HTTP,
    BODY_CUT_OFF,
    URL_TOO_LONG,
    HEAD_TOO_LARGE,
    HEAD_TIMEOUT,
    BODY_TIMEOUT,
    REQUEST_TOO_LARGE,
    UNSUPPORTED_MEDIA,
    UNAUTHORIZED,
    NOT_FOUND,
    METHOD_NOT_ALLOWED,
    NO_SUCH_MODEL,
    INVALID,
    PROMPT_TOO_LONG,
    OVERLOADED,
    ADAPTER_UNAVAILABLE,
    INTERNAL,
)

# The rows of the statuses Starlette raises itself (HTTPException): routing's 404 and 405, and, should a status of
# these rows ever come from it, their types.
_STARLETTE = {row.status: row for row in (UNAUTHORIZED, NOT_FOUND, METHOD_NOT_ALLOWED, REQUEST_TOO_LARGE, OVERLOADED)}


def starlette_problem(status: int) -> HttpProblem:
    """The row of a status Starlette chose (an HTTPException), without the row's own headers: the exception brings
    its own (a 405's Allow). A status no row of _STARLETTE has is an invalid_request_error of that status."""
    row = _STARLETTE.get(status)
    return HttpProblem(f"HTTP_{status}", status, "invalid_request_error") if row is None else replace(row, headers=())

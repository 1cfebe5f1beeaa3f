"""Typed errors of clef-gguf, and the two tables a client of them reads: the exit codes (ExitCode) and the kinds of
error a request meets (Problem, one row each).

The library raises these errors; each class names its exit code and its row. The CLI turns an error into its exit
code (cli/errors.run) and the server into its row's status, with the headers HTTP adds (server/problems.py); the
dataset mode writes the row's status and body as a line's error (runtime/failures.py). A new status is a new row
here, and nowhere else (tests/test_problem_table.py); a new exit code a member of ExitCode, and the README's table
(tests/test_exit_codes.py). Each message is one line a person can act on.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar


class ExitCode(IntEnum):
    """Every exit code of `clef-gguf`, as the README's table lists them; a signal N exits signalled(N)."""

    OK = 0  # done; validate: a complete model
    COMPUTE = 1  # llama.cpp or the head failed while computing
    BAD_INPUT = 2  # a bad request, bad settings or bad arguments (click's own usage errors too)
    RELEASE = 3  # not a usable Clef release
    CONVERSION = 4  # the conversion could not finish
    CORRUPT = 5  # the model file is corrupt or unreadable, or its scores are not finite
    NOT_A_DECISION_MODEL = 6  # a readable GGUF that is no Clef decision model
    INCOMPLETE = 7  # an incomplete or inconsistent model or adapter file, or a pair that does not belong together
    SOME_ERRORS = 8  # every line has its answer, some are errors (decide on JSON Lines, eval, compare, calibrate)
    OUTPUT = 9  # an output cannot be written, or is refused before any work
    SIGNALLED = 128  # 128 + N: stopped by signal N


def signalled(signum: int) -> int:
    """The exit code of a command stopped by signal `signum`: 128 + N, as a shell reports it."""
    return ExitCode.SIGNALLED + signum


@dataclass(frozen=True)
class Problem:
    """One row of the error table: a kind of error a client meets, whatever message each occurrence carries: the
    status `clef-gguf serve` answers it with (and a dataset's error line holds), System One's type and Workers AI's
    code. The headers HTTP adds to a row (WWW-Authenticate, Retry-After) are the server's (server/problems.py)."""

    name: str  # the row's own name in this module (REQUEST_TOO_LARGE), for tests and reading
    status: int
    error_type: str  # System One's machine-readable type: {"detail": {"error_type", "message"}}
    # Workers AI's own internal code where one fits (developers.cloudflare.com/workers-ai/platform/errors);
    # None: the status is the code
    workers_ai: int | None = None

    @property
    def workers_ai_code(self) -> int:
        """The code of `errors: [{code, message}]` in Workers AI's envelope."""
        return self.status if self.workers_ai is None else self.workers_ai


# Workers AI's code for an input over a limit, whichever limit it is.
_TOO_LARGE = 3006

# --- a request the server cannot read ---------------------------------------------------------------------------
BAD_HTTP = Problem("BAD_HTTP", 400, "invalid_request_error")  # bytes that are not HTTP/1.1 (server/protocol.py)
# The client closed its connection before its body ended: nobody reads the answer, but it is typed all the same.
BODY_CUT_OFF = Problem("BODY_CUT_OFF", 400, "invalid_request_error")
URL_TOO_LONG = Problem("URL_TOO_LONG", 414, "request_too_large", _TOO_LARGE)  # --max-url-bytes
HEAD_TOO_LARGE = Problem("HEAD_TOO_LARGE", 431, "request_too_large", _TOO_LARGE)  # --max-head-bytes
HEAD_TIMEOUT = Problem("HEAD_TIMEOUT", 408, "request_timeout")  # the head late (--header-timeout)
BODY_TIMEOUT = Problem("BODY_TIMEOUT", 408, "request_timeout")  # the body late (--body-timeout, --min-body-rate)
# A body, its text or a line of a JSON Lines file over the limit.
REQUEST_TOO_LARGE = Problem("REQUEST_TOO_LARGE", 413, "request_too_large", _TOO_LARGE)
# A Content-Encoding or a multipart type the server does not read.
UNSUPPORTED_MEDIA = Problem("UNSUPPORTED_MEDIA", 415, "invalid_request_error")

# --- a request the server will not answer -----------------------------------------------------------------------
UNAUTHORIZED = Problem("UNAUTHORIZED", 401, "authentication_error")
NOT_FOUND = Problem("NOT_FOUND", 404, "not_found_error")  # a path no route has (Starlette's)
METHOD_NOT_ALLOWED = Problem("METHOD_NOT_ALLOWED", 405, "invalid_request_error")  # Starlette's, with its Allow
NO_SUCH_MODEL = Problem("NO_SUCH_MODEL", 400, "no_such_model", 5007)  # a Workers AI model id not served here
# A request for a name the server does not answer as (Host: DNS rebinding), or sent by another site's page (Origin):
# server/guard.py, --allowed-host and --allowed-origin.
FOREIGN_HOST = Problem("FOREIGN_HOST", 403, "permission_error")
FOREIGN_ORIGIN = Problem("FOREIGN_ORIGIN", 403, "permission_error")

# --- a request read and understood that cannot be decided -------------------------------------------------------
# A malformed request: its body is FastAPI's list of {loc, msg, type} (runtime/failures.Invalid), each entry with
# its own type, so this type is never in a body.
INVALID = Problem("INVALID", 422, "validation_error")
PROMPT_TOO_LONG = Problem("PROMPT_TOO_LONG", 413, "prompt_too_long", _TOO_LARGE)  # over the model's tokens
# An adapter name of a source the operator did not name (--adapter-source: the allow list): never fetched.
ADAPTER_NOT_ALLOWED = Problem("ADAPTER_NOT_ALLOWED", 403, "permission_error")
# An adapter a source would deliver that is over --adapter-max-size: refused before a byte of it is downloaded.
ADAPTER_TOO_LARGE = Problem("ADAPTER_TOO_LARGE", 422, "adapter_too_large")

# --- the server's side ------------------------------------------------------------------------------------------
# The server is full (intake, queue, bodies, replicas) or stopping: a client may retry in a second.
OVERLOADED = Problem("OVERLOADED", 503, "overloaded_error")
# The adapter a request names is served, but its file cannot be used now (AdapterUnavailableError).
ADAPTER_UNAVAILABLE = Problem("ADAPTER_UNAVAILABLE", 503, "model_unavailable_error")
# The server cannot do now what a request needs of its machine (its temporary disk full for an adapter's private
# copy, TemporarilyUnavailableError): nothing is wrong with the request, nor with the file it names.
UNAVAILABLE = Problem("UNAVAILABLE", 503, "unavailable_error")
# The source an adapter comes from (the Hugging Face Hub) cannot be reached, answers too slowly for a first use, or
# failed a moment ago (retried after a back-off): SourceUnavailableError.
SOURCE_UNAVAILABLE = Problem("SOURCE_UNAVAILABLE", 503, "source_unavailable_error")
INTERNAL = Problem("INTERNAL", 500, "api_error")  # an error the server did not expect

ROWS: tuple[Problem, ...] = (
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
    FOREIGN_HOST,
    FOREIGN_ORIGIN,
    INVALID,
    PROMPT_TOO_LONG,
    ADAPTER_NOT_ALLOWED,
    ADAPTER_TOO_LARGE,
    OVERLOADED,
    ADAPTER_UNAVAILABLE,
    UNAVAILABLE,
    SOURCE_UNAVAILABLE,
    INTERNAL,
)


def printable(text: str, limit: int = 600) -> str:
    """One line of bounded length: messages quote keys, names and values read from files, which may hold anything
    (errors.py, so that the CLI prints its lines without loading the checks)."""
    if text.isprintable() and len(text) <= limit:
        return text
    clean = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[: limit + 1])
    return clean[:limit] + ("..." if len(clean) > limit or len(text) > limit else "")


class ClefError(Exception):
    """Base class of every error clef-gguf raises on purpose: its exit code, and its row when a request meets it
    (INTERNAL: one the server did not expect; INVALID: the field or the model the request named)."""

    exit_code: ClassVar[int] = ExitCode.COMPUTE
    problem: ClassVar[Problem] = INTERNAL


class ReleaseError(ClefError):
    """The source is not a usable Clef release (missing file, unknown layout, offline)."""

    exit_code = ExitCode.RELEASE


class ConversionError(ClefError):
    """Conversion could not finish (unsupported shapes, disk); a refused output is an OutputError."""

    exit_code = ExitCode.CONVERSION


class ModelFileError(ClefError):
    """A GGUF file is not a complete Clef decision model, or llama.cpp refused it. A request meets one only in the
    adapter it names: a 422 at that field (runtime/failures.model_refused)."""

    exit_code = ExitCode.CORRUPT
    problem = INVALID


class CorruptModelError(ModelFileError):
    """The file cannot be read as GGUF: unreadable, truncated, bad offsets, or damaged data."""

    exit_code = ExitCode.CORRUPT


class NotADecisionModelError(ModelFileError):
    """A readable GGUF that is no Clef decision model (e.g. a backbone-only qwen35 conversion)."""

    exit_code = ExitCode.NOT_A_DECISION_MODEL


class IncompleteModelError(ModelFileError):
    """A Clef file with missing or mismatched parts: head, backbone, tokenizer or metadata."""

    exit_code = ExitCode.INCOMPLETE


class AdapterBaseError(IncompleteModelError):
    """An adapter file and a base that do not belong together: trained over another base, or shapes that differ."""


class AdapterUnavailableError(ClefError):
    """A request's adapter cannot be used now, though its name is served: its file vanished, shrank, changed while
    the request waited, or no longer validates. Another request may find it again (a file being replaced): the
    server answers 503 with Retry-After, not 500; the CLI exits 7."""

    exit_code = ExitCode.INCOMPLETE
    problem = ADAPTER_UNAVAILABLE


class TemporarilyUnavailableError(ClefError):
    """This machine cannot do now what was asked of it, through no fault of the request or of its files: the temporary
    folder an adapter's private copy is written to is full (ENOSPC, a quota, a file size limit) or cannot be written.
    The server answers 503 with Retry-After (the space may be freed), never a 500 or the client's 422; the CLI exits 9,
    as for any output a full disk refuses."""

    exit_code = ExitCode.OUTPUT
    problem = UNAVAILABLE


class SourceUnavailableError(ClefError):
    """The source an adapter name comes from cannot deliver it now: the Hub unreachable, too slow for a first use
    (--adapter-fetch-timeout), or failed a moment ago and not asked again before its back-off ends. The server
    answers 503 with Retry-After; nothing is wrong with the request."""

    exit_code = ExitCode.RELEASE
    problem = SOURCE_UNAVAILABLE


class NonFiniteWeightsError(CorruptModelError):
    """A tensor about to be written, or a head read, holds NaN or Inf values (a diverged fine-tune, a bad
    lora_alpha, or a value beyond the range of the type it is stored in): no such file is written."""


class ModelOutputError(CorruptModelError):
    """The model's scores are not finite (NaN or Inf): weights that overflow, or are NaN, in a file that parses."""

    problem = INTERNAL  # (found while computing, not in the file a request named)


class ComputeError(ClefError):
    """llama.cpp or the native head failed while computing a decision (a device error, memory, a broken invariant)."""


class SettingsError(ClefError, ValueError):
    """Load settings that cannot work (a prompt limit or ubatch out of range); in a request, of the adapter it names."""

    exit_code = ExitCode.BAD_INPUT
    problem = INVALID


class DeploymentError(ClefError):
    """A Ray Serve application could not be deployed: a replica failed to start (its reason in the message)."""


class RequestError(ClefError):
    """A decision request is invalid. `field` names where, e.g. questions.q1.criteria."""

    exit_code = ExitCode.BAD_INPUT
    problem = INVALID

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = message

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:
        # Rebuilt from its parts, not its formatted message, when it crosses processes (a Ray Serve replica's).
        return type(self), (self.reason, self.field)


class RequestJsonError(RequestError):
    """A request that is not strict JSON text. `path` holds the keys and indexes of the value at fault (its
    field), `offset` where in the text a syntax error is; `kind` names the failure for an HTTP 422
    (json_invalid, or string_unicode for a lone surrogate)."""

    def __init__(
        self, message: str, path: tuple[str | int, ...] = (), *, offset: int | None = None, kind: str = "json_invalid"
    ) -> None:
        super().__init__(message, ".".join(str(part) for part in path) or None)
        self.path = path
        self.offset = offset
        self.kind = kind

    def __reduce__(self) -> tuple[type, tuple[str, tuple[str | int, ...]], dict[str, object]]:  # type: ignore[override]
        return type(self), (self.reason, self.path), {"offset": self.offset, "kind": self.kind}


class PromptTooLongError(RequestError):
    """The prompt needs more tokens than the context was sized for."""

    problem = PROMPT_TOO_LONG

    def __init__(self, n_tokens: int, limit: int) -> None:
        super().__init__(
            f"the prompt has {n_tokens} tokens but this model was loaded with a limit of "
            f"{limit} tokens (its context); shorten the state or load the model with a larger "
            f"context (max_prompt_tokens, --max-prompt-tokens / --ctx), at the cost of a larger KV cache"
        )
        self.n_tokens = n_tokens
        self.limit = limit

    def __reduce__(self) -> tuple[type, tuple[int, int]]:  # type: ignore[override]
        return type(self), (self.n_tokens, self.limit)


class AdapterNotAllowedError(RequestError):
    """A request names an adapter of a source the operator did not name (--adapter-source): nothing is fetched."""

    problem = ADAPTER_NOT_ALLOWED


class AdapterTooLargeError(RequestError):
    """The adapter a source would deliver is over --adapter-max-size: refused before it is downloaded."""

    problem = ADAPTER_TOO_LARGE


class RequestTooLargeError(RequestError):
    """A request over a size limit, refused unread: a JSON Lines line over --max-line-bytes."""

    problem = REQUEST_TOO_LARGE


class AnswersFileError(ClefError):
    """`clef-gguf decide`'s answers file cannot be continued: it holds answers to another input, is damaged before its
    last line, or is a stream (an answers file that exists without --resume or --force is an OutputError)."""

    exit_code = ExitCode.BAD_INPUT


class OutputError(ClefError):
    """An output could not be written, or is refused before any work (clef_gguf/outputs.py): it exists without
    --force, is one of the inputs, is not a regular file, its folder is missing or read-only; the disk is full."""

    exit_code = ExitCode.OUTPUT


class ModelClosedError(ClefError):
    """A closed ClefModel was asked to encode or decide: its memory is freed; load the file again."""


class BackendUnavailableError(ClefError, ImportError):
    """llama-cpp-python's libraries cannot load on this machine (a CUDA build without NVIDIA's driver, say)."""

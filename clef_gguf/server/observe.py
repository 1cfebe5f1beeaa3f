"""Each request's id, access log line and metrics: the app's outermost middleware of its own.

The id is the client's X-Request-Id when it is one to repeat (accepted_request_id), else a new one; every answer to
the request carries it (response_headers reads it from the request's context, problems.render_problem's errors
included), and its one access log line names it. The line is written when the answer is complete, with what the request cost: its
prompt tokens and cached tokens when it was decided (app.py notes them on the request's Record).

uvicorn's own access log stays off (run.py), and so does Ray Serve's (ray_serve.py): this line is the only one.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import INTERNAL
from ..settings import LogFormat

if TYPE_CHECKING:  # (problems.py renders every error with response_headers: this module imports none of the server's)
    from ..runtime.protocols import Prompt
    from .decision import Decision
    from .metrics import Metrics

ACCESS_LOGGER = "clef_gguf.access"
UNMATCHED = "unmatched"  # the route label of a path no route has: one label, whatever paths clients try
_RECORD = "clef_record"  # its key in the request's scope["state"]

access_log = logging.getLogger(ACCESS_LOGGER)

REQUEST_ID_HEADER = "x-typesafe-request-id"  # typesafe-sdk exposes it as response.request_id
X_REQUEST_ID = "x-request-id"  # the common name (proxies, tracing): a client's own id is taken from it
MAX_REQUEST_ID = 128  # characters of a client's id kept; a longer one is replaced
# The id of the request being answered, set per request (each is a task of its own) by Observed, so that every
# answer to it, an error rendered anywhere included, carries the one id its access log line names.
current_request_id: ContextVar[str | None] = ContextVar("clef_request_id", default=None)
_ID_HEADER = X_REQUEST_ID.encode()


def new_request_id() -> str:
    return uuid.uuid4().hex


def accepted_request_id(value: str | None) -> str:
    """A client's X-Request-Id if it is one to repeat in headers and log lines (1 to MAX_REQUEST_ID visible ASCII
    characters: no spaces, no control characters to forge a log line with), else a new one."""
    if value and len(value) <= MAX_REQUEST_ID and all("!" <= c <= "~" for c in value):
        return value
    return new_request_id()


def response_headers(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The headers of every answer: the request's id, under both names (typesafe-sdk's and X-Request-Id), and
    `extra`. Outside a request (the HTTP protocol's own refusals, protocol.py) a new id."""
    request_id = current_request_id.get() or new_request_id()
    return {REQUEST_ID_HEADER: request_id, X_REQUEST_ID: request_id, **(extra or {})}


@dataclass
class Record:
    """What the access log line says of a request beyond its status."""

    id: str
    tokens: int | None = None  # prompt tokens, when it was decided
    cached_tokens: int | None = None


def note_decision(request: Request, prompt: Prompt, decision: Decision) -> None:
    """Put a decided request's tokens on its Record, for its access log line."""
    record: Record = request.scope["state"][_RECORD]
    record.tokens, record.cached_tokens = len(prompt.tokens), decision.cached_tokens


class LineWriter(logging.Handler):
    """Writes each line on a thread of its own, so that a stderr nobody reads (a full pipe) never stalls the event loop:
    past MAX_WAITING lines waiting to be written, lines are dropped (and counted), never requests."""

    MAX_WAITING = 4096

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream
        self.dropped = 0
        self._waiting: queue.Queue[str] = queue.Queue(self.MAX_WAITING)
        threading.Thread(target=self._write, name="clef-access-log", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._waiting.put_nowait(self.format(record))
        except queue.Full:
            self.dropped += 1

    def _write(self) -> None:
        while True:
            line = self._waiting.get()
            try:
                self.stream.write(line + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # stderr closed: nothing left to write to
                pass
            finally:
                self._waiting.task_done()

    def drain(self, timeout_s: float) -> None:
        """Wait (up to timeout_s: the stream may never be read) until the lines waiting are written: at shutdown."""
        deadline = time.monotonic() + timeout_s
        while self._waiting.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)


def configure_access_log() -> LineWriter:
    """The access log's lines on stderr, as they are (each is formatted already): for `clef-gguf serve`, and the Ray
    ingress's process. Once per process; without it (an app in a test) the lines go to the root logger."""
    for handler in access_log.handlers:
        if isinstance(handler, LineWriter):
            return handler
    writer = LineWriter(sys.stderr)
    writer.setFormatter(logging.Formatter("%(message)s"))
    access_log.addHandler(writer)
    access_log.setLevel(logging.INFO)
    access_log.propagate = False
    return writer


def route_label(scope: Scope) -> str:
    """The route's template (/accounts/{account_id}/ai/run/{model_id:path}), never the path a client sent: labels and
    log lines stay few and free of what the client wrote. FastAPI puts the route it matched in the scope."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED


def access_line(log_format: LogFormat, scope: Scope, record: Record, status: int, seconds: float) -> str:
    client = scope.get("client")
    fields = {
        "id": record.id,
        "client": client[0] if client else None,
        "method": scope.get("method"),
        "route": route_label(scope),
        "status": status,
        "tokens": record.tokens,
        "cached_tokens": record.cached_tokens,
        "ms": round(seconds * 1e3, 3),
    }
    if log_format == "json":
        return json.dumps(fields, separators=(",", ":"))
    # logfmt: one key=value per field. No value holds a space: the id is visible ASCII, the route a template.
    return " ".join(f"{key}={'-' if value is None else value}" for key, value in fields.items())


def _with_id(message: Message, request_id: str, echo: bool) -> Message:
    """The response start with the request's id, should an answer rendered elsewhere (FastAPI's own) lack it; without
    X-Request-Id where a proxy in front adds its own (Ray's: the id it handed this app in the request)."""
    headers = list(message.get("headers", []))
    if not echo:
        return {**message, "headers": [(name, value) for name, value in headers if name.lower() != _ID_HEADER]}
    if any(name.lower() == _ID_HEADER for name, _ in headers):
        return message
    encoded = request_id.encode()
    headers += [(_ID_HEADER, encoded), (REQUEST_ID_HEADER.encode(), encoded)]
    return {**message, "headers": headers}


class Observed:
    """Gives each request its id, and once answered counts it and writes its access log line."""

    def __init__(self, app: ASGIApp, metrics: Metrics, log_format: LogFormat = "text", echo_id: bool = True) -> None:
        self.app = app
        self.metrics = metrics
        self.log_format = log_format
        self.echo_id = echo_id  # whether answers carry X-Request-Id (typesafe-sdk's header they always carry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived = time.perf_counter()
        sent_id = next((value for name, value in scope["headers"] if name == _ID_HEADER), None)
        record = Record(accepted_request_id(sent_id and sent_id.decode("latin-1")))
        # Set, never reset: Starlette's error middleware, outside this one, renders a 500 in this same task after it.
        current_request_id.set(record.id)
        scope.setdefault("state", {})[_RECORD] = record
        status = 0

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = _with_id(message, record.id, self.echo_id)
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, tracked)
        except Exception:
            status = status or INTERNAL.status  # what Starlette's error middleware answers it with
            raise
        finally:
            self.metrics.in_flight.dec()
            seconds = time.perf_counter() - arrived
            self.metrics.answered(route_label(scope), status, seconds)
            if access_log.isEnabledFor(logging.INFO):
                access_log.info(access_line(self.log_format, scope, record, status, seconds))

"""uvicorn's httptools protocol with the HTTP limits uvicorn does not have.

uvicorn 0.54 bounds none of these on its default (httptools) protocol: the request head (request line
and headers) is buffered however large it grows; a connection that never sends a request, or
trickles one, is never closed (its keep-alive timer runs only after a response, and every byte
received cancels it); and a body still arriving after an early answer (a 413, a 401) is read and
dropped for as long as the client sends it. Its h11 protocol has a head limit
(h11_max_incomplete_event_size), but answers it with a plain-text 400, and has the same timers.
This subclass adds, per connection:

  * a head limit: past `max_head_bytes` the answer is HEAD_TOO_LARGE (past `max_url_bytes` of request line,
    URL_TOO_LONG);
  * a head deadline: the head must be complete `header_timeout` after the connection opens or its
    first byte arrives, however slowly it trickles; then HEAD_TIMEOUT (or a plain close if nothing came); an
    idle connection after an answer is uvicorn's keep-alive timeout's;
  * a body deadline after an early answer: the rest of the body is still read and dropped (closing
    at once would reset the connection before the client reads its answer) but only until
    `body_timeout` after the head; the app itself answers a body slower than that with BODY_TIMEOUT (body.py).

Every answer it writes is the app's JSON error (problems.render_problem) of a row of the problem table
(errors.py), never plain text; uvicorn's own 400 for bytes it cannot parse is BAD_HTTP.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ..errors import BAD_HTTP, HEAD_TIMEOUT, HEAD_TOO_LARGE, URL_TOO_LONG
from ..settings import HttpLimits
from .guard import ANSWER_HEADERS
from .problems import ApiError, render_problem

_HEAD_START_BYTES = 256  # enough of a request line to tell its route


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; uvicorn then calls send_400_response."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: ClassVar[HttpLimits] = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading_head = True  # between the end of a request's body (or the connection's start) and its headers
        self._head_bytes = 0
        self._head_start = b""  # a head's first bytes, as received: its target, where the parser refused it unread
        self._refusal: ApiError | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    # --- the head ----------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self._reading_head:
            if self._head_bytes == 0:  # a request's first byte: its head is due by the deadline
                self._await_head()
                self._head_start = b""
            if len(self._head_start) < _HEAD_START_BYTES:
                self._head_start += data[: _HEAD_START_BYTES - len(self._head_start)]
            self._head_bytes += len(data)
        super().data_received(data)
        # Checked after parsing: a chunk may end a small head and carry the start of a large body.
        if self._reading_head and self._head_bytes > self.limits.max_head_bytes and not self.transport.is_closing():
            self._answer_and_close(self._head_too_large())

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_url_bytes:
            message = f"the request line is longer than this server's limit of {self.limits.max_url_bytes} bytes"
            self._refuse(ApiError(URL_TOO_LONG, message))

    def on_headers_complete(self) -> None:
        self._host_from_target()
        # The head's size as received: what a single chunk holding all of it would not have counted yet.
        if len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > self.limits.max_head_bytes:
            self._refuse(self._head_too_large())
        self._reading_head = False
        self._cancel_timers()
        self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_timed_out)
        super().on_headers_complete()

    def _host_from_target(self) -> None:
        """An absolute-form target (`POST http://name/path`, as to a proxy) names the host the request is for, and a
        server takes that one, not the Host header (RFC 9112, 3.2.2): uvicorn keeps only its path, so its authority
        is made the Host, for the guard (guard.py) to answer or refuse as any Host."""
        if self.url.startswith(b"/") or self.url == b"*":
            return
        try:
            target = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            return  # (uvicorn's own parse of it answers BAD_HTTP)
        if target.host is None:
            return
        host = b"[" + target.host + b"]" if b":" in target.host else target.host
        authority = host + (b":%d" % target.port if target.port is not None else b"")
        self.headers[:] = [(name, value) for name, value in self.headers if name != b"host"] + [(b"host", authority)]

    def _head_too_large(self) -> ApiError:
        limit = self.limits.max_head_bytes
        return ApiError(HEAD_TOO_LARGE, f"the request headers are larger than this server's limit of {limit} bytes")

    def _await_head(self) -> None:
        if self._head_timer is None and not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._reading_head or self.transport.is_closing():
            return
        if self._head_bytes == 0:  # an idle connection: nothing to answer
            self.transport.close()
            return
        message = f"the request headers did not arrive within {self.limits.header_timeout:g} s"
        self._answer_and_close(ApiError(HEAD_TIMEOUT, message))

    # --- the body and the answer -------------------------------------------------------------------------------
    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._reading_head, self._head_bytes = True, 0
        if self.cycle is not None and self.cycle.response_complete:
            # The body ended after an early answer, whose keep-alive timer its bytes cancelled: idle from now.
            self._await_head()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        # Only an answered request: one still being read is answered BODY_TIMEOUT by the app at this same deadline.
        if self.cycle is not None and self.cycle.response_complete and not self.transport.is_closing():
            self.transport.close()

    # --- refusing -----------------------------------------------------------------------------------------------
    def _refuse(self, problem: ApiError) -> None:
        self._refusal = problem
        raise _Refused(problem.message)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head it cannot parse, or that a callback here refused: JSON, then close."""
        self._answer_and_close(self._refusal or ApiError(BAD_HTTP, "the request is not valid HTTP/1.1"))

    def _answer_and_close(self, problem: ApiError) -> None:
        # The path picks the error's shape (Workers AI's envelope on its routes). A request line the parser refused
        # (raw non-ASCII bytes in it, say) never reached on_url: its target is then read from the bytes received.
        target = getattr(self, "url", b"") or (self._head_start.split(b" ", 2)[1:2] or [b""])[0]
        status, headers, body = render_problem(target.partition(b"?")[0].decode("latin-1"), problem)
        head = [STATUS_LINE[status]]
        for name, value in [*self.server_state.default_headers, *((k.encode(), v.encode()) for k, v in headers.items())]:
            head += [name, b": ", value, b"\r\n"]
        for name, value in ANSWER_HEADERS.items():  # as every answer of the app (guard.py)
            head += [name.encode(), b": ", value.encode(), b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self.transport.write(b"".join(head) + body)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None


def protocol_class(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class uvicorn.Config(http=...) instantiates per connection, with these limits."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})

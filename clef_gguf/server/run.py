"""Running the app on uvicorn: loopback by default, HTTP limits (protocol.py), graceful drain on SIGTERM."""

from __future__ import annotations

import gc
import signal
import threading
from typing import Any

import uvicorn

from .app import DEFAULT_MAX_PENDING, create_app
from .observe import LogFormat, configure_access_log
from .protocol import HttpLimits, protocol_class
from .worker import Model

DEFAULT_DRAIN_TIMEOUT_S = 60.0
ACCESS_LOG_DRAIN_S = 5.0  # at exit, for the access log's last lines (a stderr nobody reads never takes them)


def _drained(_signum: int, _frame: object) -> None:
    """uvicorn re-raises SIGTERM/SIGINT to the previous handler once it has drained: the stop was clean."""


def uvicorn_config(app: Any, limits: HttpLimits, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for this server: its protocol with `limits`; `options` go to uvicorn.Config."""
    return uvicorn.Config(app, http=protocol_class(limits), timeout_keep_alive=limits.keep_alive_s, **options)  # type: ignore[arg-type]


def serve(
    model: Model,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_pending: int = DEFAULT_MAX_PENDING,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    limits: HttpLimits | None = None,
    log_format: LogFormat = "text",
) -> None:
    """Serve until SIGTERM/SIGINT. uvicorn then stops accepting connections, lets in-flight and
    queued requests finish (up to drain_timeout_s), and the app closes the model; then this returns.
    One access log line per request on stderr, in log_format (observe.py)."""
    limits = limits or HttpLimits()
    access_lines = configure_access_log()
    pace = {"body_timeout_s": limits.body_timeout_s, "min_body_rate": limits.min_body_rate, "body_grace_s": limits.body_grace_s}
    app = create_app(model, api_key=api_key, max_pending=max_pending, log_format=log_format, **pace)
    config = uvicorn_config(
        app,
        limits,
        host=host,
        port=port,
        log_level="info",
        access_log=False,  # the app writes its own line per request (observe.py), with the request's id: one is enough
        timeout_graceful_shutdown=drain_timeout_s,
        server_header=False,
    )
    server = uvicorn.Server(config)
    # The model, the app and the libraries are some 80,000 objects the cyclic GC tracks, alive as long as the
    # process: a full collection walked them all, a 30 to 55 ms pause inside whichever request triggered it.
    # Frozen, collections walk only what requests allocate (2,200 objects tracked after 60 requests).
    gc.collect()
    gc.freeze()
    try:
        if threading.current_thread() is not threading.main_thread():
            server.run()  # no signals off the main thread: the caller stops it with server.should_exit
            return
        previous = {sig: signal.signal(sig, _drained) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            server.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        access_lines.drain(ACCESS_LOG_DRAIN_S)  # the last requests' lines, before the process exits

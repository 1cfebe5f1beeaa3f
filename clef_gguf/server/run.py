"""Running the app on uvicorn: loopback by default, HTTP limits (protocol.py), graceful drain on SIGTERM."""

from __future__ import annotations

import gc
import signal
import threading
from typing import Any

import uvicorn
from uvicorn.server import HANDLED_SIGNALS  # the signals uvicorn drains at, and raises again once drained

from ..runtime.protocols import Model
from ..settings import HttpLimits, ServeSettings
from .app import create_app
from .guard import Names
from .observe import configure_access_log
from .protocol import protocol_class

ACCESS_LOG_DRAIN_S = 5.0  # at exit, for the access log's last lines (a stderr nobody reads never takes them)


def _drained(_signum: int, _frame: object) -> None:
    """uvicorn re-raises SIGTERM/SIGINT to the previous handler once it has drained: the stop was clean."""


def uvicorn_config(app: Any, limits: HttpLimits, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for this server: its protocol with `limits`; `options` go to uvicorn.Config."""
    return uvicorn.Config(app, http=protocol_class(limits), timeout_keep_alive=limits.keep_alive, **options)  # type: ignore[arg-type]


def settings_app(model: Any, settings: ServeSettings, **options: Any) -> Any:
    """create_app held to `settings` (its key, queue, HTTP limits, log format, page and names): the plain server's app,
    and the Ray ingress's (ray_serve.py), whose `options` give it its scheduler."""
    s = settings
    limits, log = s.limits, s.log_format
    names = {"names": Names(s.host, s.allowed_hosts), "allowed_origins": s.allowed_origins}
    return create_app(model, api_key=s.api_key, max_queue=s.max_queue, limits=limits, log_format=log, ui=s.ui, **names, **options)


def serve(model: Model, settings: ServeSettings | None = None) -> None:
    """Serve until SIGTERM/SIGINT. uvicorn then stops accepting connections, lets in-flight and
    queued requests finish (up to settings.drain_timeout), and the app closes the model; then this returns.
    One access log line per request on stderr, in settings.log_format (observe.py)."""
    access_lines = configure_access_log()
    s = settings or ServeSettings()
    app = settings_app(model, s)
    config = uvicorn_config(
        app,
        s.limits,
        host=s.host,
        port=s.port,
        log_level="info",
        access_log=False,  # the app writes its own line per request (observe.py), with the request's id: one is enough
        timeout_graceful_shutdown=s.drain_timeout,
        server_header=False,
    )
    server = uvicorn.Server(config)
    # The model, the app and the libraries are objects the cyclic GC tracks, alive as long as the process: a full
    # collection walked them all, a pause inside whichever request triggered it. Frozen, collections walk only what
    # requests allocate (docs/benchmarks.md, "Measurements behind the code").
    gc.collect()
    gc.freeze()
    try:
        if threading.current_thread() is not threading.main_thread():
            server.run()  # no signals off the main thread: the caller stops it with server.should_exit
            return
        previous = {sig: signal.signal(sig, _drained) for sig in HANDLED_SIGNALS}  # (Windows: and SIGBREAK)
        try:
            server.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        access_lines.drain(ACCESS_LOG_DRAIN_S)  # the last requests' lines, before the process exits

"""Running the app on uvicorn: loopback by default, HTTP limits (protocol.py), graceful drain on SIGTERM, SIGINT and
SIGHUP."""

from __future__ import annotations

import gc
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from uvicorn.server import HANDLED_SIGNALS  # the signals uvicorn drains at (SIGINT, SIGTERM; Windows: SIGBREAK)

from ..errors import SettingsError
from ..runtime.protocols import Model
from ..settings import HttpLimits, ServeSettings
from .adapter_metrics import AdapterView
from .app import create_app
from .guard import Names
from .observe import configure_access_log
from .protocol import protocol_class

ACCESS_LOG_DRAIN_S = 5.0  # at exit, for the access log's last lines (a stderr nobody reads never takes them)


# SIGHUP too (a closed terminal, a service manager's reload-or-stop): every other command stops at it as at SIGTERM
# (cli/errors.py), and so does the server, draining first.
DRAINED_AT = tuple(dict.fromkeys((*HANDLED_SIGNALS, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))))


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining at DRAINED_AT, and keeping the signal once drained (uvicorn raises it again, to the
    handler it replaced): `stopped_by` says which, for the command's exit status (128+N)."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # (signals reach the main thread only)
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in DRAINED_AT}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @property
    def stopped_by(self) -> int | None:
        return self._captured_signals[0] if self._captured_signals else None


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


def url_host(host: str) -> str:
    """`host` as a URL names it: an IPv6 address in brackets (http://[::1]:8000/)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def listen(settings: ServeSettings) -> socket.socket:
    """The socket the server will accept on, bound: before anything says it serves. An address that cannot be bound
    (in use, not this machine's, not an address) is a bad setting: SettingsError naming it and why."""
    where = f"{url_host(settings.host)}:{settings.port}"
    # As uvicorn binds --host: IPv6 for an address with a colon, else IPv4 (a name resolved there: localhost is 127.0.0.1).
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:  # (no IPv6 here)
        raise SettingsError(f"cannot listen on {where}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a port in TIME_WAIT is free
        sock.bind((settings.host.strip("[]"), settings.port))
    except OSError as e:  # (socket.gaierror too: a host that is no address and no name)
        sock.close()
        raise SettingsError(f"cannot listen on {where}: {e.strerror or e}") from None
    return sock


def serve(
    model: Model, settings: ServeSettings | None = None, adapters: AdapterView | None = None, sock: socket.socket | None = None
) -> int | None:
    """Serve until SIGTERM, SIGINT or SIGHUP. uvicorn then stops accepting connections, lets in-flight and
    queued requests finish (up to settings.drain_timeout), and the app closes the model; then this returns the signal
    (None: stopped otherwise). One access log line per request on stderr, in settings.log_format (observe.py);
    `adapters`: the model's per-adapter counts (adapter_metrics.py). `sock`: listen(settings)'s, bound by the caller;
    else bound here (SettingsError where it cannot be)."""
    s = settings or ServeSettings()
    sock = sock or listen(s)
    access_lines = configure_access_log()
    app = settings_app(model, s, adapters=adapters)
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
    server = DrainingServer(config)
    # The model, the app and the libraries are objects the cyclic GC tracks, alive as long as the process: a full
    # collection walked them all, a pause inside whichever request triggered it. Frozen, collections walk only what
    # requests allocate (docs/benchmarks.md, "Measurements behind the code").
    gc.collect()
    gc.freeze()
    try:
        server.run(sockets=[sock])  # (off the main thread no signal reaches it: the caller stops it with server.should_exit)
        return server.stopped_by
    finally:
        access_lines.drain(ACCESS_LOG_DRAIN_S)  # the last requests' lines, before the process exits

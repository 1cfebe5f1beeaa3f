"""`clef-gguf serve --ray`'s cluster: deploying ray_serve's application on a Ray cluster (a local one started here,
or the one at an address), serving until a signal, then draining the ingress and stopping what was started."""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import suppress

from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from ray.serve.schema import DeploymentStatus

from ..errors import DeploymentError
from ..runtime.ray_local import cluster, local_cluster_alive
from ..settings import ServeSettings
from .ray_private import stop_proxies
from .ray_serve import APP_NAME, INGRESS, RaySettings, build_app
from .run import url_host

# The time Ray may take to hand the ingress the drain call, beyond the drain itself.
DRAIN_CALL_MARGIN_S = 30.0
# What `serve --ray` drains at: the plain server's signals (server/run.DRAINED_AT).
STOPPING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGBREAK") if hasattr(signal, name))
WATCH_S = 0.02  # how often the stop looks at the local cluster's processes


class _Stopped(Exception):
    """A signal of STOPPING while `clef-gguf serve --ray` deploys or serves."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


def _why_not_deployed(error: RuntimeError) -> str:
    """Ray's reason, from the deployments' status: a replica constructor's traceback ends with its error."""
    try:
        deployments = serve.status().applications[APP_NAME].deployments
    except (KeyError, RayServeException):
        return str(error)
    reasons = [
        f"{name}: {d.message.strip().splitlines()[-1]}"
        for name, d in deployments.items()
        if d.status != DeploymentStatus.HEALTHY and d.message.strip()
    ]
    return "; ".join(reasons) or str(error)


def _drain(timeout_s: float) -> None:
    """The ingress refuses new requests (our 503) and lets those admitted finish, up to timeout_s (ClefIngress.drain)."""
    try:
        ingress = serve.get_deployment_handle(INGRESS, APP_NAME)
        left = ingress.drain.remote(timeout_s).result(timeout_s=timeout_s + DRAIN_CALL_MARGIN_S)
    # The application gone or replaced, its ingress lost; a deleted application's handle is a KeyError in Ray Serve.
    except (TimeoutError, KeyError, RayError, RayServeException) as e:
        print(f"the ingress did not drain: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return
    if left:
        print(f"{left} requests still running after the drain timeout are cut off", file=sys.stderr, flush=True)


def start_serve(settings: ServeSettings) -> None:
    """Ray Serve on the cluster this process is connected to: its HTTP proxy on settings' host and port, keeping idle
    connections its keep_alive. In a cluster whose Serve already runs, its HTTP options stay (Ray says so in its log)."""
    keep_alive = max(1, round(settings.limits.keep_alive))  # whole seconds, Ray's
    # No access log in Ray's proxy: the ingress writes the one line per request (observe.py), with its id.
    http = {"host": settings.host, "port": settings.port, "keep_alive_timeout_s": keep_alive}
    serve.start(http_options=http, logging_config={"enable_access_log": False})


def run(settings: RaySettings) -> int | None:
    """`clef-gguf serve --ray`: deploy on the Ray cluster at settings.scale.address, or on a local one started here, and
    serve until SIGTERM, SIGINT or SIGHUP; that signal, once stopped (None: stopped otherwise). Then the ingress
    refuses new requests with our 503 and Retry-After while those admitted finish (up to drain_timeout); then, on a
    local cluster, Serve's proxy stops (the port refuses connections) and the cluster with it, its session folder
    removed; on another cluster, the application is deleted (its proxy, the cluster's, then answers 404 for the
    routes). A signal while deploying (replicas Ray
    cannot place wait for resources forever) stops it the same way, with nothing to drain. Ray's HTTP proxy listens
    on settings.serve's host and port, keeping idle connections its keep_alive."""
    stopped_by = None
    with cluster(settings.scale.address, log_to_driver=True) as local:
        previous = {sig: signal.signal(sig, _stop) for sig in STOPPING}
        deployed = False
        try:
            start_serve(settings.serve)
            try:
                serve.run(build_app(settings), name=APP_NAME, route_prefix="/")  # returns once every replica is healthy
            except RuntimeError as e:  # Ray's "Deploying application ... failed", after its own retries
                raise DeploymentError(_why_not_deployed(e)) from None
            deployed = True
            where = f"http://{url_host(settings.serve.host)}:{settings.serve.port}/v1/systemone"
            print(f"serving {APP_NAME} on {where} (Ray Serve)", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)  # until a signal raises _Stopped
        except _Stopped as e:
            stopped_by = e.signum
        finally:
            for sig, handler in previous.items():  # a second signal cuts the drain short
                signal.signal(sig, handler)
            _stop_serving(deployed, settings.serve.drain_timeout, local)
    return stopped_by


def _stop_serving(deployed: bool, drain_timeout: float, local: bool) -> None:
    """The ingress drained; then a local cluster's proxies stopped (the cluster stops after), or on another cluster
    the application deleted.

    A local cluster's processes are in this process's process group: a signal sent to the group (a terminal's,
    `timeout`'s, a service manager's stop of the whole unit) stops them too, and every call into a cluster whose GCS is
    gone waits a minute for it (then Ray ends the process, exit 1). So the stop runs aside while this thread watches
    those processes, and leaves it at once when one has ended: nothing is left to drain."""
    if not local:
        if deployed:
            _drain(drain_timeout)
        with suppress(RayServeException):  # Serve never started, or someone shut it down
            serve.delete(APP_NAME)  # nothing left to drain, unless it never served
        return

    def stop() -> None:
        if deployed:
            _drain(drain_timeout)
        stop_proxies()

    stopping = threading.Thread(target=stop, name="clef-serve-stop", daemon=True)
    stopping.start()
    while stopping.is_alive():
        if not local_cluster_alive():  # (ray_local.cluster then leaves it: runtime/ray_local.driver_abandoned)
            return
        stopping.join(WATCH_S)

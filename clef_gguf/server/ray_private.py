"""Ray Serve's private API, in one place: what `clef-gguf serve --ray` needs that Serve does not offer publicly.

The `ray` extra pins Ray 2.60 (pyproject.toml) because of what is here: the names of Serve's namespace and proxy
actors (serve/_private/constants.py) and the ProxyActor's uvicorn server and its serving task (serve/_private/proxy.py,
http_util.py). Where a later Ray changes them, stop_proxies falls back to killing the proxies.
"""

from __future__ import annotations

import time
from contextlib import suppress

import ray
from ray.exceptions import RayError
from ray.serve._private.constants import SERVE_NAMESPACE, SERVE_PROXY_NAME

PROXY_STOP_TIMEOUT_S = 10.0


def stop_proxies() -> None:
    """Serve's HTTP proxies stop listening (the port then refuses connections) and finish sending the answers they
    hold, as uvicorn stops at SIGTERM (Server.shutdown): on a cluster about to stop, after _drain.

    Not serve.shutdown: it deletes the application first, and from then on until the proxies stop (2 to 3 s) Ray's
    proxy answers every request with its own 404, "Path '/v1/systemone' not found" in text/plain; and it waits on the
    controller's graceful_shutdown task, which returns only when the controller kills itself (ray.kill), which the
    raylet reports as "Task ServeController.graceful_shutdown failed ... killed by `ray.kill`" at every stop (so it
    does for any call left waiting on the controller: the controller is left to ray.shutdown). Not a kill of the
    proxies: the ingress counts a request done once it has handed its answer to the proxy, not once the proxy has
    sent it, and a killed proxy drops what it has not sent yet."""
    proxies = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == SERVE_NAMESPACE and actor["name"].startswith(SERVE_PROXY_NAME):
            with suppress(ValueError):  # gone meanwhile
                proxies.append(ray.get_actor(actor["name"], namespace=SERVE_NAMESPACE))
    # ProxyActor's uvicorn server, as its ready() got it from start_asgi_http_server (Ray 2.60's serve/_private/proxy.py,
    # http_util.py); its serve() task ends once the server has shut down. Where Ray's internals differ, a kill.
    for proxy in proxies:
        try:
            ray.get(
                proxy.__ray_call__.remote(lambda actor: setattr(actor._start_http_server_task.result()[1], "should_exit", True)),
                timeout=PROXY_STOP_TIMEOUT_S,
            )
        except RayError:
            ray.kill(proxy, no_restart=True)
    deadline = time.monotonic() + PROXY_STOP_TIMEOUT_S
    for proxy in proxies:
        with suppress(RayError):  # killed, or gone
            while not ray.get(
                proxy.__ray_call__.remote(lambda actor: actor._running_http_server_task.done()), timeout=PROXY_STOP_TIMEOUT_S
            ):
                if time.monotonic() > deadline:  # a client still sending its body, or not reading its answer
                    ray.kill(proxy, no_restart=True)  # (its process would hold up ray.shutdown's stop of the raylet)
                    break
                time.sleep(0.05)

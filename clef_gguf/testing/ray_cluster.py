"""A local Ray cluster on loopback, Serve started on it, and the processes of a Serve application's replicas and the
requests each holds: for the Ray tests (tests/conftest.py's session cluster) and tools/bench/bench_ray.py.

Importing this module prepares the process for the cluster it starts (Ray reads both variables when it is
imported: import this first); it imports ray itself only when called, so that a test module can import it
before it knows whether ray is installed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..runtime.ray_local import LOOPBACK_ENV, loopback_only

loopback_only()
# A cluster that ray.init starts requires Ray's token (~/.ray/auth_token, made when missing), and so then does
# every process that connects to it: this one, and the servers it starts.
os.environ.setdefault("RAY_AUTH_MODE", "token")

_MARK = "RAY_ADDRESS="
# Ray Serve starts a replica whose constructor raised up to 3 times (per replica) before it fails the deployment. A
# constructor that fails in a test fails every time (a context too small for the probe), and each try is a worker
# process loading the model: once is enough, unless the environment says otherwise. (The cluster's processes, Serve's
# controller among them, read it.)
_REPLICA_TRIES = {"RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1"}
# The cluster's owner: it starts Ray (GCS, raylet: its children, which die with it), prints the address and
# holds the cluster until its stdin closes, then stops it.
_OWNER = f"""
import sys, ray
context = ray.init(num_cpus=int(sys.argv[1]), include_dashboard=False, log_to_driver=False, object_store_memory=256 << 20)
print("{_MARK}" + context.address_info["address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""


@contextmanager
def local_cluster(num_cpus: int) -> Iterator[str]:
    """A Ray cluster of this machine on 127.0.0.1, this process connected to it as a driver: its address.

    A small process of its own starts and owns it: Ray starts its processes with fork (a preexec_fn), and a
    fork of a large process (a test session holding models and torch) fails with ENOMEM under the kernel's
    overcommit heuristic. num_cpus is what Ray may reserve (each replica reserves its threads), not the cores."""
    import ray

    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(num_cpus)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**_REPLICA_TRIES, **os.environ, LOOPBACK_ENV: "0"},
    )
    assert owner.stdin is not None and owner.stdout is not None
    try:
        address = ""
        for line in owner.stdout:
            if line.startswith(_MARK):
                address = line[len(_MARK) :].strip()
                break
        if not address:
            raise RuntimeError(f"the Ray cluster did not start (its owner exited with {owner.wait()})")
        ray.init(address=address, log_to_driver=False)
        yield address
    finally:
        ray.shutdown()  # a no-op where ray.init never ran
        owner.stdin.close()  # the owner stops the cluster
        try:
            owner.wait(120)
        except subprocess.TimeoutExpired:
            owner.kill()
            owner.wait()


def started_serve() -> int:
    """Ray Serve started on the cluster this process is connected to, as `serve --ray` starts it, its HTTP proxy on a
    free port of 127.0.0.1: that port. Every `serve --ray` that joins the cluster serves there (a cluster's Serve keeps
    the HTTP options it started with), one application at a time."""
    from ..server.ray_cluster import start_serve
    from ..settings import ServeSettings
    from .processes import free_port

    port = free_port()
    start_serve(ServeSettings(port=port))
    return port


def wait_deployed(log: Path, process: subprocess.Popen[Any], timeout_s: float) -> None:
    """Until `clef-gguf serve --ray` (its output in `log`) says it serves: serve.run returned, every replica healthy (its
    ingress answers /health before). AssertionError with the log's end if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while "serving clef-gguf on" not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def replica_pids(app: str | None = None) -> dict[str, list[int]]:
    """The processes of an application's replicas (`clef-gguf serve --ray`'s by default), by deployment."""
    pids: dict[str, list[int]] = {}
    for deployment, pid, _ in _replicas(app):
        pids.setdefault(deployment, []).append(pid)
    return pids


def held_requests(deployment: str, app: str | None = None) -> dict[int, int]:
    """The requests each replica of a deployment holds now, by process: the count Ray's router probes
    (a method of Serve's replica actor, answered on a thread of its own while the user code computes)."""
    import ray

    replicas = [(pid, actor) for name, pid, actor in _replicas(app) if name == deployment]
    return {pid: ray.get(actor.get_num_ongoing_requests.remote(), timeout=30) for pid, actor in replicas}


def _replicas(app: str | None) -> Iterator[tuple[str, int, Any]]:
    """(deployment, pid, actor) of each live replica of an application, from the actors Serve names for them.
    (ray.util.state would list them too, but it asks the dashboard, which a loopback test cluster does not run.)"""
    import ray

    from ..server.ray_serve import APP_NAME

    app = app or APP_NAME
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]  # SERVE_REPLICA::APP#DEPLOYMENT#ID
        if name.startswith(f"SERVE_REPLICA::{app}#"):
            try:
                handle = ray.get_actor(name, namespace=actor["namespace"])
                pid = ray.get(handle.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
            except (ValueError, ray.exceptions.RayError):  # gone between the listing and the call
                continue
            yield name.split("#")[1], pid, handle


def own_cluster_env() -> tuple[dict[str, str], Path]:
    """The environment of a command that starts a local Ray cluster of its own (no RAY_ADDRESS), and that cluster's
    folder (RAY_TMPDIR, short: Ray's socket paths must fit AF_UNIX's 107 bytes)."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(ray_tmp)}, ray_tmp


def end_own_cluster(process: subprocess.Popen[Any], ray_tmp: Path) -> list[Path]:
    """The session folders such a command left; its process group killed if it still runs, its folder removed."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    sessions = list((ray_tmp / "ray").glob("session_2*"))
    shutil.rmtree(ray_tmp, ignore_errors=True)
    return sessions

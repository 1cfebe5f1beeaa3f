"""A Ray cluster of one machine, on loopback only: Ray's single-node mode.

Ray binds its processes (GCS, raylet, workers, object manager) to the node's IP, which it finds with a
UDP connect towards the outside; with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (ray/_private/ray_constants.py,
read by services.get_node_ip_address) the node's IP is 127.0.0.1 and every Ray server listens there only:
what Ray does by default on macOS and Windows, where it supports no multi-machine cluster. A cluster of
several machines needs the opposite (`ray start --head` then `ray start --address`).

Ray reads the variable when it is imported, so loopback_only() must run first. (Ray Serve replicas also
open an inter-deployment gRPC port on all interfaces, "[::]:0", whatever this says: serve/_private/replica.py.)
Also what starting a local cluster needs around ray.init: the working directory its workers import clef_gguf
from (imported_from_here), and its session folder removed after (remove_session). This module imports nothing of
Ray: the plain server never imports Ray.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_only() -> None:
    """Before `import ray`: a cluster this process starts listens on 127.0.0.1 only (unless the variable is set)."""
    os.environ.setdefault(LOOPBACK_ENV, "0")


@contextmanager
def imported_from_here() -> Iterator[None]:
    """The working directory, for the time of ray.init, the folder this process imported clef_gguf from.

    Ray puts the driver's working directory first on every worker's sys.path (ray/_private/worker.py, the job's
    py_driver_sys_path): run from a checkout, replicas imported its clef_gguf, which has no built libclef_head, not
    the installed one. From here, they import the package the driver runs (the installed one, or an editable
    install's checkout), whatever the directory `clef-gguf serve --ray` was started in. Every path Ray is given
    is absolute (launch.py resolves them), so nothing else reads the working directory meanwhile."""
    started_in = os.getcwd()
    os.chdir(Path(__file__).resolve().parents[2])  # clef_gguf/server/ray_local.py -> the folder holding clef_gguf
    try:
        yield
    finally:
        os.chdir(started_in)


def remove_session(session: Path) -> None:
    """A stopped local cluster's session folder (its logs, also shown on stderr, and sockets), and Ray's session_latest
    link when it names it: else Ray's temporary folder keeps a folder per `serve --ray` or `decide --ray`."""
    latest = session.parent / "session_latest"
    if latest.is_symlink() and latest.resolve() == session.resolve():
        latest.unlink()
    for _ in range(50):  # a worker that outlives the raylet by a moment may still write its log there
        shutil.rmtree(session, ignore_errors=True)
        if not session.exists():
            return
        time.sleep(0.1)

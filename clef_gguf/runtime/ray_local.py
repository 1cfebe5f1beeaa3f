"""A Ray cluster of one machine, on loopback only: Ray's single-node mode.

Ray binds its processes (GCS, raylet, workers, object manager) to the node's IP, which it finds with a
UDP connect towards the outside; with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (ray/_private/ray_constants.py,
read by services.get_node_ip_address) the node's IP is 127.0.0.1 and every Ray server listens there only:
what Ray does by default on macOS and Windows, where it supports no multi-machine cluster. A cluster of
several machines needs the opposite (`ray start --head` then `ray start --address`).

Ray reads the variable when it is imported, so loopback_only() must run first. (Ray Serve replicas also
open an inter-deployment gRPC port on all interfaces, "[::]:0", whatever this says: serve/_private/replica.py.)
Also what starting a local cluster needs around ray.init: the working directory its workers import clef_gguf
from (imported_from_here), and its session folder removed after (remove_session); and the one start, join and stop
of a cluster (cluster) that `serve --ray` (server/ray_cluster.py) and the dataset mode on Ray (dataset_ray.py) share.
This module imports nothing of Ray at its top: the plain server never imports Ray.

Joining a cluster at an address (join) is bounded: by default Ray waits up to 30 s for the GCS there, 20 times over,
while its C++ code holds the main thread (no Python signal handler runs): minutes for an address where no cluster
answers. Here an address that takes no connection is refused at once, and Ray tries one connect of CONNECT_S.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from ..errors import SettingsError

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
CONNECT_S = 10  # Ray's wait for the GCS of a cluster at an address (its py_gcs_connect_timeout_s; Ray's default: 30)
PROBE_S = 5.0  # a TCP connect to that address first: a closed port or an unreachable host is refused in this time
MONITOR = "monitor"  # Ray's autoscaler monitor, as a local cluster's node names its process (ray_constants)


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
    os.chdir(Path(__file__).resolve().parents[2])  # clef_gguf/runtime/ray_local.py -> the folder holding clef_gguf
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


def bounded_connect() -> None:
    """Before `import ray` (Ray reads its C++ settings then), for a cluster at an address: one connect to its GCS, of
    CONNECT_S, not 20 of 30 s (RAY_py_gcs_connect_timeout_s; RAY_gcs_server_port_wait_time_s counts the tries). Not
    for a cluster started here: the wait for its GCS to start reads the second one too."""
    os.environ.setdefault("RAY_py_gcs_connect_timeout_s", str(CONNECT_S))
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "1")


def probe(address: str) -> None:
    """An address (host:port, as Ray resolves it: localhost is the node's IP) that takes no TCP connection is a
    SettingsError at once. A ray:// address is left to Ray."""
    from ray._private.services import canonicalize_bootstrap_address, parse_address  # (Ray's own resolution)

    if "://" in address:
        return
    try:
        resolved = canonicalize_bootstrap_address(address)
        parsed = parse_address(resolved) if resolved else None
    except (ValueError, ConnectionError) as e:
        raise SettingsError(f"--address {address}: not a Ray cluster's address ({e})") from None
    if parsed is None:  # ("local")
        return
    host, port = parsed
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_S).close()
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or e
        raise SettingsError(f"no Ray cluster answers at {address} ({host}:{port}: {why})") from None


class Stopped(KeyboardInterrupt):
    """A signal that stopped ray.init, as the CLI's handler raises it (its `signum`: exit 128+N)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def join(address: str | None, **init: Any) -> Any:
    """ray.init(address=address, **init), its context; None: a local cluster started here (address="local"). At an
    address, bounded (bounded_connect ran before Ray was imported): where no cluster answers, a SettingsError (exit 2)
    within seconds.

    ray.init makes SIGTERM sys.exit(15) in the driver (with a local cluster: its processes killed, then exit 1): the
    caller's own handler (the CLI's: 128+N, partial files removed, the cluster stopped by the caller's cleanup) is put
    back, and a SIGTERM during ray.init stops the command as that handler would have. A caller with none of its own
    (`serve --ray`, which sets its own for the drain) keeps Ray's: a second SIGTERM cutting the drain short still stops
    a local cluster's processes."""
    import ray

    if address is not None:
        probe(address)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM)
    previous = previous if callable(previous) else None
    try:
        return ray.init(address=address or "local", **init)
    except ConnectionError as e:
        if address is None:
            raise
        raise SettingsError(f"no Ray cluster answers at {address}: {e}") from None
    except SystemExit as e:
        if e.code == signal.SIGTERM:  # (Ray's handler ran)
            raise Stopped(signal.SIGTERM) from None
        raise
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _node_processes(kind: str | None = None) -> list[Any]:
    """The processes (Popen) of the local cluster this process started (its GCS, raylet, monitor...), or those of one
    `kind`; [] when it started none. Ray's private API: the node its driver keeps (ray/_private/node.py)."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    processes = getattr(node, "all_processes", None) or {}
    return [info.process for k, infos in processes.items() if kind in (None, k) for info in infos]


def local_cluster_alive() -> bool:
    """Whether every process of the local cluster this process started still runs (True for a cluster at an address).
    Each runs as long as the cluster: one that ended was stopped, as its GCS and raylet are, or soon will be (they take
    seconds to stop at SIGTERM, the monitor and log monitor milliseconds)."""
    return all(process.poll() is None for process in _node_processes())


def _end_monitor() -> None:
    """Ray's autoscaler monitor of a local cluster, ended at once: ray.shutdown stops the cluster's processes one after
    the other, and waits a second for the monitor, which outlives its SIGTERM, before it kills it (measured: 1.0 s of
    an idle cluster's 1.1). The monitor holds nothing the driver's disconnect needs."""
    for process in _node_processes(MONITOR):
        if process.poll() is None:
            with suppress(OSError):  # (ended meanwhile)
                process.kill()


_abandoned: list[bool] = []  # a stopped cluster's driver left connected (_abandon_stopped_cluster)


def driver_abandoned() -> bool:
    """Whether this process's Ray driver was left connected to a local cluster that a signal stopped: its disconnect
    (ray.shutdown, which the interpreter's exit runs too) waits for the stopped GCS (8 s measured), so a command ends
    at once (os._exit), its cleanups done."""
    return bool(_abandoned)


def _abandon_stopped_cluster() -> None:
    """A local cluster a signal stopped along with this process (sent to the whole process group): its processes left
    to their own stop (killed, the raylet ends the driver's process at once, exit 1), the driver left connected
    (driver_abandoned)."""
    _abandoned.append(True)


@contextmanager
def cluster(address: str | None, *, log_to_driver: bool, num_cpus: int | None = None) -> Iterator[bool]:
    """Connected to the Ray cluster at `address` (join), or to a local one started here (None: `num_cpus` of it, Ray's
    count of the machine's by default, no dashboard) and stopped after: its processes first, then its session folder.
    Whether this started the cluster. A process already connected (a test session's cluster, a notebook) stays as it
    is, connected. The one start and stop of `serve --ray` and of the dataset mode on Ray."""
    import ray

    if ray.is_initialized():
        yield False
        return
    local = {"num_cpus": num_cpus, "include_dashboard": False} if address is None else {}
    with imported_from_here():  # (Ray puts the driver's working directory first on its workers' sys.path)
        context = join(address, log_to_driver=log_to_driver, **local)
    session = Path(context.address_info["session_dir"]) if address is None else None  # this run's, in Ray's temp folder
    try:
        yield session is not None
    finally:
        if session is not None and not local_cluster_alive():
            _abandon_stopped_cluster()
        else:
            if session is not None:
                _end_monitor()
            ray.shutdown(wait_for_processes=session is not None)  # its processes stopped before its folder goes
        if session is not None:
            remove_session(session)

"""A Ray cluster of one machine, on loopback only: Ray's single-node mode.

Ray binds its processes (GCS, raylet, workers, object manager) to the node's IP, which it finds with a
UDP connect towards the outside; with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (ray/_private/ray_constants.py,
read by services.get_node_ip_address) the node's IP is 127.0.0.1 and every Ray server listens there only:
what Ray does by default on macOS and Windows, where it supports no multi-machine cluster. A cluster of
several machines needs the opposite (`ray start --head` then `ray start --address`).

Ray reads the variable when it is imported, so loopback_only() must run first. (Ray Serve replicas also
open an inter-deployment gRPC port on all interfaces, "[::]:0", whatever this says: serve/_private/replica.py.)
This module imports nothing of Ray: the plain server never imports Ray.
"""

from __future__ import annotations

import os

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_only() -> None:
    """Before `import ray`: a cluster this process starts listens on 127.0.0.1 only (unless the variable is set)."""
    os.environ.setdefault(LOOPBACK_ENV, "0")

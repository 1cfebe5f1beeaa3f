"""A local Ray cluster on loopback, and the processes of a Serve application's replicas: for
tests/test_ray_serve.py and tools/bench_ray.py. Import it before anything imports ray."""

from __future__ import annotations

import os

from ..server.ray_local import loopback_only

loopback_only()

import ray  # noqa: E402

from ..server.ray_serve import APP_NAME  # noqa: E402


def start(num_cpus: int) -> str:
    """A Ray cluster of this machine, started by (and a child of) this process, on 127.0.0.1: its address.

    num_cpus is what Ray may reserve (each replica reserves its threads), not what the machine has."""
    context = ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, object_store_memory=256 << 20)
    return context.address_info["address"]


def replica_pids(app: str = APP_NAME) -> dict[str, list[int]]:
    """The processes of an application's replicas, by deployment, from the actors Serve names for them.

    (ray.util.state would say so too, but it asks the dashboard, which a loopback test cluster does not run.)"""
    pids: dict[str, list[int]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]  # SERVE_REPLICA::APP#DEPLOYMENT#ID
        if name.startswith(f"SERVE_REPLICA::{app}#"):
            deployment = name.split("#")[1]
            try:
                handle = ray.get_actor(name, namespace=actor["namespace"])
                pid = ray.get(handle.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
            except (ValueError, ray.exceptions.RayError):  # gone between the listing and the call
                continue
            pids.setdefault(deployment, []).append(pid)
    return pids

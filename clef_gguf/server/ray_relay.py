"""Adapter sources on Ray: the ingress fetches, the replicas ask the ingress (runtime/relay_source.py).

The ingress resolves every request's model name before any replica decides it, so it is the one process that talks
to a Hub source: it must see the Hub as `serve --ray` does. HubAccess carries the Hub's address and token from the
process that builds the application to the ingress, which may run on another node whose environment has neither. The
replicas never ask the Hub: a replica that has not loaded a fetched adapter asks the ingress for the file it holds
(ClefIngress.adapter_file), checks it against its own base and loads it. So a cluster downloads an adapter once.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import ClefError, SourceUnavailableError
from ..runtime.relay_source import Relay
from ..runtime.sources import AdapterSources

HUB_ENV = ("HF_ENDPOINT", "HF_TOKEN")  # what huggingface-hub reads at each call (runtime/hub_source.py)


@dataclass(frozen=True)
class HubAccess:
    """The Hub's address and token as the application's builder sees them (unset: the ingress's own environment).
    The token is never shown: not in this object's repr, logs or errors."""

    values: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_environment(cls) -> HubAccess:
        return cls({k: os.environ[k] for k in HUB_ENV if os.environ.get(k)})

    def apply(self) -> None:
        """(in the ingress's process, before its first fetch)"""
        os.environ.update(self.values)


async def adapter_file(sources: AdapterSources | None, name: str) -> tuple[bytes, str] | ClefError:
    """(the ingress) The bytes and revision of the adapter a remote source delivered for `name`, fetched now if need
    be; or the refusal, returned rather than raised (Ray would wrap it in its own error type)."""
    if sources is None:
        return SourceUnavailableError(f"the adapter {name!r} cannot be relayed: this server has no adapter sources")
    try:
        path, revision = await asyncio.to_thread(sources.delivered, name)
        return await asyncio.to_thread(path.read_bytes), revision
    except ClefError as e:
        return e
    except OSError as e:  # (evicted from the ingress's cache meanwhile: the replica asks again after its back-off)
        return SourceUnavailableError(f"the adapter {name!r} cannot be relayed now ({e.strerror or e})")


def ingress_relay(app_name: str, deployment: str, timeout_s: float) -> Relay:
    """(a replica) A Relay asking the application's ingress, from a replica's fetch thread (never its event loop)."""
    handle: list[Any] = []

    def relay(name: str) -> tuple[bytes, str]:
        from ray import serve

        if not handle:
            handle.append(serve.get_deployment_handle(deployment, app_name))
        got = handle[0].adapter_file.remote(name).result(timeout_s=timeout_s)
        if isinstance(got, ClefError):
            raise got
        return got  # type: ignore[no-any-return]

    return relay

"""A remote source's adapters taken from another process that fetched them, not from the source itself.

On Ray, the ingress resolves every request's model name before a replica sees it (server/ray_serve.py): the ingress
has fetched, converted, checked and cached what a Hub source delivered. A replica that has not loaded that adapter
asks the ingress for its bytes (a Relay) instead of asking the Hub: one download per cluster however many replicas
serve it, and replicas need neither the Hub's address nor its token. A replica checks the bytes against its base as it
checks any file (runtime/sources.py), and the request's identity (the sha256 the ingress gave the prompt) is compared
with what it loaded (runtime/catalog.py), so bytes that changed on the way are a refusal, never an answer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .adapter_files import ADAPTER_SUFFIX
from .sources import Bounds, Delivered, Source, Wanted

# A name -> (the adapter file the other process holds for it, as bytes; the revision it delivered). Raises the
# ClefError the other process's sources raised (not allowed, too large, unavailable: the same row here).
Relay = Callable[[str], tuple[bytes, str]]


class RelaySource:
    """`source`'s names (its claims, its allow list), delivered by `relay` as adapter files."""

    def __init__(self, source: Source, relay: Relay) -> None:
        self.source, self.relay = source, relay
        # (not metered: a relay asks the process that fetched, not the Hub; --adapter-fetches still bounds it)
        self.label, self.remote, self.metered = source.label, True, False

    def claims(self, name: str) -> Wanted | None:
        return self.source.claims(name)

    def well_formed(self, name: str) -> bool:
        return self.source.well_formed(name)

    def name_of(self, key: str) -> str | None:
        return self.source.name_of(key)

    def local(self, wanted: Wanted) -> Path | None:
        return None

    def fetch(self, wanted: Wanted, into: Path, bounds: Bounds) -> Delivered:
        # (no --adapter-max-size here: the other process held the download to it; what it hands on may be a
        # checkpoint's conversion, in f32, larger than what was downloaded)
        data, revision = self.relay(wanted.name)
        path = into / f"relayed{ADAPTER_SUFFIX}"
        path.write_bytes(data)
        return Delivered(path, revision, len(data))


def relayed(sources: list[Source], relay: Relay | None) -> list[Source]:
    """`sources` with each remote one's fetches made through `relay` (None: as they are)."""
    if relay is None:
        return sources
    return [RelaySource(s, relay) if s.remote else s for s in sources]

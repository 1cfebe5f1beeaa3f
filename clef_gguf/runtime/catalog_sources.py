"""The catalog's adapter sources (AdapterSet.adapter_sources): runtime/sources.py's AdapterSources built for one base,
its files checked against that base as the catalog checks a file (adapter_files.read_version) and its checkpoints
converted over the base's release (conversion/adapter.py, as `convert CHECKPOINT --base RELEASE --to-adapter`)."""

from __future__ import annotations

import threading
from pathlib import Path

from ..errors import SettingsError
from ..format.header import GGUFFile
from ..settings import AdapterSet
from .adapter_cache import AdapterCache
from .adapter_files import read_version, servable
from .folder_source import FolderSource
from .private_folder import PrivateFolder
from .relay_source import Relay, relayed
from .sources import HF_SCHEME, SERVED_KEPT, AdapterSources, Bounds, Convert, Source, SourceObserver


def parse_source(text: str) -> Source:
    """One --adapter-source: hf://ORG, hf://ORG/REPO, or a folder. (Here, above sources.py and hub_source.py alike,
    which builds on sources.py: the seam a new source plugs into.)"""
    if text.startswith(HF_SCHEME):
        from .hub_source import HubSource  # (huggingface-hub loaded only where a Hub source is served)

        return HubSource.parse(text)
    if "://" in text:
        raise SettingsError(f"the adapter source {text!r} is not one: a folder, {HF_SCHEME}ORG or {HF_SCHEME}ORG/REPO")
    return FolderSource(Path(text).expanduser())


def kept_names(sources: AdapterSources, listed: set[str], kept: int = SERVED_KEPT) -> list[tuple[str, str | None]]:
    """The names the disk cache holds besides `listed` (delivered before this process, or refused): each entry's key
    named back by the source that keys it so (the name a request would use), the most recently used first, with its
    kept refusal's message (None: an adapter file, checked again at its first request). Up to `kept` with the names
    delivered in this process, as those are; from the cache's index alone: no file is read, however many it holds."""
    found: list[tuple[str, str | None]] = []
    room = kept - len(sources.names())
    for entry in sources.cache.entries():
        if len(found) >= room:
            break
        name = next((n for n in (s.name_of(entry.key) for s in sources.sources) if n is not None), None)
        if name is not None and name not in listed and servable(name):
            found.append((name, entry.verdict[1] if entry.verdict is not None else None))
    return found


# A fetched checkpoint's LoRA is written in float32: it is small beside the base, and its answers are then the merged
# fine-tune's to float precision.
CONVERTED_TYPE = "f32"


def open_sources(
    adapter_set: AdapterSet,
    base: GGUFFile,
    base_identity: str,
    observer: SourceObserver | None = None,
    relay: Relay | None = None,
) -> AdapterSources | None:
    """The sources of `adapter_set` over `base`, or None when it names none (with `relay`, the remote ones' adapters
    come from another process: relay_source.py). SettingsError for one that is not."""
    if not adapter_set.adapter_sources:
        return None
    sources = relayed([parse_source(text) for text in adapter_set.adapter_sources], relay)
    pinned = set()
    for name in adapter_set.pins or ():
        claimed = next((w for w in (s.claims(name) for s in sources) if w is not None), None)
        if claimed is not None:
            pinned.add(claimed.key)
    try:
        cache = AdapterCache(adapter_set.adapter_cache, adapter_set.adapter_cache_size, pinned.__contains__, base_identity)
    except OSError as e:
        raise SettingsError(f"the adapter cache {adapter_set.adapter_cache} cannot be used: {e.strerror or e}") from None
    private, lock = PrivateFolder(), threading.Lock()

    def check(path: Path, name: str) -> None:
        read_version(base, base_identity, path, private, label=name, base_head=adapter_set.base_head).copy.close()

    convert: Convert | None = None
    release = adapter_set.adapter_base_release
    if release is not None:

        def convert(checkpoint: Path, out: Path) -> None:
            from ..conversion.adapter import convert_adapter  # (the converter loaded only when a checkpoint comes)

            with lock:  # (one conversion at a time: each holds the base release's tensors it reads)
                convert_adapter(checkpoint, release, out, CONVERTED_TYPE)

    a = adapter_set
    caps = {"new_per_minute": a.adapter_fetch_rate, "max_fetches": a.adapter_fetches, "refresh_s": a.adapter_refresh}
    bounds = Bounds(a.adapter_max_size, a.adapter_fetch_timeout, **caps)
    found = AdapterSources(sources, cache, bounds, check, convert, observer)
    found.owned.callback(private.close)
    return found

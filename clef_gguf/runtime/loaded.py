"""The adapters a decider has loaded: an LRU bounded by a count and by bytes (AdapterSet.max_adapters, adapter_memory),
by identity, and the observer told of each use, load, eviction and retirement.

Clef is a frozen base plus a LoRA and a head, and so is every clef-finetune fine-tune. A version is loaded from one
private copy of its file, read again and checked to be the version its prompts name (Catalog.reread): a file replaced
since is refused, never loaded under the old identity. While a version is loaded, a prompt that names it (encoded by
this process's catalog or another's: a Ray ingress's) is decided by it, replaced or not; once it is unloaded, only
the catalog knows it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

from ..format.header import GGUFFile
from ..llama.backbone import Backbone
from ..llama.lora import Handle, apply_lora, free_lora, load_lora
from ..llama.native_head import NativeHead
from .adapter_files import AdapterCopy
from .catalog import CatalogEntry


class AdapterObserver:
    """What a decider tells of its adapters (per-adapter metrics hang here): each event names the adapter, by the name
    of the request whose batch caused it (one file under two names is loaded once, under the first name asked). This
    one hears nothing: an observer overrides the events it counts."""

    def used(self, name: str, resident: bool) -> None:
        """A batch needed it: loaded already (a hit), or not."""

    def loaded(self, name: str, seconds: float, nbytes: int) -> None:
        """Read, checked and loaded in `seconds`."""

    def evicted(self, name: str, nbytes: int) -> None:
        """Unloaded to make room (its version still current)."""

    def retired(self, name: str, nbytes: int) -> None:
        """A replaced version unloaded: never loaded again."""


@dataclass(eq=False)
class LoadedAdapter:
    """One version of an adapter, loaded: its private copy (kept while loaded), its LoRA in llama.cpp, its head."""

    entry: CatalogEntry
    copy: AdapterCopy
    lora: Handle
    head: NativeHead

    def close(self) -> None:
        self.head.close()
        free_lora(self.lora)
        self.copy.close()


# A version's head over the base's file (its head tensors over the base's): NativeHead(base file, adapter=copy file).
HeadOf = Callable[[GGUFFile], NativeHead]


class LoadedAdapters:
    """The LRU of loaded versions, least recently used first, and the one the context applies (on the compute thread)."""

    def __init__(
        self,
        backbone: Backbone,
        head_of: HeadOf,
        bounds: tuple[int, int | None],
        observer: AdapterObserver,
        pins: frozenset[str] = frozenset(),
    ) -> None:
        self.backbone, self._head_of, self.observer = backbone, head_of, observer
        self.max_adapters, self.adapter_memory = bounds
        self.pins = pins  # (AdapterSet.pins) names never unloaded to make room once loaded
        self._loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()  # by identity
        self._applied: LoadedAdapter | None = None  # the adapter the context applies (None: the base alone)
        # The identities loaded, replaced whole on each change: read from other threads (/v1/models) without a lock.
        self.identities: frozenset[str] = frozenset()

    def entry(self, identity: str) -> CatalogEntry | None:
        """The loaded version of this identity (a prompt another catalog resolved is decided by it), else None."""
        loaded = self._loaded.get(identity)
        return None if loaded is None else loaded.entry

    def apply(self, entry: CatalogEntry | None, reread: Callable[[CatalogEntry], AdapterCopy]) -> NativeHead | None:
        """Make `entry` the context's (None: the base alone), loading it first from reread(entry) if it is not
        loaded; its head (None for the base)."""
        loaded = None
        if entry is not None:
            loaded = self._loaded.get(entry.identity)
            self.observer.used(entry.name, loaded is not None)
            if loaded is None:
                loaded = self._load(entry, reread)
            self._loaded.move_to_end(entry.identity)
        if loaded is not self._applied:
            apply_lora(self.backbone.ctx, loaded.lora if loaded is not None else None)
            self._applied = loaded
        return loaded.head if loaded is not None else None

    def _make_room(self, entry: CatalogEntry) -> None:
        """Unload the least recently used adapters until `entry` fits the count and the bytes (the one applied too:
        the context is switched to the base first), never a pinned one's current version."""

        def over() -> bool:
            used = sum(a.entry.nbytes for a in self._loaded.values())
            bytes_over = self.adapter_memory is not None and used + entry.nbytes > self.adapter_memory
            return bool(self._loaded) and (len(self._loaded) >= self.max_adapters or bytes_over)

        while over():
            oldest = next((k for k, a in self._loaded.items() if a.entry.name not in self.pins or not a.entry.current), None)
            if oldest is None:
                return  # (only pinned adapters loaded: the bound yields to the operator's pins)
            unloaded = self._loaded.pop(oldest)
            self.identities = frozenset(self._loaded)
            self._unload(unloaded)

    def _load(self, entry: CatalogEntry, reread: Callable[[CatalogEntry], AdapterCopy]) -> LoadedAdapter:
        """Its LoRA and its head, from one private copy of its version (kept until it is unloaded)."""
        started = time.perf_counter()
        copy = reread(entry)  # AdapterUnavailableError: the file is no longer this version
        with ExitStack() as stack:
            stack.callback(copy.close)
            self._make_room(entry)  # once its copy is read and checked: an adapter that fails evicts none
            lora = load_lora(self.backbone.model, copy.file, scratch=copy.file.path.parent)  # (the copy's own folder)
            stack.callback(free_lora, lora)
            head = self._head_of(copy.file)
            stack.pop_all()
        loaded = self._loaded[entry.identity] = LoadedAdapter(entry, copy, lora, head)
        self.identities = frozenset(self._loaded)
        self.observer.loaded(entry.name, time.perf_counter() - started, entry.nbytes)
        return loaded

    def _unload(self, loaded: LoadedAdapter) -> None:
        """Free an adapter's LoRA and head; it is loaded again when a batch needs it (unless it was replaced)."""
        if loaded is self._applied:
            apply_lora(self.backbone.ctx, None)
            self._applied = None
        loaded.close()
        event = self.observer.evicted if loaded.entry.current else self.observer.retired
        event(loaded.entry.name, loaded.entry.nbytes)

    @property
    def names(self) -> list[str]:
        """The adapters loaded now, least recently used first."""
        return [a.entry.name for a in self._loaded.values()]

    def close(self) -> None:
        """Unload every adapter (no event: the model is closing, not making room)."""
        if self._applied is not None:
            apply_lora(self.backbone.ctx, None)
            self._applied = None
        self.identities = frozenset()
        while self._loaded:
            self._loaded.popitem()[1].close()

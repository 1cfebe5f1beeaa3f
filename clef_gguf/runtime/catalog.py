"""The models a base answers as, by name and by identity: the base itself and each version of its adapters.

What a request's `model` (Workers AI's `lora`) resolves to needs only the base's file and the adapter files: their
names, their identities and their temperatures, and no llama.cpp. A request's name is resolved once (Catalog.resolve),
to a ModelRef that its prompt carries (EncodedPrompt.model) to the scheduler, the state cache, the decider (which loads
the entry: runtime/loaded.py) and the answer and metrics (its name). The encoder (runtime/encoder.py) holds the
catalog; a Ray ingress's and its replicas' catalogs are built from one AdapterSet, so that a name has one identity.

The catalog is three parts with one job each: the names (catalog_names.py: what a name stands for, the near matches
of an unknown one), the versions (catalog_versions.py: each file's versions by signature and identity, their private
copies, the 422-or-503 policy) and the refusals (catalog_versions.Refusals: the files that do not load, each with its
typed error, until it changes).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from ..check.description import ClefDescription
from ..check.metadata import check_temperatures
from ..errors import ClefError, IncompleteModelError, RequestError
from ..format.header import GGUFFile
from ..settings import AdapterSet
from .adapter_files import AdapterCopy, PrivateFolder, read_version
from .catalog_names import JEV_ALIAS, Names, name_of_file
from .catalog_sources import kept_names, open_sources
from .catalog_versions import CatalogEntry, Versions
from .relay_source import Relay
from .sources import SourceObserver

__all__ = ["JEV_ALIAS", "Catalog", "CatalogEntry", "Listed", "ModelRef", "adapter_file_identity", "adapter_temperatures"]


@dataclass(frozen=True)
class ModelRef:
    """What a request's model name resolved to, once (Catalog.resolve), carried by its prompt: the identity (one batch
    is one model's; the state cache's keys), the name its answer and the metrics give, and the entry the decider
    loads. Equal refs name the same model by the same name, whichever catalog resolved them."""

    identity: str
    name: str
    entry: CatalogEntry = field(compare=False, repr=False)
    catalog: str = field(default="", compare=False, repr=False)  # the key of the Catalog that resolved it


@dataclass(frozen=True)
class Listed:
    """An adapter name a request may try, as the catalog knows it now."""

    name: str
    identity: str | None  # its file's current version's; None when it is refused, or not read yet (kept on disk)
    refused: str | None = None  # why a request naming it is refused now (the message the request would get)


def adapter_temperatures(path: str | Path) -> dict[str, float]:
    """An adapter file's own softmax temperatures (clef.decision.temperature.*: calibrate --adapter writes them)."""
    adapter = GGUFFile.read(path)  # (read, not mapped: the file may change while a command runs)
    try:
        problems, _, temperatures = check_temperatures(adapter.header)
    finally:
        adapter.close()
    if problems:
        raise IncompleteModelError(f"{path}: {problems[0].message}")
    return temperatures


def adapter_file_identity(base: GGUFFile, base_identity: str, path: Path, base_head: bool = False) -> str:
    """What `base` with the adapter file at `path` answers as (ClefModel's identity with adapter=path): the file
    read once, validated against the base as loading validates it. OSError when it cannot be read."""
    into = PrivateFolder()
    try:
        version = read_version(base, base_identity, path, into, label=str(path), base_head=base_head)
        version.copy.close()
        return version.identity
    finally:
        into.close()


class Catalog:
    """The base and its adapters, by name and by identity; thread-safe. The named adapters are validated against the
    base at once (a bad file is refused at load, not on a request); a folder's files when first named."""

    def __init__(
        self,
        base: GGUFFile,
        description: ClefDescription,
        base_identity: str,
        adapter_set: AdapterSet,
        source_observer: SourceObserver | None = None,
        relay: Relay | None = None,
    ) -> None:
        self.base = CatalogEntry(description.name, base_identity, description.temperatures)
        self.key = secrets.token_hex(8)  # its ModelRefs' (a prompt resolved by another catalog is looked up: adopt)
        self._names = Names(description.name, adapter_set)
        self.base_names, self.serves_adapters = self._names.base_names, self._names.serves_adapters
        self._versions = Versions(base, self.base, adapter_set.base_head)
        self.pinned: CatalogEntry | None = None
        self.sources = None
        try:
            self.sources = self._names.sources = open_sources(adapter_set, base, base_identity, source_observer, relay)
            for name, path in self._names.named.items():
                self._versions.first(name, path)
            for name in adapter_set.pins or ():  # (fetched and checked now: a pin that cannot load stops the start)
                self.entry(name)
            # With `adapter`, every request is that fine-tune's, whatever model it names (decide/eval --adapter); its
            # name (its file's) is only what answers say: a request cannot pick another.
            pinned = adapter_set.adapter
            if pinned is not None:
                self.pinned = self._versions.first(name_of_file(Path(pinned)), Path(pinned))
        except BaseException:
            self.close()
            raise

    def names(self) -> list[str]:
        """The adapters' names that load: the named ones, and the adapter folder's files that validate against the
        base (each read once per version of its file: cached by its signature)."""
        return [listed.name for listed in self.listing() if listed.identity is not None]  # (read, and loads)

    def listing(self) -> list[Listed]:
        """Every adapter name a request may try (what /v1/models lists), with its current version's identity, or why
        a request naming it is refused now (a file that does not load, or is gone). The sources' disk cache's other
        names too (delivered before a restart), as its index knows them: its refusals refused, its files not read."""
        if self.pinned is not None:
            return [Listed(self.pinned.name, self.pinned.identity)]
        found = []
        for name in self._names.candidates():
            try:
                found.append(Listed(name, self.entry(name).identity))
            except ClefError as e:  # (a RequestError's reason: what its 422 says, without the field it points to)
                found.append(Listed(name, None, e.reason if isinstance(e, RequestError) else str(e)))
        if self.sources is not None:
            found += [Listed(n, None, why) for n, why in kept_names(self.sources, {f.name for f in found})]
        return sorted(found, key=lambda listed: listed.name)

    def resolve(self, asked: str | None, field: str = "model") -> ModelRef:
        """The model a parsed request names (its `Request.named`: Workers AI's `lora`, else System One's `model`, the
        `field` it came in: Request.named_by), resolved once: the entry of its file's current version, and the name its
        answer and the metrics give: the name the request asked for for an adapter (one file may answer to two names),
        else the entry's own (the base's whatever name reached it; a pinned adapter's whatever the request named).
        Errors as `entry`, at `field`; a `lora` must name what answers (a fine-tune, or the base's own names)."""
        try:
            entry = self.entry(asked)
            if field == "lora" and asked is not None:
                self._check_lora(asked, entry)
        except RequestError as e:  # (the names' errors point to `model`: a request may have named it in `lora`)
            raise e if e.field == field else type(e)(e.reason, field) from None
        name = asked if isinstance(asked, str) and entry is not self.base and self.pinned is None else entry.name
        return ModelRef(entry.identity, name, entry, self.key)

    def _check_lora(self, name: str, entry: CatalogEntry) -> None:
        """Workers AI's `lora` names a fine-tune: never answered silently by another model. A model without adapters
        answers only to the base's names there (a `model` may be any client's own name: it still means the base); a
        pinned adapter (decide/eval --adapter) only to its own."""
        if self.pinned is not None:
            if name != self.pinned.name:
                raise RequestError(f"no fine-tune {name[:128]!r} here: {self.pinned.name} answers every request (--adapter)")
        elif entry is self.base and name not in self.base_names:  # (only without adapters: else `entry` refused it)
            raise RequestError(f"no fine-tune {name[:128]!r} here: {self.base.name} is loaded without adapters")

    def adopt(self, ref: ModelRef, loaded: CatalogEntry | None = None) -> ModelRef | None:
        """A ref as this catalog's: itself when this catalog resolved it, else (a prompt encoded elsewhere: another
        process, another load of the file) the entry of its identity: this catalog's (its name's own first), else
        `loaded` (the decider's loaded version of it, replaced since); None when neither has it."""
        if ref.catalog == self.key:
            return ref
        entry = self.of(ref.identity, ref.name) or loaded
        return None if entry is None else ModelRef(entry.identity, ref.name, entry, self.key)

    def entry(self, name: str | None) -> CatalogEntry:
        """The model a name names (None: the base), its file's current version. Without adapters every name is the
        base's, as before. RequestError (a 422) for a name nothing answers as or a file that never loads;
        AdapterUnavailableError (a 503) for an adapter whose file is gone or broken now."""
        if self.pinned is not None:
            return self.pinned
        if self._names.is_base(name):
            return self.base
        assert name is not None  # (is_base)
        source = self._names.source(name)
        return self._versions.current(name, source, name in self._names.named, lambda: self._names.unknown(name))

    def reread(self, entry: CatalogEntry) -> AdapterCopy:
        """The private copy of a version about to be loaded (again), refused unless it is still that version
        (catalog_versions.Versions.reread)."""
        return self._versions.reread(entry)

    def of(self, identity: str, name: str | None = None) -> CatalogEntry | None:
        """The entry of a version (`name`'s own first: catalog_versions.Versions.of)."""
        return self._versions.of(identity, name)

    def close(self) -> None:
        """Drop the private folder (the decider has closed the copies it loaded), and a private adapter cache."""
        self._versions.close()
        if self.sources is not None:
            self.sources.close()

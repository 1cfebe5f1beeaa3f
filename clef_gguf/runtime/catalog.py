"""The models a base answers as, by name and by identity: the base itself and each version of its adapters.

What a request's `model` (Workers AI's `lora`) resolves to needs only the base's file and the adapter files: their
names, their identities and their temperatures, and no llama.cpp. A request's name is resolved once (Catalog.resolve),
to a ModelRef that its prompt carries (EncodedPrompt.model) to the scheduler, the state cache, the decider (which loads
the entry: runtime/decider.py) and the answer and metrics (its name). The encoder (runtime/encoder.py) holds the
catalog; a Ray ingress's and its replicas' catalogs are built from one AdapterSet, so that a name has one identity.

An adapter file's version (runtime/adapter_files.py) is read once into a private copy, validated, and named by the
identity of those bytes. Each resolve stats the file (no lock held): a file changed since is a new version, read and
validated again, with a new identity, so that no state cached for the old one serves it; prompts encoded for the old
version are answered by it while it is loaded, else refused (AdapterUnavailableError). Reading and validating happen
outside the catalog's lock, once per name at a time: the base and the other names never wait on a file.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from ..check.description import ClefDescription
from ..check.metadata import check_temperatures
from ..errors import (
    AdapterUnavailableError,
    ClefError,
    CorruptModelError,
    IncompleteModelError,
    RequestError,
    SettingsError,
    TemporarilyUnavailableError,
)
from ..format.header import GGUFFile, Signature, signature_of
from ..inputs import file_kind
from ..settings import AdapterSet
from .adapter_files import (
    ADAPTER_SUFFIX,
    AdapterCopy,
    FolderListing,
    PrivateFolder,
    Version,
    read_version,
    reopen_version,
    servable,
)
from .adapter_files import unknown_name_message as _unknown_message

# Clef's public model names (System One's `model`, Workers AI's route): a request naming one is the base's.
BASE_NAMES = ("clef", "clef-flash")
JEV_ALIAS = "jev-latest"  # the SDKs' default model name (typesafe-sdk's): it means the loaded model, the base
RETIRED_KEPT = 64  # replaced versions a prompt encoded before the change may still name (a busy folder churns)
REFUSED_KEPT = 1 << 16  # folder files known not to load, by name, until they change
# A file changed this close to its read may change again within the same tick of its file system's clock (1 s and
# more on some), keeping its signature: such a read's signature is not trusted, and the next request reads it again.
RACY_NS = 2_000_000_000


@dataclass(eq=False)
class CatalogEntry:
    """One model the base answers as: the base itself (source None) or one version of an adapter over it. Catalog data
    only: loading it is the decider's (runtime/decider.py's LoadedAdapter)."""

    name: str
    identity: str  # what its prompts' ModelRef carries; the state cache's keys and the batches follow it
    temperatures: Mapping[str, float]
    source: Path | None = None  # the adapter file as named (read again, and checked, when it is loaded again)
    signature: Signature | None = None  # that file's (format/header.signature_of) when this version was read
    nbytes: int = 0  # its LoRA's and its head's bytes, loaded
    current: bool = True  # False once its name's file is another version: then it is never loaded again


@dataclass(frozen=True)
class ModelRef:
    """What a request's model name resolved to, once (Catalog.resolve), carried by its prompt: the identity (one batch
    is one model's; the state cache's keys), the name its answer and the metrics give, and the entry the decider
    loads. Equal refs name the same model by the same name, whichever catalog resolved them."""

    identity: str
    name: str
    entry: CatalogEntry = field(compare=False, repr=False)
    catalog: str = field(default="", compare=False, repr=False)  # the key of the Catalog that resolved it


Known = tuple[Signature | None, CatalogEntry]  # a name's file's version last read (None: read again), and its entry


def _name_of_file(path: Path) -> str:
    """An adapter's name from its file: NAME.adapter.gguf (or NAME.gguf) answers as NAME."""
    return path.name.removesuffix(ADAPTER_SUFFIX).removesuffix(".gguf") or path.name


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
        version = read_version(base, base_identity, path, into, base_head=base_head)
        version.copy.close()
        return version.identity
    finally:
        into.close()


def _adapter_folder(adapter_dir: str | Path | None) -> Path | None:
    if adapter_dir is None:
        return None
    folder = Path(adapter_dir)
    try:
        mode = os.stat(folder).st_mode
    except OSError as e:
        raise SettingsError(f"the adapter folder {folder} cannot be used: {e.strerror or 'does not exist'}") from None
    if not stat.S_ISDIR(mode):
        kind = "a file" if stat.S_ISREG(mode) else file_kind(mode)
        raise SettingsError(f"the adapter folder {folder} is {kind}, not a folder")
    return folder


class Catalog:
    """The base and its adapters, by name and by identity; thread-safe. The named adapters are validated against the
    base at once (a bad file is refused at load, not on a request); a folder's files when first named."""

    def __init__(self, base: GGUFFile, description: ClefDescription, base_identity: str, adapter_set: AdapterSet) -> None:
        self._base_file, self.base_head = base, adapter_set.base_head
        self.base = CatalogEntry(description.name, base_identity, description.temperatures)
        self.key = secrets.token_hex(8)  # its ModelRefs' (a prompt resolved by another catalog is looked up: adopt)
        # Every name the base answers to, whatever adapters are served: no adapter may take one.
        self.base_names = frozenset((description.name, *BASE_NAMES, JEV_ALIAS))
        self._dir = _adapter_folder(adapter_set.adapter_dir)
        self._paths = {name: Path(path) for name, path in (adapter_set.adapters or {}).items()}
        for name in self._paths:
            self._check_name(name)
        pinned = adapter_set.adapter
        if pinned is not None:  # (its name is only what answers say: a request cannot pick another)
            self._paths[_name_of_file(Path(pinned))] = Path(pinned)
        self._listing = FolderListing(self._dir, self.base_names) if self._dir is not None else None
        self._private = PrivateFolder()
        self._lock = threading.Lock()  # guards the dicts below, and never is held across I/O
        self._known: dict[str, Known] = {}  # by name: the file's version last read, its entry
        self._by_identity: dict[str, CatalogEntry] = {base_identity: self.base}
        self._retired: deque[CatalogEntry] = deque()  # versions replaced since, newest last
        self._reading: dict[str, Future[CatalogEntry]] = {}  # by name: the read in progress (one per name)
        self._refused: dict[str, tuple[Signature, type[ClefError], str]] = {}  # by name: files that do not load
        self.pinned: CatalogEntry | None = None
        try:
            for name, path in self._paths.items():
                try:
                    self._read(name, path, None, str(path))
                except OSError as e:  # (at load: the path is the operator's own, so the message names it)
                    raise CorruptModelError(f"{path}: cannot read ({e.strerror or e})") from None
        except BaseException:
            self.close()
            raise
        # With `adapter`, every request is that fine-tune's, whatever model it names (decide/eval --adapter).
        self.pinned = self._known[next(iter(self._paths))][1] if pinned is not None else None

    @property
    def serves_adapters(self) -> bool:
        return bool(self._paths) or self._dir is not None

    def _check_name(self, name: str) -> None:
        if not servable(name) or name in self.base_names:
            taken = ", ".join(sorted(self.base_names))
            rule = f"1 to 128 letters, digits and ._@/-, and none of the base's names ({taken})"
            raise SettingsError(f"an adapter's name is {rule}, not {name!r}")

    def _candidates(self) -> list[str]:
        """Every name a request may try besides the base's, sorted: the named adapters and the folder's files."""
        listed = self._listing.names() if self._listing is not None else []
        return sorted(set(self._paths) | set(listed)) if self._paths else listed

    def names(self) -> list[str]:
        """The adapters' names that load (what /v1/models lists): the named ones, and the adapter folder's files that
        validate against the base (each read once per version of its file: cached by its signature)."""
        if self.pinned is not None:
            return [self.pinned.name]
        found = []
        for name in self._candidates():
            try:
                self.entry(name)
            except ClefError:
                continue
            found.append(name)
        return found

    def resolve(self, asked: str | None) -> ModelRef:
        """The model a parsed request names (its `Request.named`: Workers AI's `lora`, else System One's `model`),
        resolved once: the entry of its file's current version, and the name its answer and the metrics give: the name
        the request asked for for an adapter (one file may answer to two names), else the entry's own (the base's
        whatever name reached it; a pinned adapter's whatever the request named). Errors as `entry`."""
        entry = self.entry(asked)
        name = asked if isinstance(asked, str) and entry is not self.base and self.pinned is None else entry.name
        return ModelRef(entry.identity, name, entry, self.key)

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
        if name is None or not self.serves_adapters or name in self.base_names:
            return self.base
        source = self._source_of(name)
        try:
            st = os.stat(source)
        except OSError as e:
            raise self._missing(name, source, e) from None
        found = signature_of(st)
        with self._lock:
            known, refused = self._known.get(name), self._refused.get(name)
        if known is not None and known[0] == found:
            return known[1]
        if refused is not None and refused[0] == found:
            raise refused[1](refused[2], "model") if issubclass(refused[1], RequestError) else refused[1](refused[2])
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:  # refused at once: never opened
            reason = "is empty" if stat.S_ISREG(st.st_mode) else f"is {file_kind(st.st_mode)}, not a regular file"
            raise self._refuse(name, source, found, known, f"{source.name} {reason}")
        return self._read_once(name, source, found, known)

    def _source_of(self, name: str) -> Path:
        path = self._paths.get(name)
        if path is not None:
            return path
        if self._dir is not None and servable(name) and "/" not in name:
            return self._dir / f"{name}{ADAPTER_SUFFIX}"
        raise RequestError(self._unknown(name), "model")

    def _unknown(self, name: str) -> str:
        return _unknown_message(name, self.base.name, self._candidates())

    def _missing(self, name: str, source: Path, e: OSError) -> ClefError:
        """A name whose file cannot be stat'ed: an adapter served before is unavailable, any other name unknown."""
        with self._lock:
            known = name in self._known
        if not known and name not in self._paths and isinstance(e, FileNotFoundError | NotADirectoryError):
            return RequestError(self._unknown(name), "model")
        why = "is gone" if isinstance(e, FileNotFoundError) else f"cannot be read ({e.strerror})"
        return AdapterUnavailableError(f"the adapter {name!r} cannot be used now: its file {source.name} {why}")

    def _refuse(self, name: str, source: Path, found: Signature, known: Known | None, why: str) -> ClefError:
        """A file that does not load: remembered until it changes. For an adapter that loaded before (or a named one)
        a 503, for it may be a file being replaced; else a 422 naming the file (never the server's path)."""
        if known is not None or name in self._paths:
            kind, message = AdapterUnavailableError, f"the adapter {name!r} cannot be used now: {why}"
        else:
            kind, message = RequestError, why
        with self._lock:
            if len(self._refused) >= REFUSED_KEPT:
                self._refused.clear()
            self._refused[name] = (found, kind, message)
        return RequestError(message, "model") if kind is RequestError else AdapterUnavailableError(message)

    def _read_once(self, name: str, source: Path, found: Signature, known: Known | None) -> CatalogEntry:
        """_read, once at a time per name: a second request for a name being read waits for that read (and only it)."""
        with self._lock:
            now, pending = self._known.get(name), self._reading.get(name)
            if now is not None and now[0] == found:
                return now[1]  # (read meanwhile by another request)
            mine = pending is None
            if pending is None:
                pending = self._reading[name] = Future()
        if not mine:
            return pending.result()
        try:
            try:
                entry = self._read(name, source, known, source.name)
            except OSError as e:
                raise self._read_failed(name, source, known, e) from None
            except TemporarilyUnavailableError:
                raise  # (this machine's state, not the file's: not remembered)
            except ClefError as e:
                raise self._refuse(name, source, found, known, str(e)) from None
            pending.set_result(entry)
            return entry
        except BaseException as e:
            pending.set_exception(e)
            raise
        finally:
            with self._lock:
                del self._reading[name]

    def _read_failed(self, name: str, source: Path, known: Known | None, e: OSError) -> ClefError:
        """A file that could not be read: gone, not regular (swapped since the stat), unreadable, or changing."""
        if isinstance(e, FileNotFoundError):  # (deleted since the stat)
            return self._missing(name, source, e)
        why = f"{source.name} cannot be read: {e.strerror or e}"
        if known is not None or name in self._paths or e.errno == errno.EAGAIN:  # (EAGAIN: changed while it was read)
            return AdapterUnavailableError(f"the adapter {name!r} cannot be used now: {why}")
        return RequestError(why, "model")  # (not remembered: a permission may be fixed without a new mtime)

    def _version(self, source: Path, label: str) -> Version:
        """`source` read into a private copy and validated (adapter_files.read_version); messages call it `label`."""
        return read_version(self._base_file, self.base.identity, source, self._private, label=label, base_head=self.base_head)

    def _read(self, name: str, source: Path, known: Known | None, label: str) -> CatalogEntry:
        """A new version of `name`'s file, read, validated and registered (the copy dropped: loading reads it again).
        A version's entry is its name's own: two names over equal bytes share an identity (and what is loaded and
        cached for it), never an entry, whose source is read again when it is loaded again."""
        started = time.time_ns()
        version = self._version(source, label)
        version.copy.close()
        signature = version.copy.signature
        # An adapter without temperature keys of its own answers with its base's (calibrate writes its own).
        temperatures = version.temperatures or dict(self.base.temperatures)
        new = CatalogEntry(name, version.identity, temperatures, source, signature, version.nbytes)
        with self._lock:
            same = (known[1] if known is not None else None, self._by_identity.get(new.identity))
            entry = next((e for e in same if e is not None and e.name == name and e.identity == new.identity), new)
            if entry is not new:  # the same bytes again under this name (read again, or a file restored)
                entry.signature, entry.current = signature, True
            self._by_identity[entry.identity] = entry
            self._known[name] = (signature if signature[4] < started - RACY_NS else None, entry)
            self._refused.pop(name, None)
            if known is not None and known[1] is not entry:
                self._retire(known[1])
        return entry

    def _retire(self, old: CatalogEntry) -> None:
        """(Under the lock) `old` is no name's current version any more: kept for the prompts encoded for it while it
        is loaded or among the RETIRED_KEPT newest replaced; never loaded again."""
        if any(e is old for _, e in self._known.values()):
            return  # (another name's file is that version still)
        old.current = False
        self._retired.append(old)
        while len(self._retired) > RETIRED_KEPT:
            dropped = self._retired.popleft()
            if not dropped.current and self._by_identity.get(dropped.identity) is dropped:
                del self._by_identity[dropped.identity]

    def reread(self, entry: CatalogEntry) -> AdapterCopy:
        """The private copy of a version about to be loaded (again): its file read again (not validated again: the
        version was, when it was read first), and refused (AdapterUnavailableError) unless it is still that version,
        byte for byte as its signature and identity say."""
        with self._lock:
            source, signature, current = entry.source, entry.signature, entry.current
        assert source is not None and signature is not None
        changed = f"the adapter {entry.name!r} changed after this request named it: send the request again"
        if not current:
            raise AdapterUnavailableError(changed)
        try:
            copy = reopen_version(self.base.identity, source, self._private, signature, entry.identity)
        except TemporarilyUnavailableError:
            raise
        except (OSError, ClefError):
            copy = None  # (read and validated again below, for the reason it is refused)
        if copy is not None:
            return copy
        try:
            again = self._version(source, source.name)
        except TemporarilyUnavailableError:
            raise
        except (OSError, ClefError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise AdapterUnavailableError(f"the adapter {entry.name!r} cannot be loaded now: {reason}") from None
        if again.copy.signature != signature or again.identity != entry.identity:
            again.copy.close()
            raise AdapterUnavailableError(changed)
        return again.copy

    def of(self, identity: str, name: str | None = None) -> CatalogEntry | None:
        """The entry of a version: `name`'s own when its file is that version (another name's file of the same bytes
        may change or go), else any."""
        with self._lock:
            known = self._known.get(name) if name is not None else None
            return known[1] if known is not None and known[1].identity == identity else self._by_identity.get(identity)

    def close(self) -> None:
        """Drop the private folder (the decider has closed the copies it loaded)."""
        with self._lock:
            self._known.clear()
        self._private.close()

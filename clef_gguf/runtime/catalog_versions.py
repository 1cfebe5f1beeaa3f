"""The versions of each adapter name's file (runtime/catalog.py's second part), and the files refused (its third).

A version is read once into a private copy, validated and named by the identity of those bytes (adapter_files.py).
Each request for a name stats its file (no lock held): a file changed since is a new version, read and validated
again, with a new identity, so that no state cached for the old one serves it; the old version is retired, kept for
the prompts encoded for it among the RETIRED_KEPT newest (and by the decider while it is loaded: runtime/loaded.py).
Reading and validating happen outside the lock, once per name at a time: the base and the other names never wait.

A file that cannot be used is a 422 (RequestError) or a 503 (AdapterUnavailableError): a 503 for an adapter that
loaded before or that the operator named, for it may be a file being replaced; a 422 for a name that never loaded.
A file that does not load is remembered with its error (Refusals) until it changes.
"""

from __future__ import annotations

import copy
import errno
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from ..errors import AdapterUnavailableError, ClefError, CorruptModelError, RequestError, TemporarilyUnavailableError
from ..format.header import GGUFFile, Signature, signature_of
from ..inputs import file_kind
from .adapter_files import AdapterCopy, PrivateFolder, Version, read_version, reopen_version

RETIRED_KEPT = 64  # replaced versions a prompt encoded before the change may still name (a busy folder churns)
REFUSED_KEPT = 1 << 16  # folder files known not to load, by name, until they change
# A file changed this close to its read may change again within the same tick of its file system's clock (1 s and
# more on some), keeping its signature: such a read's signature is not trusted, and the next request reads it again.
RACY_NS = 2_000_000_000


@dataclass(eq=False)
class CatalogEntry:
    """One model the base answers as: the base itself (source None) or one version of an adapter over it. Catalog data
    only: loading it is the decider's (runtime/loaded.py's LoadedAdapter)."""

    name: str
    identity: str  # what its prompts' ModelRef carries; the state cache's keys and the batches follow it
    temperatures: Mapping[str, float]
    source: Path | None = None  # the adapter file as named (read again, and checked, when it is loaded again)
    signature: Signature | None = None  # that file's (format/header.signature_of) when this version was read
    nbytes: int = 0  # its LoRA's and its head's bytes, loaded
    current: bool = True  # False once its name's file is another version: then it is never loaded again


Known = tuple[Signature | None, CatalogEntry]  # a name's file's version last read (None: read again), and its entry
Unknown = Callable[[], RequestError]  # the 422 for a name nothing answers as (made only when it is raised)


class Refusals:
    """Files that do not load, by name: the version refused (its signature) and the error it is refused with."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refused: dict[str, tuple[Signature, ClefError]] = {}

    def remember(self, name: str, signature: Signature, error: ClefError) -> ClefError:
        """Remember `error` for this version of the file; it, to raise."""
        with self._lock:
            if len(self._refused) >= REFUSED_KEPT:
                self._refused.clear()
            self._refused[name] = (signature, error)
        return error

    def of(self, name: str, signature: Signature) -> ClefError | None:
        """The error this version of the file was refused with (a copy to raise: one instance per request), or None."""
        with self._lock:
            refused = self._refused.get(name)
        return copy.copy(refused[1]) if refused is not None and refused[0] == signature else None

    def forget(self, name: str) -> None:
        with self._lock:
            self._refused.pop(name, None)


class Versions:
    """Each adapter name's versions, and every version by identity (the base's too); thread-safe."""

    def __init__(self, base_file: GGUFFile, base: CatalogEntry, base_head: bool) -> None:
        self._base_file, self.base, self._base_head = base_file, base, base_head
        self._private = PrivateFolder()
        self.refusals = Refusals()
        self._lock = threading.Lock()  # guards the dicts below, and never is held across I/O
        self._known: dict[str, Known] = {}  # by name: the file's version last read, its entry
        self._by_identity: dict[str, CatalogEntry] = {base.identity: base}
        self._retired: deque[CatalogEntry] = deque()  # versions replaced since, newest last
        self._reading: dict[str, Future[CatalogEntry]] = {}  # by name: the read in progress (one per name)

    def first(self, name: str, path: Path) -> CatalogEntry:
        """(At load) An adapter the operator named: read and validated now, its errors naming its path."""
        try:
            return self._read(name, path, None, str(path))
        except OSError as e:  # (at load: the path is the operator's own, so the message names it)
            raise CorruptModelError(f"{path}: cannot read ({e.strerror or e})") from None

    def current(self, name: str, source: Path, named: bool, unknown: Unknown) -> CatalogEntry:
        """The entry of the version `source` holds now (read and validated if it is a new one); `named`: the operator
        named it; `unknown()`: the error for a name whose file does not exist and never loaded."""
        try:
            st = os.stat(source)
        except OSError as e:
            raise self._missing(name, source, named, e, unknown) from None
        found = signature_of(st)
        with self._lock:
            known = self._known.get(name)
        if known is not None and known[0] == found:
            return known[1]
        refused = self.refusals.of(name, found)
        if refused is not None:
            raise refused
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:  # refused at once: never opened
            reason = "is empty" if stat.S_ISREG(st.st_mode) else f"is {file_kind(st.st_mode)}, not a regular file"
            raise self.refusals.remember(name, found, self._refusal(name, named or known is not None, f"{source.name} {reason}"))
        return self._read_once(name, source, (found, known), named, unknown)

    def _missing(self, name: str, source: Path, named: bool, e: OSError, unknown: Unknown) -> ClefError:
        """A name whose file cannot be stat'ed: an adapter served before is unavailable, any other name unknown."""
        with self._lock:
            known = name in self._known
        if not known and not named and isinstance(e, FileNotFoundError | NotADirectoryError):
            return unknown()
        why = "is gone" if isinstance(e, FileNotFoundError) else f"cannot be read ({e.strerror})"
        return AdapterUnavailableError(f"the adapter {name!r} cannot be used now: its file {source.name} {why}")

    @staticmethod
    def _refusal(name: str, unavailable: bool, why: str) -> ClefError:
        """A file that does not load: a 503 for an adapter that loaded before (or a named one), else a 422 naming the
        file (never the server's path)."""
        if unavailable:
            return AdapterUnavailableError(f"the adapter {name!r} cannot be used now: {why}")
        return RequestError(why, "model")

    def _read_once(
        self, name: str, source: Path, now_known: tuple[Signature, Known | None], named: bool, unknown: Unknown
    ) -> CatalogEntry:
        """_read, once at a time per name: a second request for a name being read waits for that read (and only it)."""
        found, known = now_known
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
                raise self._read_failed(name, source, (known is not None, named), e, unknown) from None
            except TemporarilyUnavailableError:
                raise  # (this machine's state, not the file's: not remembered)
            except ClefError as e:
                raise self.refusals.remember(name, found, self._refusal(name, known is not None or named, str(e))) from None
            pending.set_result(entry)
            return entry
        except BaseException as e:
            pending.set_exception(e)
            raise
        finally:
            with self._lock:
                del self._reading[name]

    def _read_failed(
        self, name: str, source: Path, known_named: tuple[bool, bool], e: OSError, unknown: Unknown
    ) -> ClefError:
        """A file that could not be read: gone, not regular (swapped since the stat), unreadable, or changing."""
        if isinstance(e, FileNotFoundError):  # (deleted since the stat)
            return self._missing(name, source, known_named[1], e, unknown)
        why = f"{source.name} cannot be read: {e.strerror or e}"
        if any(known_named) or e.errno == errno.EAGAIN:  # (EAGAIN: changed while it was read)
            return AdapterUnavailableError(f"the adapter {name!r} cannot be used now: {why}")
        return RequestError(why, "model")  # (not remembered: a permission may be fixed without a new mtime)

    def _version(self, source: Path, label: str) -> Version:
        """`source` read into a private copy and validated (adapter_files.read_version); messages call it `label`."""
        return read_version(self._base_file, self.base.identity, source, self._private, label=label, base_head=self._base_head)

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
            if known is not None and known[1] is not entry:
                self._retire(known[1])
        self.refusals.forget(name)
        return entry

    def _retire(self, old: CatalogEntry) -> None:
        """(Under the lock) `old` is no name's current version any more: kept for the prompts encoded for it among the
        RETIRED_KEPT newest replaced (and by the decider while it is loaded there); never loaded again."""
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
            again = reopen_version(self.base.identity, source, self._private, signature, entry.identity)
        except TemporarilyUnavailableError:
            raise
        except (OSError, ClefError):
            again = None  # (read and validated again below, for the reason it is refused)
        if again is not None:
            return again
        try:
            version = self._version(source, source.name)
        except TemporarilyUnavailableError:
            raise
        except (OSError, ClefError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise AdapterUnavailableError(f"the adapter {entry.name!r} cannot be loaded now: {reason}") from None
        if version.copy.signature != signature or version.identity != entry.identity:
            version.copy.close()
            raise AdapterUnavailableError(changed)
        return version.copy

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

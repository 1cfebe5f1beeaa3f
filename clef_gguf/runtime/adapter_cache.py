"""The disk cache of the adapters sources delivered (runtime/sources.py): --adapter-cache DIR, --adapter-cache-size.

One folder per entry (entries/<sha256 of its key>/), holding its adapter file (adapter.gguf: a GGUF as delivered, or
a checkpoint's conversion) and its record (entry.json: the key, the revision delivered, its size, the sha256 of its
file, its verdict: a refusal keeps its error's class and message and no file, and when its revision was last found
current at its source, for --adapter-refresh). A file is checked against its
sha256 when this process first reads it and again whenever its size, mtime or inode changed since: a file swapped or
damaged behind the record's back is never served as the adapter it was; its entry is removed (fetched again), unless
its record names it too (a new version, put by another process sharing the folder: taken up). A new version of an
entry (--adapter-refresh) is swapped in in one step where the system can (renameat2): its path never goes missing.
An entry is written whole in a staging folder and renamed into place, so that a crash leaves either the old entry
or the new one, never half of one; staging folders left by a crash are removed at the next start. Entries are kept
across restarts, verdicts included. Past the size bound the least recently used (its record's mtime, touched on each
use) are removed first; the pinned ones (--pin) never.
Without DIR the cache is a private folder of this process, removed at close.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import (
    AdapterBaseError,
    AdapterTooLargeError,
    ClefError,
    CorruptModelError,
    IncompleteModelError,
    NotADecisionModelError,
    RequestError,
)
from ..format.header import Signature, signature_of
from .private_folder import PrivateFolder, process_folder

RECORD = "entry.json"
ADAPTER = "adapter.gguf"
# The errors a verdict may hold: rebuilt from their class's name (a record is data, never code to run).
VERDICTS: dict[str, type[ClefError]] = {
    cls.__name__: cls
    for cls in (
        RequestError,
        AdapterTooLargeError,
        CorruptModelError,
        NotADecisionModelError,
        IncompleteModelError,
        AdapterBaseError,
    )
}


@dataclass
class Cached:
    """One entry: an adapter file delivered (path), or a refusal (verdict) with no file."""

    key: str
    revision: str
    nbytes: int
    path: Path | None  # the adapter file; None for a refusal
    verdict: tuple[str, str] | None  # (error class, message) of a refusal
    used: float  # when last used (the record's mtime)
    sha256: str = ""  # of the file, as delivered and checked
    verified: Signature | None = None  # the file's signature (format/header.py) when its sha256 was last seen
    checked: float = 0.0  # when its revision was delivered or last found current at its source (time.time())
    base: str = ""  # a refusal's: the identity of the base it was reached over (a file is checked at each load)

    def error(self) -> ClefError:
        """The refusal as its typed error, raised anew."""
        assert self.verdict is not None
        kind, message = VERDICTS.get(self.verdict[0], RequestError), self.verdict[1]
        return kind(message, "model") if issubclass(kind, RequestError) else kind(message)  # type: ignore[call-arg]


def verdict_of(error: ClefError) -> tuple[str, str] | None:
    """A refusal as a record keeps it, or None for an error that is not one to keep: not a verdict on the bytes (a
    repository not found may be created, or opened to the server's token, later)."""
    name = type(error).__name__
    if name not in VERDICTS or type(error) is RequestError:
        return None
    return name, error.reason if isinstance(error, RequestError) else str(error)


class AdapterCache:
    """The entries, by key; thread-safe (one lock over the index; files are written outside it)."""

    def __init__(
        self, root: str | Path | None, limit: int, pinned: Callable[[str], bool] = lambda key: False, base: str = ""
    ) -> None:
        # Without a folder: a private one, removed at close, or after a crash by the next process (private_folder.py).
        self._private = PrivateFolder() if root is None else None
        self.root = self._private.new_file("adapter-cache") if self._private is not None else Path(root)  # type: ignore[arg-type]
        self.limit, self._pinned = limit, pinned
        # A refusal holds over the base it was reached over (`base`: its identity): a server of another base sharing
        # the folder neither sees it nor is refused by it (it fetches and checks the name again, over its own base).
        self.base = base
        self._entries = self.root / "entries"
        self._entries.mkdir(parents=True, exist_ok=True)
        # Each process stages in a folder of its own: another process sharing the cache (a Ray node's ingress and
        # replicas) may be writing an entry now; a dead one's half-written entries are removed.
        self._staging = process_folder(self.root / "staging")
        self._lock = threading.Lock()
        self._index: dict[str, Cached] = {}
        for folder in self._entries.iterdir():
            found = _read_record(folder)
            if found is None:
                shutil.rmtree(folder, ignore_errors=True)
            elif self._ours(found):
                self._index[found.key] = found

    def get(self, key: str) -> Cached | None:
        """The entry of `key`, marked used; None when there is none (or its file is gone)."""
        folder = self._folder(key)
        with self._lock:
            found = self._index.get(key)
        if found is None:  # (another process sharing the folder may have written it: a Ray node's replicas)
            found = _read_record(folder)
            if found is None or found.key != key or not self._ours(found):
                return None
            with self._lock:
                self._index[key] = found
        try:
            os.utime(folder / RECORD)
            if found.path is not None and not _intact(found):
                found = self._replaced(key, found)
        except OSError:  # (removed by hand, or evicted by another process sharing the folder)
            with self._lock:
                if self._index.get(key) is found:
                    del self._index[key]
            return None
        found.used = time.time()
        return found

    def _ours(self, entry: Cached) -> bool:
        """Whether an entry holds for this cache's base: a file does (it is checked at its load); a refusal, if reached
        over the same base."""
        return entry.verdict is None or entry.base == self.base

    def _replaced(self, key: str, stale: Cached) -> Cached:
        """The entry of `key` once its file is not the one `stale` names: a new version put since (a refresh, by this
        process or another sharing the folder), else FileNotFoundError: a file swapped or damaged is removed (fetched
        again, never served as the adapter it was)."""
        fresh = _read_record(self._folder(key))
        if fresh is not None and (fresh.key != key or fresh.sha256 == stale.sha256 or not _intact(fresh)):
            fresh = None
        with self._lock:
            current = self._index.get(key)
            if current is not None and current is not stale:
                return current
            if fresh is None:
                shutil.rmtree(self._folder(key), ignore_errors=True)
                raise FileNotFoundError(stale.path)
            self._index[key] = fresh
        return fresh

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A folder to deliver into, on the cache's own disk (put renames out of it), removed afterwards."""
        folder = Path(tempfile.mkdtemp(dir=self._staging))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def put(self, key: str, revision: str, file: Path | None = None, verdict: tuple[str, str] | None = None) -> Cached:
        """A new entry (replacing any of `key`), written atomically: the file moved in (from staging), or a verdict;
        then the least recently used entries past the bound removed."""
        folder = self._folder(key)
        temporary = Path(tempfile.mkdtemp(dir=self._staging))
        nbytes, digest, seen = 0, "", None
        if file is not None:
            os.replace(file, temporary / ADAPTER)
            digest, stat = _sha256(temporary / ADAPTER), os.stat(temporary / ADAPTER)
            nbytes, seen = stat.st_size, signature_of(stat)
        now = time.time()
        base = self.base if verdict else ""
        _write_record(temporary / RECORD, key, revision, nbytes, digest, verdict, now, base)
        with self._lock:
            # (one step where it can: a reader of a refreshed entry finds the old version or the new, never none)
            if not _exchange(temporary, folder):
                if folder.exists():  # (replaced: the old one aside first, so that the rename below cannot fail on it)
                    os.replace(folder, temporary.with_name(temporary.name + ".old"))
                os.replace(temporary, folder)
                temporary = temporary.with_name(temporary.name + ".old")
            path = folder / ADAPTER if file is not None else None
            entry = Cached(key, revision, nbytes, path, verdict, now, digest, seen, now, base)
            self._index[key] = entry
        shutil.rmtree(temporary, ignore_errors=True)  # (the old entry, exchanged or set aside)
        self._evict(keep=key)
        return entry

    def confirm(self, key: str) -> None:
        """The entry of `key` found current at its source now: its record says so (kept across restarts)."""
        with self._lock:
            entry = self._index.get(key)
        if entry is None:
            return
        entry.checked = time.time()
        staged = Path(tempfile.mkdtemp(dir=self._staging)) / RECORD
        _write_record(staged, key, entry.revision, entry.nbytes, entry.sha256, entry.verdict, entry.checked, entry.base)
        with self._lock, contextlib.suppress(FileNotFoundError):  # (evicted meanwhile, or by another process)
            if self._index.get(key) is entry:
                os.replace(staged, self._folder(key) / RECORD)
        shutil.rmtree(staged.parent, ignore_errors=True)

    def _evict(self, keep: str) -> None:
        """Remove the least recently used entries (not pinned, not `keep`) until the files fit the bound."""
        with self._lock:
            total = sum(e.nbytes for e in self._index.values())
            for entry in sorted(self._index.values(), key=lambda e: e.used):
                if total <= self.limit:
                    break
                if entry.key == keep or entry.nbytes == 0 or self._pinned(entry.key):
                    continue
                shutil.rmtree(self._folder(entry.key), ignore_errors=True)
                del self._index[entry.key]
                total -= entry.nbytes

    def entries(self) -> list[Cached]:
        """The entries, the most recently used first, as the index knows them: no file is read (what /v1/models lists)."""
        with self._lock:
            return sorted(self._index.values(), key=lambda e: e.used, reverse=True)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._index)

    def _folder(self, key: str) -> Path:
        return self._entries / hashlib.sha256(key.encode()).hexdigest()[:32]

    def close(self) -> None:
        if self._private is not None:
            self._private.close()


def _read_record(folder: Path) -> Cached | None:
    """An entry from its folder, or None for one that is not whole (its file missing, its record unreadable) or none."""
    try:
        record_path = folder / RECORD
        record = json.loads(record_path.read_text(encoding="utf-8"))
        verdict = tuple(record["verdict"]) if record["verdict"] else None
        path = None if verdict else folder / ADAPTER
        digest = str(record.get("sha256") or "")
        if path is not None and (os.stat(path).st_size != int(record["bytes"]) or len(digest) != 64):
            return None
        used, checked = os.stat(record_path).st_mtime, float(record.get("checked") or 0.0)  # (none: before refreshes)
        key, revision, nbytes = str(record["key"]), str(record["revision"]), int(record["bytes"])
        base = str(record.get("base") or "")  # (none: a verdict kept before verdicts held per base)
        return Cached(key, revision, nbytes, path, verdict, used, digest, None, checked, base)  # type: ignore[arg-type]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_record(
    path: Path, key: str, revision: str, nbytes: int, digest: str, verdict: tuple[str, str] | None, checked: float, base: str
) -> None:
    kept = list(verdict) if verdict else None
    record = {"key": key, "revision": revision, "bytes": nbytes, "sha256": digest, "verdict": kept, "checked": checked}
    record["base"] = base
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())


def _exchange(new: Path, old: Path) -> bool:
    """Swap two folders in one step (Linux's renameat2 RENAME_EXCHANGE); False where it cannot (no `old` yet, a libc
    or a file system without it): then the caller renames in two."""
    if not sys.platform.startswith("linux"):  # (Windows has no process-wide CDLL(None); macOS no renameat2)
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_cwd, exchange = -100, 2  # (AT_FDCWD, RENAME_EXCHANGE)
    return bool(renameat2(at_cwd, os.fsencode(new), at_cwd, os.fsencode(old), exchange) == 0)


def _intact(entry: Cached) -> bool:
    """Whether the entry's file is still the one its record names: hashed at its first read in this process and
    whenever it changed since (a stat is the cheap look between)."""
    assert entry.path is not None
    seen = signature_of(os.stat(entry.path))  # (its ctime too: a rewrite with its mtime put back is seen)
    if seen == entry.verified:
        return True
    if seen[2] != entry.nbytes or _sha256(entry.path) != entry.sha256:
        return False
    entry.verified = seen
    return True


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()

"""Where an adapter name not otherwise served may come from (--adapter-source): the seam, and the fetching behind it.

A Source reads a requested name (`claims`: None when the name is not its own) and either names a file to read in
place (`local`: a folder's NAME.adapter.gguf) or delivers the adapter into a staging folder (`fetch`: a GGUF file,
or a clef-finetune checkpoint folder). The list of sources is the allow list: a name no source claims is never
fetched from anywhere. A new kind of source (S3, http) is a class with those methods (and `name_of`, the name one of
its cache keys stands for: /v1/models lists the cache) and a scheme in `parse_source` (runtime/catalog_sources.py).

AdapterSources turns a name into an adapter file the catalog reads: the disk cache first (runtime/adapter_cache.py);
else one fetch per key at a time however many ask (single flight), on a thread of its own, never the compute thread;
a checkpoint converted (conversion/adapter.py, as `convert --to-adapter`) and every file checked against the base
before it is kept. A name that names no commit follows its branch: its entry, once older than --adapter-refresh, has
the source asked for the branch's commit (`revision`, if the source has it) on its next use, and a new one fetched,
while the version held answers. A fetch that failed is not tried again before its back-off ends (the same error meanwhile); a
refusal of a pinned revision is kept in the cache, as the verdict on those bytes. A caller waits at most the
first-use bound (`fetch_timeout_s`), then gets SourceUnavailableError while the fetch goes on; a caller that must not
block (the server's intake, inside `not_waiting()`) gets FetchPending with the fetch's future to await instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from ..errors import (
    AdapterBaseError,
    AdapterNotAllowedError,
    AdapterTooLargeError,
    ClefError,
    ConversionError,
    ReleaseError,
    RequestError,
    SourceUnavailableError,
)
from .adapter_cache import AdapterCache, Cached, verdict_of
from .adapter_files import ADAPTER_SUFFIX
from .source_seam import Bounds, Delivered, Source, Wanted

log = logging.getLogger("clef_gguf")
HF_SCHEME = "hf://"
BACKOFF_S = 10.0  # a failed fetch's first back-off (server/problems.py's Retry-After says it); doubled per failure
BACKOFF_MAX_S = 300.0
SERVED_KEPT = 4096  # names delivered that /v1/models lists, the newest
FAILED_KEPT = 4096  # back-offs remembered, the newest: a flood of junk names cannot grow the table without bound


class SourceObserver:
    """What the fetching tells (the server's metrics hang on it); each call is cheap and never raises. This one hears
    nothing: an observer overrides the events it counts."""

    def looked_up(self, name: str, hit: bool) -> None:
        """The disk cache asked for a name's key."""

    def fetched(self, name: str, seconds: float, nbytes: int) -> None:
        """A delivery done."""

    def converted(self, name: str, seconds: float) -> None:
        """A checkpoint converted."""

    def failed(self, name: str, error: ClefError) -> None:
        """A fetch or conversion refused or failed."""


class FetchPending(Exception):  # noqa: N818 (not an error: a caller that must not block awaits `future`)
    """The adapter a name stands for is being fetched: `future` settles with its file (or the error) when done."""

    def __init__(self, name: str, future: Future[Path], timeout_s: float) -> None:
        super().__init__(f"the adapter {name!r} is being fetched")
        self.name, self.future, self.timeout_s = name, future, timeout_s


_NOT_WAITING: contextvars.ContextVar[bool] = contextvars.ContextVar("clef_sources_not_waiting", default=False)


@contextlib.contextmanager
def not_waiting() -> Iterator[None]:
    """Within it, a name being fetched raises FetchPending instead of blocking the calling thread."""
    token = _NOT_WAITING.set(True)
    try:
        yield
    finally:
        _NOT_WAITING.reset(token)


Convert = Callable[[Path, Path], None]  # (a checkpoint folder, the adapter file to write)
Check = Callable[[Path, str], None]  # (an adapter file, its name): raises a ClefError unless it fits the base


class AdapterSources:
    """The sources in order, the disk cache, the fetches in flight and the back-offs; thread-safe."""

    def __init__(
        self,
        sources: list[Source],
        cache: AdapterCache,
        bounds: Bounds,
        check: Check,
        convert: Convert | None = None,
        observer: SourceObserver | None = None,
    ) -> None:
        self.sources, self.cache, self.bounds = sources, cache, bounds
        self._check, self._convert = check, convert
        self.observer: SourceObserver = observer or SourceObserver()
        self.owned = contextlib.ExitStack()  # what close() closes besides the cache (the checks' private folder)
        self._lock = threading.Lock()
        self._flights: dict[str, Future[Path]] = {}
        self._failed: OrderedDict[str, tuple[float, int, ClefError]] = OrderedDict()  # key -> (retry at, failures, error)
        self._tokens, self._refilled = float(bounds.new_per_minute), time.monotonic()  # the new fetches' bucket
        self._names: dict[str, None] = {}  # the names delivered, oldest first

    def close(self) -> None:
        """Drop a private cache and what was opened for the checks (a fetch still running finds its cache gone)."""
        self.owned.close()
        self.cache.close()

    @property
    def remote(self) -> list[Source]:
        """The sources that fetch (the Hub's), not read in place."""
        return [s for s in self.sources if s.remote]

    def claimed(self, name: str) -> tuple[Source, Wanted] | None:
        """The first source claiming `name` (a folder's only when its file is there)."""
        for source in self.sources:
            wanted = source.claims(name)
            if wanted is None:
                continue
            path = source.local(wanted)
            if path is None or path.exists():
                return source, wanted
        return None

    def locate(self, name: str) -> Path | None:
        """The adapter file `name` stands for: read in place, cached, or fetched now (waiting at most the first-use
        bound, or raising FetchPending inside not_waiting()). None when no source claims the name; the refusal of a
        name no source may fetch (ADAPTER_NOT_ALLOWED) when it looks like a Hub name and Hub sources are served."""
        found = self.claimed(name)
        if found is None:
            if self.remote and "/" in name:
                if not any(s.well_formed(name) for s in self.remote):
                    raise RequestError(f"{name!r} is not an adapter name a source reads: ORG/REPO[@REVISION][/FOLDER]", "model")
                allowed = ", ".join(s.label for s in self.remote)
                raise AdapterNotAllowedError(
                    f"{name} is not from a source this server fetches adapters from ({allowed})", "model"
                )
            return None
        source, wanted = found
        local = source.local(wanted)
        if local is not None:
            return local
        cached = self.cache.get(wanted.key)
        self.observer.looked_up(name, cached is not None)
        if cached is not None:
            if cached.verdict is not None:
                raise cached.error()
            assert cached.path is not None
            self._refresh(source, wanted, cached)
            return self._served(name, cached.path)
        future = self._flight(source, wanted)
        if _NOT_WAITING.get() and not future.done():
            raise FetchPending(name, future, self.bounds.timeout_s)
        return self._served(name, wait_for(name, future, self.bounds.timeout_s))

    def delivered(self, name: str) -> tuple[Path, str]:
        """(for another process's relay: runtime/relay_source.py) The adapter file a remote source delivered for `name`,
        fetched now if it was not (as locate), and the revision delivered. A name only a folder, or nothing, claims
        is not allowed: a relay hands on what this process fetched, never its files."""
        found = self._remote(name)
        if found is None:
            raise AdapterNotAllowedError(f"{name} is not from a source this server fetches adapters from", "model")
        path = self.locate(name)
        assert path is not None  # (a remote source's name: fetched or refused)
        cached = self.cache.get(found[1].key)
        return path, cached.revision if cached is not None else ""

    def _served(self, name: str, path: Path) -> Path:
        """`name` delivered: listed by names() from now on (the newest SERVED_KEPT)."""
        with self._lock:
            self._names.pop(name, None)
            self._names[name] = None
            while len(self._names) > SERVED_KEPT:
                del self._names[next(iter(self._names))]
        return path

    def names(self) -> list[str]:
        """The names sources delivered in this process (what /v1/models lists besides the others)."""
        with self._lock:
            return list(self._names)

    def _remote(self, name: str) -> tuple[Source, Wanted] | None:
        """The remote source claiming `name` (one that fetches), and what it wants; None when no remote one does."""
        found = self.claimed(name)
        return found if found is not None and found[0].remote else None

    def _backing_off(self, key: str) -> ClefError | None:
        """(under the lock) The last failure of `key`'s fetch while its back-off lasts, else None."""
        failed = self._failed.get(key)
        return failed[2] if failed is not None and time.monotonic() < failed[0] else None

    def _flight(self, source: Source, wanted: Wanted, anew: bool = False) -> Future[Path]:
        """The fetch of `wanted` in flight, started if none is (one per key); its last failure during its back-off.
        `anew`: started whatever entry the cache holds (fetch_again)."""
        with self._lock:
            flight = self._flights.get(wanted.key)
            if flight is not None:
                return flight
            failed = self._backing_off(wanted.key)
            if failed is not None:
                raise _again(failed)
            cached = None if anew else self.cache.get(wanted.key)  # (a flight that ended since this request's look)
            if cached is not None and cached.path is not None:
                flight = Future()
                flight.set_result(cached.path)
                return flight
            if cached is not None:
                raise cached.error()
            return self._start(wanted, functools.partial(self._deliver, source, wanted), "fetch", source.metered)

    def _start(self, wanted: Wanted, work: Callable[[], Path], what: str, metered: bool) -> Future[Path]:
        """(under the lock) The flight of `wanted`'s key, running `work` on a thread of its own, once admitted."""
        self._admit(wanted.name, metered)
        self._flights[wanted.key] = flight = Future()
        flight.set_running_or_notify_cancel()  # (no waiter can cancel what the others wait for)
        threading.Thread(target=self._run, args=(wanted, flight, work), name=f"clef-adapter-{what}", daemon=True).start()
        return flight

    def fetch_again(self, name: str) -> Path | None:
        """`name` delivered anew now, whatever its entry's age (waiting at most the first-use bound): for a process
        whose adapters come through a relay when the other process holds a newer version (a Ray replica behind its
        ingress, which follows the branch: runtime/relay_source.py). None for a name no remote source claims."""
        found = self._remote(name)
        if found is None:
            return None
        return self._served(name, wait_for(name, self._flight(*found, anew=True), self.bounds.timeout_s))

    def _refresh(self, source: Source, wanted: Wanted, cached: Cached) -> None:
        """A look at the commit the branch of a name that names no commit is at, once its entry is older than refresh_s,
        on a thread of its own: one flight per key with the fetches, under their caps and back-off (skipped while they
        refuse it: a later use asks). The version held answers meanwhile, whatever the look's fate."""
        refresh = self.bounds.refresh_s
        if not refresh or wanted.pinned or not hasattr(source, "revision") or time.time() - cached.checked < refresh:
            return
        with self._lock:
            if wanted.key in self._flights or self._backing_off(wanted.key) is not None:
                return
            with contextlib.suppress(SourceUnavailableError):
                self._start(wanted, functools.partial(self._look, source, wanted, cached), "refresh", source.metered)

    def _look(self, source: Source, wanted: Wanted, cached: Cached) -> Path:
        """The branch's commit looked up (the source's `revision`: one cheap request): the entry confirmed if it holds
        it, else the new commit delivered (the catalog sees the file change: a new version)."""
        revision = source.revision(wanted, self.bounds)  # type: ignore[attr-defined]  # (_refresh: it has one)
        if revision == cached.revision:
            self.cache.confirm(wanted.key)
            assert cached.path is not None
            return cached.path
        try:
            return self._deliver(source, wanted)
        except ClefError as e:
            if verdict_of(e) is not None:  # (a commit refused: asked about again a refresh period on, not per back-off)
                self.cache.confirm(wanted.key)
            raise

    def _admit(self, name: str, metered: bool) -> None:
        """Refuse a new fetch (a 503 that asks no source anything) past the fetches at once or, for a metered source, the
        new ones a minute allows: distinct junk names must not cost a thread each, nor a Hub request each with the
        server's token."""
        if len(self._flights) >= self.bounds.max_fetches:
            raise SourceUnavailableError(
                f"the adapter {name!r} cannot be fetched now: {len(self._flights)} adapters are being fetched (at most "
                f"{self.bounds.max_fetches} at once); ask again later"
            )
        if not metered:
            return
        now = time.monotonic()
        rate = self.bounds.new_per_minute / 60.0
        self._tokens = min(float(self.bounds.new_per_minute), self._tokens + (now - self._refilled) * rate)
        self._refilled = now
        if self._tokens < 1.0:
            raise SourceUnavailableError(
                f"the adapter {name!r} cannot be fetched now: too many new adapter names (at most "
                f"{self.bounds.new_per_minute} fetches a minute); ask again later"
            )
        self._tokens -= 1.0

    def _run(self, wanted: Wanted, flight: Future[Path], work: Callable[[], Path]) -> None:
        try:
            path = work()
        except Exception as e:  # (one the source did not expect, e.g. of its client: a 503 too, never a 500 loop)
            error = e if isinstance(e, ClefError) else unreachable(wanted.name, type(e).__name__)
            if isinstance(e, OSError) and e.filename is not None:  # (the cache's disk: read-only, full; the operator's)
                log.error("the adapter cache %s cannot keep %s: %s", self.cache.root, wanted.name, e)
                error = SourceUnavailableError(f"the adapter cache cannot keep {wanted.name!r} now ({e.strerror or e})")
            self.observer.failed(wanted.name, error)
            with self._lock:
                failures = self._failed.pop(wanted.key, (0.0, 0, error))[1] + 1
                backoff = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (failures - 1))
                # (a copy: the raised one holds its traceback, and through it the fetch's frames and buffers)
                self._failed[wanted.key] = (time.monotonic() + backoff, failures, _again(error))
                while len(self._failed) > FAILED_KEPT:
                    self._failed.popitem(last=False)
                del self._flights[wanted.key]
            flight.set_exception(error)
            return
        except BaseException as e:  # (the process stopping: its waiters told, nothing remembered)
            with self._lock:
                del self._flights[wanted.key]
            flight.set_exception(e)
            raise
        with self._lock:
            self._failed.pop(wanted.key, None)
            del self._flights[wanted.key]
        flight.set_result(path)

    def _deliver(self, source: Source, wanted: Wanted) -> Path:
        """Fetch, convert a checkpoint, check against the base, keep: the cached file. A refusal of a pinned revision
        (a commit: its bytes never change) is kept as its verdict, the fetch's own (a release, too large) included."""
        with self.cache.staging() as stage:
            try:
                started = time.monotonic()
                delivered = source.fetch(wanted, stage, self.bounds)
                self.observer.fetched(wanted.name, time.monotonic() - started, delivered.nbytes)
                file = self._adapter_file(wanted, delivered, stage)
                self._check(file, wanted.name)
            except ClefError as e:
                verdict = verdict_of(e)
                if verdict is not None and wanted.pinned:
                    self.cache.put(wanted.key, wanted.key, verdict=verdict)
                raise
            cached = self.cache.put(wanted.key, delivered.revision, file=file)
        assert cached.path is not None
        return cached.path

    def _adapter_file(self, wanted: Wanted, delivered: Delivered, stage: Path) -> Path:
        if not delivered.path.is_dir():
            return delivered.path
        if self._convert is None:
            raise AdapterBaseError(
                f"{wanted.name} is a clef-finetune checkpoint: this server converts one only over the release its base "
                "was converted from (--adapter-base-release)"
            )
        started, out = time.monotonic(), stage / f"converted{ADAPTER_SUFFIX}"
        try:
            self._convert(delivered.path, out)
        except (ReleaseError, ConversionError) as e:  # (the checkpoint's fault: another base's, or shapes that differ)
            message = str(e).replace(str(delivered.path), wanted.name)
            raise AdapterBaseError(f"{wanted.name} does not convert over this server's base: {message}") from None
        self.observer.converted(wanted.name, time.monotonic() - started)
        return out


def _again(error: ClefError) -> ClefError:
    """A remembered failure raised anew (a copy: one exception object is never raised on two threads)."""
    copy = error.__reduce__()
    return copy[0](*copy[1])  # type: ignore[no-any-return]


def wait_for(name: str, future: Future[Path], timeout_s: float) -> Path:
    """A fetch's file, waited for at most `timeout_s` (the first-use bound): SourceUnavailableError past it."""
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        raise late(name, timeout_s) from None


def too_large(name: str, nbytes: int, limit: int, more: bool = False) -> AdapterTooLargeError:
    size = f"more than {nbytes}" if more else f"{nbytes}"
    return AdapterTooLargeError(f"{name} is {size} bytes, over this server's --adapter-max-size of {limit} bytes", "model")


def unreachable(name: str, why: str) -> SourceUnavailableError:
    return SourceUnavailableError(f"the adapter {name!r} cannot be fetched now ({why})")


def late(name: str, timeout_s: float) -> SourceUnavailableError:
    return SourceUnavailableError(f"the adapter {name!r} is still being fetched after {timeout_s:g} s: ask again later")

"""Adapter files as the catalog (runtime/catalog.py) sees them: one version's private copy, and a folder's names.

A version of an adapter file is read once, through one open file (inputs.open_regular: a FIFO refused; format/header
.copy_open: a file changed while read refused), into a private copy: a file in a folder of this process's own
(runtime/private_folder.py: mode 0700, removed at close, and after a crash by the next process). Its header is judged
first, from that open file, as validate judges it and against the base: junk, another base's adapter or a file longer
than its header says is refused before a byte is copied. The copy is what is validated in full, what the identity
hashes, and what llama.cpp's LoRA loader and the native head read by path. Another process may then replace, truncate
or delete the adapter file: nothing here maps or reopens it, so no answer mixes two versions and no truncation raises
SIGBUS. A copy lives only while its version is validated or loaded (a version loaded again is read again,
reopen_version, and refused if the file is no longer that version: runtime/catalog_versions.py's Versions.reread; it
is validated once per process: the same signature and the same identity of the bytes say it is the version
validated). A copy that cannot be written (the temporary disk full) is this machine's state, not the file's:
TemporarilyUnavailableError, and nothing of it is left.

A folder's names are listed again only when the folder changes (its mtime), never per request: a request for a name
needs no listing (its file is stat'ed), and the listing serves /v1/models and the near matches of an unknown name.
"""

from __future__ import annotations

import bisect
import contextlib
import difflib
import errno
import hashlib
import os
import re
import shutil
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..check.adapter import is_adapter, refuse_headless
from ..check.adapter_pair import require_adapter
from ..check.metadata import check_temperatures
from ..check.report import Report
from ..check.validate import judge_reader, judge_source
from ..errors import ClefError, IncompleteModelError, NotADecisionModelError, TemporarilyUnavailableError
from ..format.header import GGUFFile, Header, Signature, copy_open, signature_of
from ..format.sizes import adapter_head_bytes, lora_bytes
from ..inputs import open_regular
from .private_folder import PrivateFolder

ADAPTER_SUFFIX = ".adapter.gguf"  # an adapter folder's files: NAME.adapter.gguf answers as NAME
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@/-]{0,127}")
SHOWN_NAMES = 5  # an unknown name's message lists at most this many names
NEAR_WINDOW = 128  # names on each side of an unknown one, in sorted order, that difflib compares (20,000: 150 ms)


def discard(path: Path) -> None:
    """Remove a private file and the folder of its own that new_file made for it."""
    for remove in (path.unlink, path.parent.rmdir):
        with contextlib.suppress(OSError):
            remove()


@dataclass(eq=False)
class AdapterCopy:
    """One version of an adapter file: its bytes as they were read, in a private file, mapped (no one else writes
    it: mapping it is safe)."""

    source: Path  # the adapter file as named (for messages; never read again through this copy)
    signature: Signature  # the source's (st_dev, st_ino, st_size, st_mtime_ns) when it was read
    file: GGUFFile  # the private copy (file.path is the copy's path, file.path.name the source's name)

    def close(self) -> None:
        self.file.close()
        discard(self.file.path)


class _Writes:
    """A private copy's writer: an OSError writing it is this machine's (its temporary folder full or not writable),
    never the adapter file's nor the client's: TemporarilyUnavailableError."""

    def __init__(self, path: Path, source: Path, size: int) -> None:
        self._source = source
        with self._ours():
            free = shutil.disk_usage(path.parent).free
            if free < size:  # (refused before writing what cannot fit: a large adapter, a nearly full disk)
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: it needs {size} bytes, {free} are free")
            self._file = open(path, "xb")  # noqa: SIM115 (closed by close(), the copy's end)

    @contextlib.contextmanager
    def _ours(self) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            raise no_room(self._source, e) from None

    def write(self, data: bytes) -> None:
        with self._ours():
            self._file.write(data)

    def close(self) -> None:
        with self._ours():
            self._file.close()  # (the descriptor is closed even when the last flush fails)


def no_room(source: Path, e: OSError) -> TemporarilyUnavailableError:
    why = e.strerror or str(e)
    return TemporarilyUnavailableError(f"no private copy of {source.name} can be written in the temporary folder now ({why})")


class _Prefix:
    """An open file's first bytes, as check.validate.judge_reader reads a header (a remote file's, range by range)."""

    def __init__(self, f: BinaryIO, size: int, source: str) -> None:
        self.f, self.size, self.source, self.bytes_read = f, size, source, 0

    def read(self, start: int, end: int) -> bytes:
        self.f.seek(start)
        data = self.f.read(max(0, min(end, self.size) - start))
        self.bytes_read += len(data)
        return data


Judge = Callable[[BinaryIO, int], None]  # (the open source, its size): raises to refuse it before it is copied


def take_copy(source: Path, folder: PrivateFolder, judge: Judge | None = None) -> tuple[Path, Signature]:
    """`source` read once into a new private file: its path, and the signature of the version read. `judge` reads
    what it needs of the open source first (its header) and refuses it before a byte is copied. OSError when the
    source is not a regular file, cannot be read, or changed while it was read; TemporarilyUnavailableError when
    the copy cannot be written (nothing is left of it)."""
    with open_regular(source) as src:
        first = signature_of(os.fstat(src.fileno()))
        if judge is not None:
            judge(src, first[2])
            src.seek(0)
        try:
            target = folder.new_file(source.name)
        except OSError as e:
            raise no_room(source, e) from None
        try:
            sink = _Writes(target, source, first[2])
            try:
                signature = copy_open(src, sink)  # type: ignore[arg-type]
            finally:
                sink.close()
            if signature != first:
                raise OSError(errno.EAGAIN, "it changed while it was read (being written or replaced?)", str(source))
        except BaseException:
            discard(target)
            raise
    return target, signature


def adapter_identity(base_identity: str, adapter: GGUFFile) -> str:
    """A model made of a base and an adapter: both files' identities (GGUFFile.identity), hashed together."""
    return hashlib.sha256(f"{base_identity}+{adapter.identity()}".encode()).hexdigest()


def _require_adapter_header(base: GGUFFile, report: Report, header: Header | None, label: str, base_head: bool) -> None:
    """An adapter file's header as validate judges it, then against `base` (its shapes, its head): else the error."""
    error = report.error()
    if error is not None:
        raise type(error)(f"{label}: {report.summary}")
    if header is None or not is_adapter(header):
        # A file in the wrong place (a model as the adapter): exit 6, as validate BASE --adapter says it.
        raise NotADecisionModelError(
            f"{label} is not an adapter file (clef-gguf convert CHECKPOINT --base RELEASE --to-adapter makes one)"
        )
    require_adapter(base, header, label)
    if not base_head:
        refuse_headless(header, label)


def judge_first(base: GGUFFile, label: str, base_head: bool = False) -> Judge:
    """An open adapter file judged by its header before it is copied (take_copy): what validate and the base refuse
    in a header, a file longer than its header says included (junk after its tensors: a copy of it would fill the
    temporary disk for nothing)."""

    def judge(src: BinaryIO, size: int) -> None:
        report, header = judge_reader(_Prefix(src, size, label))
        _require_adapter_header(base, report, header, label, base_head)

    return judge


def open_adapter(base: GGUFFile, path: Path, label: str | None = None, base_head: bool = False) -> GGUFFile:
    """An adapter file (a private copy: take_copy), validated (as `clef-gguf validate` judges it) and checked against
    `base`, mapped. label: what messages call it (a request's answer names no server path)."""
    label = label or str(path)
    report, header = judge_source(path)
    _require_adapter_header(base, report, header, label, base_head)
    return GGUFFile.open(path)


@dataclass(eq=False)
class Version:
    """One version of an adapter file, read and validated: what its identity names is what its copy holds."""

    copy: AdapterCopy  # (the caller's to close)
    identity: str  # adapter_identity of the base and the copy
    temperatures: dict[str, float]  # its own (calibrate --adapter writes them), or none
    nbytes: int  # its LoRA's and head's bytes once loaded, as `plan --adapter` counts them


def read_version(base: GGUFFile, base_identity: str, source: Path, into: PrivateFolder, **how: object) -> Version:
    """The adapter file `source` read once into a private copy (take_copy), validated and checked against the base
    (open_adapter; `how`: its label and base_head), with its identity, temperatures and cost. OSError: the file is
    not regular, cannot be read, or changed while it was read; ClefError: it does not validate or fit the base."""
    label = str(how.get("label") or source)
    path, signature = take_copy(source, into, judge_first(base, label, bool(how.get("base_head"))))
    try:
        adapter = open_adapter(base, path, **how)  # type: ignore[arg-type]
    except ClefError as e:  # (a message naming the copy's own path names the source's file name instead)
        discard(path)
        if type(e).__init__ is not ClefError.__init__:
            raise
        raise type(e)(str(e).replace(str(path), source.name)) from None
    except BaseException:
        discard(path)
        raise
    copy = AdapterCopy(source, signature, adapter)
    try:
        problems, _, temperatures = check_temperatures(adapter.header)
        if problems:
            raise IncompleteModelError(f"{how.get('label') or source.name}: {problems[0].message}")
        nbytes = lora_bytes(adapter) + adapter_head_bytes(base, adapter)
        return Version(copy, adapter_identity(base_identity, adapter), temperatures, nbytes)
    except BaseException:
        copy.close()
        raise


def reopen_version(
    base_identity: str, source: Path, into: PrivateFolder, signature: Signature, identity: str
) -> AdapterCopy | None:
    """A version validated before, read again into a private copy (take_copy) and not validated again: the copy, if
    the file is still that version (its signature, and the identity of the bytes read), else None. OSError as
    take_copy; a ClefError if the copy is no GGUF file now."""
    path, found = take_copy(source, into)
    if found != signature:
        discard(path)
        return None
    try:
        copy = AdapterCopy(source, found, GGUFFile.open(path))
    except BaseException:
        discard(path)
        raise
    if adapter_identity(base_identity, copy.file) != identity:
        copy.close()
        return None
    return copy


def servable(name: str) -> bool:
    """Whether `name` can be an adapter's: 1 to 128 letters, digits and ._@/-, no '..'."""
    return isinstance(name, str) and NAME.fullmatch(name) is not None and ".." not in name


class FolderListing:
    """The adapter names of a folder's files (NAME.adapter.gguf), read again only when the folder's mtime changes.

    A file replaced in place keeps the folder's mtime, and so its name: the listing says which names exist, the
    catalog which of them load. One scan at a time; only callers of names() wait on it, never a request for a name
    (its file is stat'ed, not listed)."""

    def __init__(self, folder: Path, excluded: Collection[str]) -> None:
        self.folder = folder
        self._excluded = frozenset(excluded)
        self._key: tuple[int, int, int] | None = None
        self._names: list[str] = []  # sorted
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """The names, sorted (the last listing if the folder cannot be read now)."""
        with self._lock:
            try:
                st = os.stat(self.folder)
                key = (st.st_dev, st.st_ino, st.st_mtime_ns)
                if key != self._key:
                    found = [e.name[: -len(ADAPTER_SUFFIX)] for e in os.scandir(self.folder) if e.name.endswith(ADAPTER_SUFFIX)]
                    self._names = sorted(n for n in found if servable(n) and "/" not in n and n not in self._excluded)
                    self._key = key
            except OSError:
                pass  # (a folder gone or unreadable for now: requests for names say so, with the file's own error)
            return self._names


def unknown_name_message(name: str, base_name: str, served: list[str]) -> str:
    """The 422 for a name nothing answers as: at most SHOWN_NAMES names, all of them when there are no more, else
    the count and the nearest (difflib) among the sorted names around it; never the whole folder."""
    shown = repr(name if len(name) <= 130 else name[:128] + "...")
    if len(served) <= SHOWN_NAMES:
        return f"no model {shown} here: this server answers as {', '.join([base_name, *served])}"
    at = bisect.bisect_left(served, name)
    window = served[max(0, at - NEAR_WINDOW) : at + NEAR_WINDOW]
    near = difflib.get_close_matches(name, window, n=SHOWN_NAMES, cutoff=0.6)
    hint = f"the nearest: {', '.join(near)}" if near else "none is near that name"
    return f"no model {shown} here: this server answers as {base_name} and {len(served)} adapters (GET /v1/models); {hint}"

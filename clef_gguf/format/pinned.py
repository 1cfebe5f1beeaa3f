"""A loaded base as one immutable version: what the runtime reads of it after load, in memory this process owns.

A served base file may be truncated (`cp new.gguf served.gguf` truncates it first), rewritten in place, replaced or
deleted while the process runs. A mapping of it would then raise SIGBUS on the next page read past the new end, and
serve another version's bytes under the identity of the one loaded. So, as an adapter is (runtime/adapter_files.py:
a private copy read once), the base is pinned once its header is validated: its header bytes and the tensors the
runtime reads per request (the token embeddings, the head's lexicon rows, the head, the norms an adapter is checked
against) are copied into an anonymous mapping, with the file's identity, and the file's mapping is closed. Nothing of
this copy is read from the path again; no other process can write, truncate or delete it.

Any other tensor (a backbone row an adapter's content check compares, format/lineage.py: its rows are the adapter's
choice, any row of any adapted matrix, so no small set of them can be copied ahead) is read through the descriptor
pinning opened on that version and keeps open: deleting the path or renaming another file onto it leaves that version
readable there, so adapters keep loading. Only a write to that very file (`cp` over it, a truncation, a `touch`)
changes what the descriptor reads: then the read is refused (its device, inode, size, modification and change times
are no longer those pinned); read, never mapped, so a truncation is an error and no signal.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from ..errors import ModelFileError
from ..inputs import open_regular
from .header import GGUFFile, Signature, signature_of


def changed(path: os.PathLike[str] | str) -> str:
    return f"{os.fspath(path)} changed while it was loaded (written or replaced in place): load it again"


@dataclass
class PinnedFile(GGUFFile):
    """A GGUF file's header bytes (at their offsets: `map[:header_end]` is the file's) and `resident` tensors, in an
    anonymous mapping; its identity and header digest as computed from the file when it was pinned; `signature`, the
    version of the file pinned."""

    offsets: dict[str, int] = field(default_factory=dict)  # a resident tensor's first byte in `map`
    pinned_identity: str = ""
    pinned_digest: str = ""
    held: BinaryIO | None = None  # the version pinned, open: where a tensor not resident is read
    links: int = 0  # its hard links when pinned

    @classmethod
    def pin(cls, f: GGUFFile, resident: Iterable[str]) -> PinnedFile:
        """`f` (mapped after its validation, its signature the version mapped) pinned: ModelFileError if the path no
        longer names that version, or stops naming it while the copy is made. `f` stays the caller's to close."""
        try:
            held = open_regular(f.path)
        except OSError as e:
            raise ModelFileError(changed(f.path)) from e  # (the path named that version when it was validated)
        try:
            return cls._copy(f, resident, held)
        except BaseException:
            held.close()
            raise

    @classmethod
    def _copy(cls, f: GGUFFile, resident: Iterable[str], held: BinaryIO) -> PinnedFile:
        st = os.fstat(held.fileno())
        if f.signature is None or signature_of(st) != f.signature:
            raise ModelFileError(changed(f.path))
        h, names = f.header, sorted(set(resident) & set(f.header.tensors))
        offsets, end = {}, h.header_end
        for name in names:
            end += -end % h.alignment
            offsets[name] = end
            end += h.tensors[name].n_bytes
        block = mmap.mmap(-1, max(end, 1))
        try:
            block[: h.header_end] = f.map[: h.header_end]
            for name in names:
                block[offsets[name] : offsets[name] + h.tensors[name].n_bytes] = f.tensor_bytes(name)
            pinned = cls(f.path, block, h, f.signature, offsets, f.identity(), f.digest(), held, st.st_nlink)
            if pinned.current() != pinned.signature:
                raise ModelFileError(changed(f.path))
        except BaseException:
            block.close()
            raise
        return pinned

    def current(self) -> Signature | None:
        """The version the path names now (None: none, or not readable)."""
        try:
            return signature_of(os.stat(self.path))
        except OSError:
            return None

    def is_version(self, st: os.stat_result) -> bool:
        """Whether the pinned file, as fstat sees it now, still holds the version pinned. Its change time moves at any
        write (a `touch` that sets the modification time back too) but also when a link to it goes (the path deleted,
        or another file renamed onto it): a change time moved with fewer links, and nothing else moved, is that."""
        now, then = signature_of(st), self.signature
        return now[:4] == then[:4] and (now[4] == then[4] or st.st_nlink < self.links)

    def identity(self) -> str:
        return self.pinned_identity

    def digest(self) -> str:
        return self.pinned_digest

    def tensor_bytes(self, name: str) -> np.ndarray:
        t = self.header.tensors[name]
        if name in self.offsets:
            return np.frombuffer(self.map, dtype=np.uint8, count=t.n_bytes, offset=self.offsets[name])
        return self._read(self.header.data_offset + t.offset, t.n_bytes)

    def _read(self, start: int, size: int) -> np.ndarray:
        """Bytes of the version pinned, through its descriptor, while that file is not written (the path may name
        another file, or none)."""
        out = np.empty(size, dtype=np.uint8)
        gone = ModelFileError(f"{self.path} is no longer the version loaded (written in place): restart to load it")
        if self.held is None:
            raise gone
        try:
            fd = self.held.fileno()
            if not self.is_version(os.fstat(fd)):
                raise gone
            done = os.preadv(fd, [memoryview(out)], start)
            if done != size or not self.is_version(os.fstat(fd)):
                raise gone
        except (OSError, ValueError):  # (ValueError: closed)
            raise gone from None
        return out

    def close(self) -> None:
        if self.held is not None:
            self.held.close()
        with contextlib.suppress(BufferError):  # (views still held: the block goes with them)
            self.map.close()

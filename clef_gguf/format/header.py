"""A small, bounded reader of GGUF headers (key-values and tensor infos).

Why not gguf.GGUFReader: the runtime needs the raw bytes of each key-value and
tensor info to lay a `qwen35` header over a Clef file, and validation must survive
any bytes (every count and length is checked against the bytes that exist before
anything is allocated). Works on a memory map or on the first bytes of a file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys

from ..errors import ModelFileError
from ..inputs import open_regular
from .contract import is_head_tensor

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class TruncatedHeader(ModelFileError):
    """The bytes end inside the header (a truncated file, or a prefix too short).

    `needed` is a lower bound on the length of a prefix that parses further: a remote
    reader fetches at least that many bytes before trying again.
    """

    def __init__(self, message: str, needed: int | None = None) -> None:
        super().__init__(message)
        self.needed = needed


@dataclass(frozen=True)
class Field:
    key: str
    type: GGUFValueType
    value: Any  # str, int, float, bool or list
    start: int  # byte range of the whole key-value
    value_start: int  # where the value type tag starts
    end: int
    item_type: GGUFValueType | None = None  # of an array's items


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order (ne0 first)
    type: GGMLQuantizationType
    offset: int  # relative to the data section
    start: int  # byte range of the tensor info
    end: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy (row-major) order."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)  # Python ints: dims read from a file must not overflow silently

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.type]
        return self.n_elements // block * size


@dataclass(frozen=True)
class Header:
    version: int
    fields: dict[str, Field]
    tensors: dict[str, TensorInfo]
    alignment: int
    header_end: int  # end of the tensor infos
    data_offset: int  # start of the data section (aligned)

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.value

    def data_size(self) -> int:
        return max((t.offset + t.n_bytes for t in self.tensors.values()), default=0)


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: bytes | mmap.mmap | memoryview) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise TruncatedHeader(
                f"the header ends inside {what} at byte {self.pos} ({self.size} bytes available)", needed=self.pos + max(n, 0)
            )

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFileError(f"{what} is not valid UTF-8") from e

    def strings(self, count: int, what: str) -> list[str]:
        """A string array. Real headers hold ~250k tokens and as many merges: the Python loop
        only walks the lengths, the bytes are decoded in one call (see _decode_strings)."""
        self.need(count * 8, what)  # each string needs at least its length: bounds the loop
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        starts = [0] * count
        i = 0
        try:
            for i in range(count):
                starts[i] = pos
                pos += 8 + unpack(buf, pos)[0]  # struct.error past the end of buf
                if pos > size:
                    break
        except struct.error:
            pos = size + 1
        if pos > size:
            self.pos = starts[i]
            self.need(pos - starts[i], what)  # raises TruncatedHeader
        items = _decode_strings(buf, self.pos, pos, starts, what)
        self.pos = pos
        return items

    def value(self, vtype: int, what: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], what)
        if vtype != GGUFValueType.ARRAY:
            raise ModelFileError(f"{what} has unknown value type {vtype}")
        item_type = self.unpack("<I", what)
        count = self.unpack("<Q", what)
        if item_type in _SCALARS:
            size = struct.calcsize(_SCALARS[item_type])
            self.need(count * size, what)
            items = np.frombuffer(self.buf, dtype=np.dtype(_SCALARS[item_type]), count=count, offset=self.pos)
            self.pos += count * size
            return items.tolist()
        if item_type == GGUFValueType.STRING:
            return self.strings(count, what)
        raise ModelFileError(f"{what} is an array of unsupported type {item_type}")


_INVALID_UTF8 = re.compile("[\udc80-\udcfe]")


def _decode_strings(buf: bytes | mmap.mmap | memoryview, start: int, end: int, starts: list[int], what: str) -> list[str]:
    """Decode the strings of bytes [start, end) whose length fields begin at `starts`, in one call.

    Each 8-byte length becomes one 0xFF byte, which never occurs in UTF-8: decoded with
    surrogateescape it is exactly U+DCFF, a separator no valid string contains. Any other
    escaped byte means invalid UTF-8, and so does a 0xFF inside a string (one item too many).
    """
    if not starts:
        return []
    raw = np.frombuffer(buf, dtype=np.uint8, count=end - start, offset=start).copy()
    rel = np.asarray(starts, dtype=np.int64) - start
    keep = np.ones(raw.size, dtype=bool)
    for k in range(7):
        keep[rel + k] = False
    raw[rel + 7] = 0xFF
    text = raw[keep].tobytes().decode("utf-8", "surrogateescape")
    items = text.split("\udcff")[1:]
    if len(items) != len(starts) or _INVALID_UTF8.search(text):
        raise ModelFileError(f"{what} is not valid UTF-8")
    return items


def _tensor_type(raw: int) -> GGMLQuantizationType | None:
    try:
        qtype = GGMLQuantizationType(raw)
    except ValueError:
        return None
    return qtype if qtype in GGML_QUANT_SIZES else None


def parse_header(buf: bytes | mmap.mmap | memoryview) -> Header:
    """Parse a GGUF header from `buf` (the whole file, or a prefix of it)."""
    c = _Cursor(buf)
    c.need(4, "the magic")
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ModelFileError("not a GGUF file (bad magic)")
    c.pos = 4
    version = c.unpack("<I", "the version")
    if version not in (2, 3):
        raise ModelFileError(f"unsupported GGUF version {version}")
    n_tensors = c.unpack("<Q", "the tensor count")
    n_kv = c.unpack("<Q", "the key-value count")
    # Every key-value needs >= 12 bytes and every tensor info >= 24: bound the loops by the bytes.
    c.need(n_kv * 12 + n_tensors * 24, "the key-values and tensor infos")
    fields: dict[str, Field] = {}
    for i in range(n_kv):
        start = c.pos
        key = c.string(f"key-value #{i}")
        if key in fields:
            raise ModelFileError(f"duplicate key {key}")
        value_start = c.pos
        vtype = c.unpack("<I", key)
        value = c.value(vtype, key)
        item_type = GGUFValueType(struct.unpack_from("<I", buf, value_start + 4)[0]) if vtype == GGUFValueType.ARRAY else None
        fields[key] = Field(key, GGUFValueType(vtype), value, start, value_start, c.pos, item_type)
    tensors: dict[str, TensorInfo] = {}
    for i in range(n_tensors):
        start = c.pos
        name = c.string(f"tensor info #{i}")
        n_dims = c.unpack("<I", name)
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelFileError(f"tensor {name} has {n_dims} dimensions")
        dims = tuple(c.unpack("<Q", name) for _ in range(n_dims))
        raw_type = c.unpack("<I", name)
        offset = c.unpack("<Q", name)
        qtype = _tensor_type(raw_type)
        if qtype is None:
            raise ModelFileError(f"tensor {name} has unknown type {raw_type}")
        if name in tensors:
            raise ModelFileError(f"duplicate tensor {name}")
        if any(d == 0 or d >= 1 << 40 for d in dims) or math.prod(dims) >= 1 << 62:
            raise ModelFileError(f"tensor {name} has invalid dimensions {list(dims)}")
        info = TensorInfo(name, dims, qtype, offset, start, c.pos)
        if dims[0] % GGML_QUANT_SIZES[info.type][0]:  # ggml quantizes rows: each row is whole blocks
            raise ModelFileError(f"tensor {name}: rows of {dims[0]} elements are not whole {info.type.name} blocks")
        tensors[name] = info
    alignment = fields[Keys.General.ALIGNMENT].value if Keys.General.ALIGNMENT in fields else DEFAULT_ALIGNMENT
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(f"{Keys.General.ALIGNMENT} {alignment} is not a power of two")
    data_offset = -(-c.pos // alignment) * alignment
    return Header(version, fields, tensors, alignment, c.pos, data_offset)


IDENTITY_DOMAIN = b"clef-gguf model identity 1\n"  # changes with the rule of GGUFFile.identity
IDENTITY_WINDOW = 4096  # bytes
IDENTITY_WINDOWS = 16  # per sampled tensor, its first and last bytes included


def identity_windows(n_bytes: int) -> list[tuple[int, int]]:
    """(start, size) of the bytes of a tensor of `n_bytes` that GGUFFile.identity hashes when it does not hash it all."""
    if n_bytes <= IDENTITY_WINDOW * IDENTITY_WINDOWS:
        return [(0, n_bytes)]
    last = n_bytes - IDENTITY_WINDOW
    return [(i * last // (IDENTITY_WINDOWS - 1), IDENTITY_WINDOW) for i in range(IDENTITY_WINDOWS)]


def check_data_layout(header: Header, file_size: int) -> None:
    """Tensor data aligned, inside the file and not overlapping."""
    end = 0
    for t in sorted(header.tensors.values(), key=lambda t: t.offset):
        if t.offset % header.alignment:
            raise ModelFileError(f"tensor {t.name} is not aligned to {header.alignment} bytes")
        if t.offset < end:
            raise ModelFileError(f"tensor {t.name} overlaps the tensor before it")
        end = t.offset + t.n_bytes
    if header.data_offset + end > file_size:
        raise ModelFileError(
            f"the file is truncated: its tensor data needs {header.data_offset + end} bytes, the file has {file_size}"
        )


# st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns: a file's version (the ctime: no utime sets it back, `rsync -t` too)
Signature = tuple[int, int, int, int, int]


def signature_of(st: os.stat_result) -> Signature:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def copy_open(src: BinaryIO, sink: BinaryIO) -> Signature:
    """`src` (opened by inputs.open_regular, at its start) into `sink`, and the signature of what was read. A file
    changed in place while read is an OSError: its fstat before and after and the bytes read must agree (no SIGBUS)."""
    before = signature_of(os.fstat(src.fileno()))
    copied = 0
    while chunk := src.read(1 << 20):
        sink.write(chunk)
        copied += len(chunk)
    after = signature_of(os.fstat(src.fileno()))
    if after != before or copied != before[2]:
        raise OSError(errno.EAGAIN, "it changed while it was read (being written or replaced?)")
    return before


@dataclass
class GGUFFile:
    """A GGUF file mapped read-only, with its parsed header."""

    path: Path
    map: mmap.mmap
    header: Header
    signature: Signature | None = None  # read (GGUFFile.read): the version of the file its bytes are

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        path = Path(path)
        try:
            with open_regular(path) as f:  # (a FIFO is refused, not waited on)
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelFileError(f"{path}: cannot read ({e})") from e
        header = parse_header(mapped)
        check_data_layout(header, len(mapped))
        return cls(path, mapped, header)

    @classmethod
    def read(cls, path: str | Path) -> GGUFFile:
        """The file read once (copy_open) into this process's own memory, which no other process can change."""
        path, buffer = Path(path), io.BytesIO()
        try:
            with open_regular(path) as src:
                signature = copy_open(src, buffer)
            if signature[2] == 0:
                raise OSError(errno.EINVAL, "the file is empty", str(path))
        except OSError as e:
            raise ModelFileError(f"{path}: cannot read ({e.strerror or e})") from e
        mapped = mmap.mmap(-1, signature[2])
        mapped.write(buffer.getbuffer())
        header = parse_header(mapped)
        check_data_layout(header, len(mapped))
        return cls(path, mapped, header, signature)

    def digest(self) -> str:
        """SHA-256 of the header alone (metadata and tensor infos): blind to the weights, so not a model's identity
        (`identity` is). What an answers file of clef-gguf 0.2.0 recorded as its model_sha256."""
        return hashlib.sha256(memoryview(self.map)[: self.header.header_end]).hexdigest()

    def identity(self) -> str:
        """The file's identity, a SHA-256 (hex) over, in this order:
        - IDENTITY_DOMAIN (a version of this rule: a hash of another rule never equals one of this);
        - the header's bytes (metadata and tensor infos: vocabulary, template, temperatures, every tensor's name,
          type, shape and offset);
        - each tensor's data, in file order (by offset): all of it for the head's tensors (contract.is_head_tensor:
          a small part of a Clef file) and for any tensor of at most IDENTITY_WINDOWS windows, else
          IDENTITY_WINDOWS windows of IDENTITY_WINDOW bytes evenly spaced from its first byte to its last.

        Any change to the header, to any head weight, or to a sampled byte gives another identity: two conversions or
        quantizations, a calibration (its temperature keys), a fine-tune's head, and a fine-tune's backbone where it
        changes the samples (a merged LoRA changes every element of the matrices it adapts, so every window of them).
        Not guaranteed: a change confined to unsampled bytes of a backbone tensor (one weight edited by hand) keeps
        it; only a full hash of the file sees every byte. It reads the header, the head and 64 KiB per other tensor:
        docs/dataset.md gives the time on a 5 GB file. Any GGUF file has one (an adapter's: every tensor sampled).
        """
        whole = memoryview(self.map)
        h = hashlib.sha256(IDENTITY_DOMAIN)
        h.update(whole[: self.header.header_end])
        for t in sorted(self.header.tensors.values(), key=lambda t: t.offset):
            data = whole[self.header.data_offset + t.offset :][: t.n_bytes]
            for start, size in [(0, t.n_bytes)] if is_head_tensor(t.name) else identity_windows(t.n_bytes):
                h.update(data[start : start + size])
        return h.hexdigest()

    def tensor_bytes(self, name: str) -> np.ndarray:
        t = self.header.tensors[name]
        start = self.header.data_offset + t.offset
        return np.frombuffer(self.map, dtype=np.uint8, count=t.n_bytes, offset=start)

    def close(self) -> None:
        # BufferError: arrays over the map are still referenced (an exception's traceback holds them while
        # it unwinds): the map closes when they are freed. Raising here would hide that exception.
        with contextlib.suppress(BufferError):
            self.map.close()

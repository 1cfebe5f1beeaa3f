"""A small, bounded reader of GGUF headers (key-values and tensor infos).

Why not gguf.GGUFReader: the runtime needs the raw bytes of each key-value and
tensor info to lay a `qwen35` header over a Clef file, and validation must survive
any bytes (every count and length is checked against the bytes that exist before
anything is allocated). Works on a memory map or on the first bytes of a file.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import ModelFileError

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
    """The bytes end inside the header (a truncated file, or a prefix too short)."""


@dataclass(frozen=True)
class Field:
    key: str
    type: GGUFValueType
    value: Any  # str, int, float, bool or list
    start: int  # byte range of the whole key-value
    value_start: int  # where the value type tag starts
    end: int


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
        return int(np.prod(self.dims, dtype=np.int64)) if self.dims else 1

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


class _Cursor:
    def __init__(self, buf: bytes | mmap.mmap | memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise TruncatedHeader(f"the header ends inside {what} at byte {self.pos} ({len(self.buf)} bytes available)")

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
            self.need(count * 8, what)  # each string needs at least its length: bounds the loop
            return [self.string(what) for _ in range(count)]
        raise ModelFileError(f"{what} is an array of unsupported type {item_type}")


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
        fields[key] = Field(key, GGUFValueType(vtype), value, start, value_start, c.pos)
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
        if any(d == 0 or d >= 1 << 40 for d in dims):
            raise ModelFileError(f"tensor {name} has invalid dimensions {list(dims)}")
        info = TensorInfo(name, dims, qtype, offset, start, c.pos)
        if info.n_elements % GGML_QUANT_SIZES[info.type][0]:
            raise ModelFileError(f"tensor {name}: {info.n_elements} elements are not whole {info.type.name} blocks")
        tensors[name] = info
    alignment = fields["general.alignment"].value if "general.alignment" in fields else DEFAULT_ALIGNMENT
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(f"general.alignment {alignment} is not a power of two")
    data_offset = -(-c.pos // alignment) * alignment
    return Header(version, fields, tensors, alignment, c.pos, data_offset)


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


@dataclass
class GGUFFile:
    """A GGUF file mapped read-only, with its parsed header."""

    path: Path
    map: mmap.mmap
    header: Header

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        path = Path(path)
        try:
            with path.open("rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelFileError(f"{path}: cannot read ({e})") from e
        header = parse_header(mapped)
        check_data_layout(header, len(mapped))
        return cls(path, mapped, header)

    def tensor_bytes(self, name: str) -> np.ndarray:
        t = self.header.tensors[name]
        start = self.header.data_offset + t.offset
        return np.frombuffer(self.map, dtype=np.uint8, count=t.n_bytes, offset=start)

    def close(self) -> None:
        self.map.close()

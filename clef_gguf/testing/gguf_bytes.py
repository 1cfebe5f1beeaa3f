"""Building and damaging GGUF files byte by byte, for validate's tests and fuzzer.

Key-values are copied as raw bytes from a parsed file (so their types survive exactly)
or packed here; tensors are (name, ggml dims, ggml type, raw bytes).
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from clef_gguf.format import adapter as A
from clef_gguf.format import contract as C
from clef_gguf.format.header import GGUFFile

Tensor = tuple[str, tuple[int, ...], int, bytes]


def pack_str(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def kv_u32(key: str, value: int) -> bytes:
    return pack_str(key) + struct.pack("<II", GGUFValueType.UINT32, value)


def kv_str(key: str, value: str) -> bytes:
    return pack_str(key) + struct.pack("<I", GGUFValueType.STRING) + pack_str(value)


def kv_i32_array(key: str, values: list[int]) -> bytes:
    body = struct.pack(f"<IIQ{len(values)}i", GGUFValueType.ARRAY, GGUFValueType.INT32, len(values), *values)
    return pack_str(key) + body


def kv_str_array(key: str, values: list[str]) -> bytes:
    body = struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.STRING, len(values)) + b"".join(pack_str(v) for v in values)
    return pack_str(key) + body


def kvs_of(f: GGUFFile, drop: set[str] = frozenset(), replace: dict[str, bytes] | None = None) -> list[bytes]:
    """The file's key-values as raw bytes, minus `drop`, with `replace` (key -> packed kv) swapped in or appended."""
    replace = dict(replace or {})
    out = []
    for key, field in f.header.fields.items():
        if key in drop:
            continue
        out.append(replace.pop(key) if key in replace else bytes(f.map[field.start : field.end]))
    return out + list(replace.values())


def tensors_of(f: GGUFFile, keep=lambda name: True) -> list[Tensor]:
    return [(n, t.dims, int(t.type), bytes(f.tensor_bytes(n))) for n, t in f.header.tensors.items() if keep(n)]


def f32_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> Tensor:
    """An F32 tensor of numpy `shape` with random values."""
    data = rng.standard_normal(shape).astype(np.float32).tobytes()
    return name, tuple(reversed(shape)), int(GGMLQuantizationType.F32), data


def build(kvs: list[bytes], tensors: list[Tensor], alignment: int = 32) -> bytes:
    """A GGUF v3 file: key-values, tensor infos at running aligned offsets, then the data."""
    infos, blobs, offset = [], [], 0
    for name, dims, qtype, data in tensors:
        infos.append(pack_str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset))
        padded = data + bytes(-len(data) % alignment)
        blobs.append(padded)
        offset += len(padded)
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return header + bytes(-len(header) % alignment) + b"".join(blobs)


def rebuild(src: Path, dst: Path, *, drop_keys=frozenset(), replace=None, keep=lambda name: True, extra=()) -> Path:
    """`src` rewritten with key-values and tensors edited."""
    f = GGUFFile.open(src)
    try:
        dst.write_bytes(build(kvs_of(f, set(drop_keys), replace), tensors_of(f, keep) + list(extra)))
    finally:
        f.close()
    return dst


def poke(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value) :]


def kv_f32(key: str, value: float) -> bytes:
    return pack_str(key) + struct.pack("<If", GGUFValueType.FLOAT32, value)


def kv_i32(key: str, value: int) -> bytes:
    return pack_str(key) + struct.pack("<Ii", GGUFValueType.INT32, value)


def kv_array(key: str, item_type: GGUFValueType, fmt: str, values: list) -> bytes:
    """An array of numbers: `fmt` is their struct code (I, i, f, b)."""
    body = struct.pack(f"<IIQ{len(values)}{fmt}", GGUFValueType.ARRAY, item_type, len(values), *values)
    return pack_str(key) + body


def rewritten_adapter(adapter: Path, out: Path, values: dict[str, np.ndarray] | None = None, alpha: float | None = None) -> Path:
    """A copy of an f32 adapter file with some tensors' values (any shape: a misfit on purpose), or its alpha, replaced;
    written by gguf-py, its other key-values as they are."""
    reader = gguf.GGUFReader(adapter)
    writer = gguf.GGUFWriter(out, C.ARCH)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == gguf.Keys.General.ARCHITECTURE:
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value = alpha if key == A.KEY_ALPHA and alpha is not None else field.contents()
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, (values or {}).get(t.name, np.array(t.data)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out

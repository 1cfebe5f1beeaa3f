"""A plain `qwen35` GGUF, seen through a FILE*, over the backbone part of a Clef file.

Stock llama.cpp refuses the `clef` architecture and any tensor it does not create.
It does accept a `FILE*` (llama_model_load_from_file_ptr). So the runtime hands it
a virtual file: a synthesized qwen35 header (the Clef file's tokenizer keys and
backbone tensor infos copied byte for byte, `clef.*` hyperparameters renamed to
`qwen35.*`) followed by the Clef file's data section. The backbone tensors come
first in that section (contract.py), so their offsets stay valid unchanged; the
head's bytes follow them and are simply never referenced.

The FILE* is glibc's fopencookie with read/seek callbacks: no second copy of the
weights on disk, no patched llama.cpp. Its price: llama.cpp cannot mmap it, so it
reads the weights into its own buffers (measured in the README).
"""

from __future__ import annotations

import ctypes
import os
import struct

from gguf import GGUFValueType

from .. import contract as C
from ..errors import ModelFileError
from ..gguf_header import GGUF_MAGIC, GGUFFile

_GLOBAL_KEYS = ("general.alignment", "general.name", "general.file_type", "general.quantization_version")
LEAN_VOCAB = 258  # rows of token_embd the lean view keeps: a byte alphabet, one merge, an end token


def _pack_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _pack_kv(key: str, vtype: GGUFValueType, payload: bytes, item_type: GGUFValueType | None = None) -> bytes:
    head = _pack_string(key) + struct.pack("<I", vtype)
    return head + (struct.pack("<I", item_type) if item_type is not None else b"") + payload


def _pack_strings(key: str, items: list[str]) -> bytes:
    payload = struct.pack("<Q", len(items)) + b"".join(_pack_string(t) for t in items)
    return _pack_kv(key, GGUFValueType.ARRAY, payload, GGUFValueType.STRING)


def _pack_tensor_info(name: str, dims: tuple[int, ...], qtype: int, offset: int) -> bytes:
    return _pack_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)


def view_tensor_names(f: GGUFFile, lean: bool) -> list[str]:
    """The backbone tensors a view shows, checked to lie first and contiguous in the data section."""
    names = [n for n in f.header.tensors if not n.startswith(C.HEAD_PREFIX)]
    if lean:
        names = [n for n in names if n != "output.weight"]
        if names[-1:] != ["token_embd.weight"]:
            raise ModelFileError(f"{f.path.name}: token_embd.weight is not where a Clef file puts it; convert the file again")
    expected_offset = 0
    for name in names:
        t = f.header.tensors[name]
        if t.offset != expected_offset:
            raise ModelFileError(
                f"{f.path.name}: backbone tensor {name} is not where a Clef file puts it (offset {t.offset}); "
                "convert the file again"
            )
        expected_offset += -(-t.n_bytes // f.header.alignment) * f.header.alignment
    return names


def _lean_tokenizer() -> list[bytes]:
    """A valid byte-level BPE vocabulary of LEAN_VOCAB tokens: the lean view is fed embeddings, never tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    alphabet, extra = [], 0
    for b in range(256):
        alphabet.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    tokens = [*alphabet, "\u0120t", "<|im_end|>"]
    types = [1] * (len(tokens) - 1) + [3]  # normal tokens, one control token
    assert len(tokens) == LEAN_VOCAB
    return [
        _pack_kv("tokenizer.ggml.model", GGUFValueType.STRING, _pack_string("gpt2")),
        _pack_kv("tokenizer.ggml.pre", GGUFValueType.STRING, _pack_string(C.BACKBONE_ARCH)),
        _pack_strings("tokenizer.ggml.tokens", tokens),
        _pack_kv(
            "tokenizer.ggml.token_type",
            GGUFValueType.ARRAY,
            struct.pack(f"<Q{len(types)}i", len(types), *types),
            GGUFValueType.INT32,
        ),
        _pack_strings("tokenizer.ggml.merges", ["\u0120 t"]),
        _pack_kv("tokenizer.ggml.eos_token_id", GGUFValueType.UINT32, struct.pack("<I", LEAN_VOCAB - 1)),
    ]


def qwen35_header(f: GGUFFile, lean: bool = False) -> bytes:
    """A synthesized qwen35 header over the file's data section, padded to its alignment.

    Full: the whole backbone with the file's tokenizer (a plain qwen35 GGUF: export,
    tokenization). Lean: the same layers, but a vocabulary of LEAN_VOCAB tokens,
    token_embd cut to its first LEAN_VOCAB rows and no output.weight, so llama.cpp
    ties its LM head to those rows; the runtime feeds it embeddings, not tokens.
    """
    h, buf = f.header, f.map
    kvs = [_pack_kv("general.architecture", GGUFValueType.STRING, _pack_string(C.BACKBONE_ARCH))]
    for key, field in h.fields.items():
        if key in _GLOBAL_KEYS or (key.startswith("tokenizer.") and not lean):
            kvs.append(bytes(buf[field.start : field.end]))
        elif key.partition(".")[0] in (C.ARCH, C.BACKBONE_ARCH) and key.partition(".")[2] in C.BACKBONE_KEY_SUFFIXES:
            renamed = f"{C.BACKBONE_ARCH}.{key.partition('.')[2]}"  # clef.* in a Clef file, qwen35.* in a backbone
            kvs.append(_pack_string(renamed) + bytes(buf[field.value_start : field.end]))
    if lean:
        kvs += _lean_tokenizer()
    names = view_tensor_names(f, lean)
    infos = [bytes(buf[h.tensors[n].start : h.tensors[n].end]) for n in names]
    if lean:
        embd = h.tensors["token_embd.weight"]
        infos[-1] = _pack_tensor_info(embd.name, (embd.dims[0], LEAN_VOCAB), embd.type, embd.offset)
    header = GGUF_MAGIC + struct.pack("<IQQ", 3, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return header + bytes(-len(header) % h.alignment)


# --- glibc fopencookie through ctypes ---------------------------------------------------------------------
_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_READ = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_WRITE = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_SEEK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int)
_CLOSE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class _CookieIO(ctypes.Structure):
    _fields_ = [("read", _READ), ("write", _WRITE), ("seek", _SEEK), ("close", _CLOSE)]


_libc.fopencookie.restype = ctypes.c_void_p
_libc.fopencookie.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CookieIO]
_libc.fclose.argtypes = [ctypes.c_void_p]
_libc.setvbuf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t]
_IOFBF = 0
_BUFFER = 1 << 20  # fewer, larger callbacks while llama.cpp parses the header


class VirtualFile:
    """`header` followed by bytes [data_offset, EOF) of the file at `path`, as a read-only FILE*."""

    def __init__(self, header: bytes, path: os.PathLike[str] | str, data_offset: int) -> None:
        self._header = header
        self._fd = os.open(path, os.O_RDONLY)
        self._data_offset = data_offset
        self.size = len(header) + os.fstat(self._fd).st_size - data_offset
        self._pos = 0
        # Keep the callbacks referenced for as long as the FILE* lives.
        self._io = _CookieIO(_READ(self._read), _WRITE(lambda *_: -1), _SEEK(self._seek), _CLOSE(lambda _: 0))
        self.fp = _libc.fopencookie(None, b"rb", self._io)
        if not self.fp:
            os.close(self._fd)
            raise ModelFileError(f"fopencookie failed (errno {ctypes.get_errno()})")
        _libc.setvbuf(self.fp, None, _IOFBF, _BUFFER)

    def _read(self, _cookie: int, buf: int, size: int) -> int:
        try:
            out = memoryview((ctypes.c_char * size).from_address(buf)).cast("B")
            done = 0
            n_header = max(0, min(size, len(self._header) - self._pos))
            if n_header:
                out[:n_header] = self._header[self._pos : self._pos + n_header]
                done = n_header
            while done < size:
                offset = self._data_offset + self._pos + done - len(self._header)
                n = os.preadv(self._fd, [out[done:]], offset)
                if n <= 0:
                    break
                done += n
            self._pos += done
            return done
        except Exception:  # an exception must not cross into C: report an I/O error instead
            return -1

    def _seek(self, _cookie: int, offset: ctypes._Pointer, whence: int) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}.get(whence)
        if base is None or base + offset[0] < 0:
            return -1
        self._pos = base + offset[0]
        offset[0] = self._pos
        return 0

    def close(self) -> None:
        if self.fp:
            _libc.fclose(self.fp)
            self.fp = None
            os.close(self._fd)


def open_qwen35_view(f: GGUFFile, lean: bool = False) -> VirtualFile:
    return VirtualFile(qwen35_header(f, lean), f.path, f.header.data_offset)


def write_backbone_gguf(f: GGUFFile, out: os.PathLike[str] | str) -> None:
    """Write the backbone alone as a plain qwen35 GGUF (what the view shows llama.cpp)."""
    header = qwen35_header(f)
    names = view_tensor_names(f, lean=False)
    last = f.header.tensors[names[-1]]
    end = f.header.data_offset + last.offset + last.n_bytes
    chunk = 64 << 20
    with open(out, "wb") as dst:
        dst.write(header)
        for start in range(f.header.data_offset, end, chunk):
            dst.write(f.map[start : min(end, start + chunk)])

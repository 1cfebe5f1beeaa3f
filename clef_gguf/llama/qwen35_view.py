"""A plain `qwen35` GGUF, seen by llama.cpp, over the backbone of a Clef file.

Stock llama.cpp refuses the `clef` architecture and any tensor it does not create.
So the runtime shows it a view (View): a synthesized qwen35 header (the Clef file's
tokenizer keys copied byte for byte, `clef.*` hyperparameters renamed `qwen35.*`, the
backbone's tensor infos with offsets of a virtual data section) followed by that data
section, whose reads are mapped to the extents of the file where each tensor's bytes
really are. Tensor order is not part of the format (llama.cpp's converter and its quantizer
order differently): any order works, and the head's bytes are never read.

This module is the view alone, plain Python on any platform: no second copy of the weights
on disk, no patched llama.cpp. How llama.cpp reads it (a glibc cookie FILE*, or a model
initialized from the header with a callback that fills each tensor) is llama/loader.py's
choice. Either way llama.cpp cannot mmap it and reads the weights into its own buffers.
"""

from __future__ import annotations

import bisect
import os
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGUFValueType, Keys

from ..errors import ModelFileError
from ..format import adapter as A
from ..format import contract as C
from ..format.header import GGUF_MAGIC, GGUFFile
from ..format.pinned import PinnedFile, changed

_GLOBAL_KEYS = (Keys.General.ALIGNMENT, Keys.General.NAME, Keys.General.FILE_TYPE, Keys.General.QUANTIZATION_VERSION)
LEAN_TOKENS = 258  # the lean view's tokenizer: a byte alphabet, one merge, an end token (then fillers)
F32 = 0  # ggml_type


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


@dataclass(frozen=True)
class Extent:
    """`size` bytes at `offset` of the file's data section, shown at `start` of the view's; or, for a tensor
    the view makes up (the lean view's output.weight), `size` bytes of `identity` rows of `n_embd` floats."""

    name: str
    start: int
    offset: int
    size: int
    identity: int = 0  # > 0: an F32 identity of n_embd columns, padded with zero rows to this many

    def made_up(self, at: int, out: memoryview) -> None:
        """The made-up bytes [at, at + len(out)) of this tensor, into out."""
        n_embd = self.identity_width
        first, last = at // 4, -(-(at + len(out)) // 4)
        values = np.zeros(last - first, dtype=np.float32)
        ones = np.arange(first + (-first % (n_embd + 1)), min(last, n_embd * n_embd), n_embd + 1)
        values[ones - first] = 1.0  # element i * n_embd + i: row i, column i
        out[:] = values.view(np.uint8)[at - first * 4 : at - first * 4 + len(out)]

    @property
    def identity_width(self) -> int:
        return self.size // 4 // self.identity


def lean_vocab(f: GGUFFile) -> int:
    """The lean view's vocabulary: as many rows as its LM head, an identity of n_embd rows (at least LEAN_TOKENS)."""
    return max(f.header.tensors["token_embd.weight"].dims[0], LEAN_TOKENS)


def view_tensor_names(f: GGUFFile, lean: bool) -> list[str]:
    """The file's backbone tensors a view shows: everything but the head (and, lean, output.weight)."""
    names = [n for n in f.header.tensors if not C.is_head_tensor(n)]
    return [n for n in names if not (lean and n == "output.weight")]


def _extents(f: GGUFFile, names: list[str], lean: bool) -> list[Extent]:
    extents, start = [], 0
    for name in names:
        t = f.header.tensors[name]
        size = t.n_bytes
        if lean and name == "token_embd.weight":
            size = t.n_bytes // t.dims[1] * lean_vocab(f)  # its first rows
        extents.append(Extent(name, start, t.offset, size))
        start += -(-size // f.header.alignment) * f.header.alignment
    if lean:  # its LM head: logits = the hidden states after the output norm, exactly (x * 1 + 0s, in F32)
        n_embd, rows = f.header.tensors["token_embd.weight"].dims[0], lean_vocab(f)
        extents.append(Extent("output.weight", start, 0, n_embd * rows * 4, identity=rows))
    return extents


def _lean_tokenizer(n_tokens: int) -> list[bytes]:
    """A valid byte-level BPE vocabulary of n_tokens tokens: the lean view is fed embeddings, never tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    alphabet, extra = [], 0
    for b in range(256):
        alphabet.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    fillers = [f"<|lean_{i}|>" for i in range(n_tokens - LEAN_TOKENS)]  # unused rows of the identity
    tokens = [*alphabet, "\u0120t", *fillers, "<|im_end|>"]
    types = [1] * (len(tokens) - 1) + [3]  # normal tokens, one control token
    return [
        _pack_kv(Keys.Tokenizer.MODEL, GGUFValueType.STRING, _pack_string("gpt2")),
        _pack_kv(Keys.Tokenizer.PRE, GGUFValueType.STRING, _pack_string(C.BACKBONE_ARCH)),
        _pack_strings(Keys.Tokenizer.LIST, tokens),
        _pack_kv(
            Keys.Tokenizer.TOKEN_TYPE,
            GGUFValueType.ARRAY,
            struct.pack(f"<Q{len(types)}i", len(types), *types),
            GGUFValueType.INT32,
        ),
        _pack_strings(Keys.Tokenizer.MERGES, ["\u0120 t"]),
        _pack_kv(Keys.Tokenizer.EOS_ID, GGUFValueType.UINT32, struct.pack("<I", n_tokens - 1)),
    ]


def qwen35_header(f: GGUFFile, extents: list[Extent], lean: bool = False) -> bytes:
    """A synthesized qwen35 header over `extents`, padded to the file's alignment.

    Full: the whole backbone with the file's tokenizer (a plain qwen35 GGUF: export,
    tokenization). Lean: the same layers, but a vocabulary of lean_vocab(f) tokens,
    token_embd cut to its first rows, and an LM head that is the identity: its "logits"
    are the final hidden states. The runtime feeds it embeddings, not tokens, and reads
    every token's logits, which llama.cpp computes for several sequences in one ubatch
    (embeddings would split a batch into one ubatch per sequence).
    """
    h, buf = f.header, f.map
    kvs = [_pack_kv(Keys.General.ARCHITECTURE, GGUFValueType.STRING, _pack_string(C.BACKBONE_ARCH))]
    for key, field in h.fields.items():
        if key in _GLOBAL_KEYS or (key.startswith(C.KEY_TOKENIZER_PREFIX) and not lean):
            kvs.append(bytes(buf[field.start : field.end]))
        elif key.partition(".")[0] in (C.ARCH, C.BACKBONE_ARCH) and key.partition(".")[2] in C.BACKBONE_KEY_SUFFIXES:
            renamed = f"{C.BACKBONE_ARCH}.{key.partition('.')[2]}"  # clef.* in a Clef file, qwen35.* in a backbone
            kvs.append(_pack_string(renamed) + bytes(buf[field.value_start : field.end]))
    if lean:
        kvs += _lean_tokenizer(lean_vocab(f))
    infos = []
    for e in extents:
        if e.identity:
            infos.append(_pack_tensor_info(e.name, (e.identity_width, e.identity), F32, e.start))
            continue
        t = h.tensors[e.name]
        dims = (t.dims[0], lean_vocab(f)) if lean and e.name == "token_embd.weight" else t.dims
        infos.append(_pack_tensor_info(e.name, dims, t.type, e.start))
    header = GGUF_MAGIC + struct.pack("<IQQ", 3, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return header + bytes(-len(header) % h.alignment)


class View:
    """`header`, then a data section laid out by `extents`: the bytes llama.cpp is shown, read on demand.

    Each extent's bytes come from [data_offset + extent.offset, + extent.size) of the file at `path`; the padding
    between extents reads as zeros. Plain Python on an ordinary file object: the same on every platform
    (llama/loader.py hands it to llama.cpp by one route or another). Not thread-safe: one reader at a time.
    """

    def __init__(
        self,
        header: bytes,
        path: os.PathLike[str] | str,
        data_offset: int,
        extents: list[Extent],
        pinned: PinnedFile | None = None,
    ) -> None:
        self.header = header
        self.extents = {e.name: e for e in extents}
        self._ordered = extents
        self._starts = [e.start for e in extents]
        # A pinned base is read through its pin's descriptor (a copy of it, this View's to close): the version pinned,
        # whatever the path names now; the file must stay that version, before and after (changed()).
        held = pinned.held if pinned is not None else None
        try:
            self._file = open(path if held is None else os.dup(held.fileno()), "rb", buffering=0)  # noqa: SIM115
        except OSError as e:  # the file deleted or made unreadable since it was validated: not a crash of ours
            why = changed(path) if pinned is not None else f"{os.fspath(path)}: cannot read ({e.strerror or e})"
            raise ModelFileError(why) from None
        self.pinned = pinned
        if self.changed():
            self._file.close()
            raise ModelFileError(changed(path))
        self._data_offset = data_offset
        last = extents[-1] if extents else None
        self.size = len(header) + (last.start + last.size if last else 0)

    def _fill(self, out: memoryview, pos: int) -> int:
        """Bytes of the view at `pos` into `out`, up to the end of the current extent or gap."""
        if pos < len(self.header):
            n = min(len(out), len(self.header) - pos)
            out[:n] = self.header[pos : pos + n]
            return n
        data_pos = pos - len(self.header)
        i = bisect.bisect_right(self._starts, data_pos) - 1
        e = self._ordered[i] if i >= 0 else None
        if e is not None and data_pos < e.start + e.size:
            n = min(len(out), e.start + e.size - data_pos)
            if e.identity:
                e.made_up(data_pos - e.start, out[:n])
                return n
            self._file.seek(self._data_offset + e.offset + data_pos - e.start)
            return self._file.readinto(out[:n]) or 0  # 0 past the end of a file cut short
        following = self._starts[i + 1] if i + 1 < len(self._starts) else self.size - len(self.header)
        n = min(len(out), following - data_pos)
        out[:n] = bytes(n)
        return n

    def readinto(self, out: memoryview, pos: int) -> int:
        """Up to len(out) bytes of the view from `pos`; fewer only at its end (or a file cut short)."""
        done, end = 0, min(len(out), self.size - pos)
        while done < end:
            n = self._fill(out[done:end], pos + done)
            if n <= 0:
                break
            done += n
        return done

    def changed(self) -> bool:
        """Whether the file read is no longer the version pinned (written, truncated, replaced before it was opened)."""
        return self.pinned is not None and not self.pinned.is_version(os.fstat(self._file.fileno()))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> View:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def open_qwen35_view(f: GGUFFile, lean: bool = False) -> View:
    extents = _extents(f, view_tensor_names(f, lean), lean)
    pinned = f if isinstance(f, PinnedFile) else None
    return View(qwen35_header(f, extents, lean), f.path, f.header.data_offset, extents, pinned)


def open_adapter_view(f: GGUFFile) -> View:
    """A Clef adapter file seen as a qwen35 LoRA adapter: llama.cpp's loader wants the model's architecture and
    no tensor but `<weight>.lora_a` / `.lora_b`, so the view shows the file's adapter keys and LoRA pairs alone
    (its head and decision keys stay behind, for the native head and the runtime)."""
    h = f.header
    kvs = [_pack_kv(Keys.General.ARCHITECTURE, GGUFValueType.STRING, _pack_string(C.BACKBONE_ARCH))]
    for key, field in h.fields.items():
        if key in (A.KEY_GENERAL_TYPE, Keys.General.ALIGNMENT, A.KEY_ADAPTER_TYPE, A.KEY_ALPHA):
            kvs.append(bytes(f.map[field.start : field.end]))
    names = [n for n in h.tensors if A.lora_target(n) is not None]
    extents, start = [], 0
    for name in names:
        t = h.tensors[name]
        extents.append(Extent(name, start, t.offset, t.n_bytes))
        start += -(-t.n_bytes // h.alignment) * h.alignment
    infos = [_pack_tensor_info(e.name, h.tensors[e.name].dims, h.tensors[e.name].type, e.start) for e in extents]
    header = GGUF_MAGIC + struct.pack("<IQQ", 3, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return View(header + bytes(-len(header) % h.alignment), f.path, h.data_offset, extents)


def write_view(view: View, out: os.PathLike[str] | str) -> None:
    """Write what a view shows as a real GGUF file."""
    buffer = bytearray(min(64 << 20, view.size))  # chunks of at most 64 MiB
    with open(out, "wb") as dst:
        for pos in range(0, view.size, len(buffer)):
            dst.write(buffer[: view.readinto(memoryview(buffer), pos)])


def write_backbone_gguf(f: GGUFFile, out: os.PathLike[str] | str) -> None:
    """Write the backbone alone as a plain qwen35 GGUF (what the full view shows llama.cpp)."""
    with open_qwen35_view(f) as view:
        write_view(view, out)

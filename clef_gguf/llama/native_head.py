"""The joint schema head on the backbone's device: libclef_head's ggml graph (native/head_graph.cpp).

Its weights live in the device's default buffer type (on the CPU: never AMX, see
llama/cpu_buffers.py). tests/numpy_head.py is the reference the tests hold this against.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Callable, Sequence
from typing import Protocol

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT

from ..errors import ComputeError, ModelFileError
from ..format import contract as C
from ..format.header import GGUFFile, Header, TensorInfo
from ..format.pinned import PinnedFile
from .native import library
from .threads import default_threads

_ERR_SIZE = 1024
Span = tuple[int, int]


class SpannedQuestion(Protocol):
    """One question's token spans (runtime.prompt.EncodedQuestion)."""

    @property
    def type(self) -> str: ...
    @property
    def span(self) -> Span: ...
    @property
    def option_spans(self) -> Sequence[Span]: ...


class SpannedPrompt(Protocol):
    """A prompt's tokens and its questions' spans (runtime.prompt.EncodedPrompt)."""

    @property
    def tokens(self) -> Sequence[int]: ...
    @property
    def questions(self) -> Sequence[SpannedQuestion]: ...


_i32p = ctypes.POINTER(ctypes.c_int32)


def _i32(values: list[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int32)


def _ptr(array: np.ndarray) -> ctypes._Pointer:
    return array.ctypes.data_as(_i32p)


# The lexical prior's table: the output embedding, or the token embedding when the two are tied.
LEXICONS = tuple(f"{gguf.TENSOR_NAMES[t]}.weight" for t in (gguf.MODEL_TENSOR.OUTPUT, gguf.MODEL_TENSOR.TOKEN_EMBD))


Locate = Callable[[TensorInfo, int], tuple[int, int]]  # (a tensor, its file: 0 the model, 1 the adapter) -> (source, offset)


def manifest_text(header: Header, config: C.HeadConfig, overlay: Header | None = None, locate: Locate | None = None) -> bytes:
    """contract.head_manifest checked against the file, as libclef_head reads it: one line a tensor,
    `role, ggml type, ne0, ne1, absolute offset, file`. The head runs what validate accepts: vectors F32,
    matrices of contract.WEIGHT_TYPES. With an `overlay` (an adapter file's header, file 1), its head tensors
    replace the model's (file 0); the lexicon is always the model's. `locate`: where a tensor's bytes are when not
    at its offset in its file (_Sources)."""
    lines = []

    def add(role: str, t: TensorInfo, source: Header = header) -> None:
        file = int(source is not header)
        file, offset = locate(t, file) if locate is not None else (file, source.data_offset + t.offset)
        lines.append(f"{role}\t{int(t.type)}\t{t.dims[0]}\t{math.prod(t.dims[1:])}\t{offset}\t{file}")

    for row in C.head_manifest(config):
        source = overlay if overlay is not None and row.gguf in overlay.tensors else header
        t = source.tensors.get(row.gguf)
        if t is None:
            raise ModelFileError(f"the head tensor {row.gguf} is missing")
        if (*t.dims, 1)[:2] != row.ne or len(t.dims) > 2:
            raise ModelFileError(f"the head tensor {row.gguf} has shape {list(t.dims)}, the head config implies {list(row.ne)}")
        if row.f32 and t.type != GT.F32:
            raise ModelFileError(f"the head tensor {row.gguf} is {t.type.name}, expected F32")
        if not row.f32 and t.type not in C.WEIGHT_TYPES:
            raise ModelFileError(f"the head tensor {row.gguf} is {t.type.name}, which the head does not run")
        add(row.role, t, source)
    lexicon = next((header.tensors[name] for name in LEXICONS if name in header.tensors), None)
    if lexicon is None or len(lexicon.dims) != 2 or lexicon.dims[0] != config.hidden_size:
        raise ModelFileError(f"the output embedding ({' or '.join(LEXICONS)}) is missing or not {config.hidden_size} wide")
    add("lexicon", lexicon)
    return "\n".join(lines).encode()


class _Sources:
    """What clef_head_load reads: a path a file, and a block of memory for a pinned base (format/pinned.py), which the
    head reads in place, the lexicon per decision. The base's head tensors it does not keep (they are resident only
    where adapters may be served) are read once, while the file is still that version, into a block of their own
    that libclef_head uses while it loads only."""

    def __init__(self, file: GGUFFile, config: C.HeadConfig, adapter: GGUFFile | None) -> None:
        self.files = [file, *([adapter] if adapter is not None else [])]
        self.paths = [f.path for f in self.files]
        self.blocks: list[np.ndarray | None] = [None] * len(self.files)
        self.offsets: list[dict[str, int] | None] = [None] * len(self.files)
        if isinstance(file, PinnedFile):
            self.blocks[0], self.offsets[0] = np.frombuffer(file.map, dtype=np.uint8), file.offsets
            taken = adapter.header.tensors if adapter is not None else {}
            names = [r.gguf for r in C.head_manifest(config) if r.gguf in file.header.tensors]
            loose = [n for n in names if n not in file.offsets and n not in taken]
            if loose:
                parts = [file.tensor_bytes(n) for n in loose]
                starts = np.cumsum([0, *(p.size for p in parts)])[:-1]
                self.paths.append(file.path)
                self.blocks.append(np.concatenate(parts))
                self.offsets.append(dict(zip(loose, map(int, starts), strict=True)))

    def locate(self, t: TensorInfo, file: int) -> tuple[int, int]:
        offsets = self.offsets[file]
        if offsets is None:
            return file, self.files[file].header.data_offset + t.offset
        if t.name in offsets:
            return file, offsets[t.name]
        return len(self.blocks) - 1, self.offsets[-1][t.name]  # type: ignore[index] (the loose block)

    def arguments(self) -> tuple[bytes, ctypes.Array, ctypes.Array]:
        n = len(self.blocks)
        blocks = (ctypes.c_void_p * n)(*[b.ctypes.data if b is not None else None for b in self.blocks])
        sizes = (ctypes.c_uint64 * n)(*[b.size if b is not None else 0 for b in self.blocks])
        return b"\n".join(os.fsencode(p) for p in self.paths), blocks, sizes


class NativeHead:
    """The head of one Clef GGUF, on the GPU when `gpu` and ggml has one, else on the CPU; with an `adapter`
    file, the adapter's head tensors in place of the model's (llama/adapter.py). libclef_head reads the model's
    lexicon rows per decision: from a pinned base's block (format/pinned.py: the runtime's base), else from the file,
    opened by path and kept open. The runtime's adapter is a private copy of one version (runtime/adapter_files.py),
    the one its LoRA was loaded from."""

    def __init__(
        self,
        file: GGUFFile,
        config: C.HeadConfig,
        *,
        gpu: bool = False,
        n_threads: int | None = None,
        adapter: GGUFFile | None = None,
    ) -> None:
        self._lib = library()
        handle = ctypes.c_void_p()
        err = ctypes.create_string_buffer(_ERR_SIZE)
        threads = n_threads or default_threads()
        sources = _Sources(file, config, adapter)
        manifest = manifest_text(file.header, config, adapter.header if adapter is not None else None, sources.locate)
        paths = sources.paths
        self._blocks = sources.blocks[:1]  # (the base's: its lexicon is read per decision, until the head is freed)
        if any(b"\n" in os.fsencode(p) for p in paths):
            raise ModelFileError(f"a model file's path holds a line break, which the native head cannot take: {paths}")
        fields = (config.hidden_size, config.width, config.routing_layers, config.layers, config.heads, config.feedforward)
        values = (ctypes.c_int64 * len(fields))(*fields)
        args = (manifest, values, config.norm_eps, int(gpu), threads, ctypes.byref(handle), err, _ERR_SIZE)
        status = self._lib.clef_head_load(*sources.arguments(), *args)
        if status != 0:
            raise ModelFileError(f"{file.path.name}: {err.value.decode('utf-8', 'replace')}")
        self._handle = handle
        self.device = self._lib.clef_head_device(handle).decode()
        # its device rounds F32 products' inputs to F16, so each product runs in F16-exact parts (head_graph.cpp)
        self.split_products = bool(self._lib.clef_head_split_products(handle))
        self.hidden_size = self._lib.clef_head_hidden_size(handle)

    def __call__(self, hidden: np.ndarray, prompt: SpannedPrompt) -> list[np.ndarray]:
        """hidden: (len(prompt.tokens), hidden_size) float32 -> one logit array per question."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        if hidden.shape != (len(prompt.tokens), self.hidden_size):
            raise ComputeError(f"hidden states {hidden.shape}, expected ({len(prompt.tokens)}, {self.hidden_size})")
        questions = prompt.questions
        tokens = _i32(prompt.tokens)
        types = _i32([C.QUESTION_TYPES[q.type] for q in questions])
        question_spans = _i32([q.span for q in questions])
        counts = _i32([len(q.option_spans) for q in questions])
        option_spans = _i32([s for q in questions for s in q.option_spans])
        logits = np.empty(int(counts.sum()), dtype=np.float32)
        err = ctypes.create_string_buffer(_ERR_SIZE)
        status = self._lib.clef_head_run(
            self._handle,
            hidden.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            len(tokens),
            _ptr(tokens),
            len(questions),
            _ptr(types),
            _ptr(question_spans),
            _ptr(counts),
            _ptr(option_spans),
            logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            err,
            _ERR_SIZE,
        )
        if status != 0:
            raise ComputeError(f"the native head failed: {err.value.decode('utf-8', 'replace')}")
        return np.split(logits, np.cumsum(counts)[:-1])

    def close(self) -> None:
        if getattr(self, "_handle", None):
            self._lib.clef_head_free(self._handle)
            self._handle = None
        self._blocks = []  # (only once the head that reads them is freed)

    def __del__(self) -> None:
        self.close()

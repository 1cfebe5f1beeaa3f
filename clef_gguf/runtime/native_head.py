"""The joint schema head on the backbone's device: libclef_head (native/, built by CMake) through ctypes.

The library is a ggml graph of the head, linked against the ggml that llama-cpp-python
ships. `llama_cpp` is imported first: it loads libllama and, as its dependencies,
llama_cpp/lib/libggml.so.0 and libggml-base.so.0. The dynamic loader then resolves
libclef_head's own dependencies (the same sonames) to those very objects; its RUNPATH
($ORIGIN/../../llama_cpp/lib) names the same files should it ever be loaded first.
One ggml, one backend registry: the head finds the GPU llama.cpp uses.

clef_gguf/runtime/head.py (numpy) is the reference the tests hold this against.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import llama_cpp  # noqa: F401  (loads llama.cpp's ggml before libclef_head asks for it)
import numpy as np

import clef_gguf

from ..errors import ModelFileError
from .prompt import QUESTION_TYPES, EncodedPrompt

LIBRARY_NAME = "libclef_head.so"
ENV_LIBRARY = "CLEF_GGUF_NATIVE_LIB"  # a development build, instead of the installed one
_ERR_SIZE = 1024
_i32p = ctypes.POINTER(ctypes.c_int32)


def library_path() -> Path:
    """The installed libclef_head, in clef_gguf/_native/.

    An editable install (scikit-build-core's redirect mode) keeps the Python sources in
    the checkout and the CMake install in site-packages: the package's __path__ lists both.
    """
    if os.environ.get(ENV_LIBRARY):
        return Path(os.environ[ENV_LIBRARY])
    for directory in clef_gguf.__path__:
        candidate = Path(directory) / "_native" / LIBRARY_NAME
        if candidate.is_file():
            return candidate
    raise ModelFileError(
        f"{LIBRARY_NAME} is not installed (clef-gguf's native head): reinstall the package with "
        "`pip install .` (or `pip install -e .`), which builds it with CMake"
    )


def _load_library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_path()))
    lib.clef_head_load.argtypes = [
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    lib.clef_head_load.restype = ctypes.c_int
    lib.clef_head_free.argtypes = [ctypes.c_void_p]
    lib.clef_head_free.restype = None
    lib.clef_head_device.argtypes = [ctypes.c_void_p]
    lib.clef_head_device.restype = ctypes.c_char_p
    lib.clef_head_hidden_size.argtypes = [ctypes.c_void_p]
    lib.clef_head_hidden_size.restype = ctypes.c_int32
    lib.clef_head_run.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_float),
        ctypes.c_int32,
        _i32p,
        ctypes.c_int32,
        _i32p,
        _i32p,
        _i32p,
        _i32p,
        ctypes.POINTER(ctypes.c_float),
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    lib.clef_head_run.restype = ctypes.c_int
    return lib


_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = _load_library()
    return _lib


def _i32(values: list[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int32)


def _ptr(array: np.ndarray) -> ctypes._Pointer:
    return array.ctypes.data_as(_i32p)


class NativeHead:
    """The head of one Clef GGUF, on the GPU when `gpu` and ggml has one, else on the CPU."""

    def __init__(self, path: str | os.PathLike[str], *, gpu: bool = False, n_threads: int | None = None) -> None:
        self._lib = library()
        handle = ctypes.c_void_p()
        err = ctypes.create_string_buffer(_ERR_SIZE)
        threads = n_threads or os.cpu_count() or 1
        if self._lib.clef_head_load(os.fsencode(path), int(gpu), threads, ctypes.byref(handle), err, _ERR_SIZE) != 0:
            raise ModelFileError(f"{Path(path).name}: {err.value.decode('utf-8', 'replace')}")
        self._handle = handle
        self.device = self._lib.clef_head_device(handle).decode()
        self.hidden_size = self._lib.clef_head_hidden_size(handle)

    def __call__(self, hidden: np.ndarray, prompt: EncodedPrompt) -> list[np.ndarray]:
        """hidden: (len(prompt.tokens), hidden_size) float32 -> one logit array per question."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        if hidden.shape != (len(prompt.tokens), self.hidden_size):
            raise ValueError(f"hidden states {hidden.shape}, expected ({len(prompt.tokens)}, {self.hidden_size})")
        questions = prompt.questions
        tokens = _i32(prompt.tokens)
        types = _i32([QUESTION_TYPES[q.question.type] for q in questions])
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
            raise RuntimeError(f"the native head failed: {err.value.decode('utf-8', 'replace')}")
        return np.split(logits, np.cumsum(counts)[:-1])

    def close(self) -> None:
        if getattr(self, "_handle", None):
            self._lib.clef_head_free(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()

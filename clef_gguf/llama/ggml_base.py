"""ggml-base as the process already has it: the one binding of the ggml functions clef-gguf calls itself (the rows of
an embedding matrix, llama/rows.py; the portable loader's header and tensors, llama/user_model.py).

It is the file libllama links (its soname; on macOS its install name, on Windows its DLL name), in the folder
llama-cpp-python loaded libllama from (LLAMA_CPP_LIB_PATH, else llama_cpp/lib): the same object again, never a second
copy of ggml. A wheel holds copies, not links, of libggml-base.so and libggml-base.so.0: loading the other name would
map another ggml, with its own globals, beside the one llama.cpp uses.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import cache
from pathlib import Path

import llama_cpp

GGML_BASE = {"win32": "ggml-base.dll", "darwin": "libggml-base.0.dylib"}.get(sys.platform, "libggml-base.so.0")


class TypeTraits(ctypes.Structure):
    """struct ggml_type_traits (ggml.h)."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


class GgufInitParams(ctypes.Structure):
    """struct gguf_init_params (gguf.h)."""

    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


_p, _size = ctypes.c_void_p, ctypes.c_size_t
_PROTOTYPES = {
    "ggml_get_type_traits": (ctypes.POINTER(TypeTraits), [ctypes.c_int]),
    "gguf_init_from_buffer": (_p, [ctypes.c_char_p, _size, GgufInitParams]),
    "gguf_free": (None, [_p]),
    "ggml_get_name": (ctypes.c_char_p, [_p]),
    "ggml_get_data": (_p, [_p]),
    "ggml_nbytes": (_size, [_p]),
    "ggml_backend_buffer_is_host": (ctypes.c_bool, [_p]),
    "ggml_backend_tensor_set": (None, [_p, _p, _size, _size]),
}


def library_dir() -> Path:
    """Where llama-cpp-python loaded its libraries from, as llama_cpp/llama_cpp.py finds them."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    return Path(override) if override else Path(llama_cpp.__file__).parent / "lib"


@cache
def ggml_base() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_dir() / GGML_BASE))
    for name, (restype, argtypes) in _PROTOTYPES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib

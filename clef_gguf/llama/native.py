"""libclef_head (native/, built by CMake at install) through ctypes: the one loader and its prototypes.

The library holds the joint schema head's ggml graph (llama/native_head.py) and the
questions about ggml's CPU buffer types (llama/cpu_buffers.py). It is linked against
the ggml that llama-cpp-python ships. `llama_cpp` is imported first: it loads libllama
and, as its dependencies, llama_cpp/lib/libggml.so.0 and libggml-base.so.0. The dynamic
loader then resolves libclef_head's own dependencies (the same sonames) to those very
objects; its RUNPATH ($ORIGIN/../../llama_cpp/lib) names the same files should it ever
be loaded first. One ggml, one backend registry: the head finds the GPU llama.cpp uses.
The same holds on macOS (install names, @loader_path) and on Windows, where a DLL already
loaded (ggml.dll, by llama_cpp) is the one a later DLL's import of that name gets.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import cache
from pathlib import Path

import llama_cpp  # noqa: F401  (loads llama.cpp's ggml before libclef_head asks for it)

from ..errors import ModelFileError

# The file CMake makes of the clef_head target on each platform (CMakeLists.txt: no "lib" prefix on Windows, for
# MSVC and MinGW alike).
LIBRARY_NAMES = {"win32": "clef_head.dll", "darwin": "libclef_head.dylib"}
LIBRARY_NAME = LIBRARY_NAMES.get(sys.platform, "libclef_head.so")
ENV_LIBRARY = "CLEF_GGUF_NATIVE_LIB"  # a development build, instead of the installed one
_i32p = ctypes.POINTER(ctypes.c_int32)
_f32p = ctypes.POINTER(ctypes.c_float)
_char_p, _size_t, _int, _void_p = ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p

# name: (restype, argtypes), as declared in native/clef_head.h and native/cpu_bufts.h
_PROTOTYPES = {
    "clef_head_load": (
        _int,
        [
            _char_p,
            ctypes.POINTER(_void_p),
            ctypes.POINTER(ctypes.c_uint64),
            _char_p,
            ctypes.POINTER(ctypes.c_int64),
            ctypes.c_float,
            _int,
            _int,
            ctypes.POINTER(_void_p),
            _char_p,
            _size_t,
        ],
    ),
    "clef_head_free": (None, [_void_p]),
    "clef_head_device": (_char_p, [_void_p]),
    "clef_head_split_products": (_int, [_void_p]),
    "clef_head_hidden_size": (ctypes.c_int32, [_void_p]),
    "clef_head_run": (
        _int,
        [_void_p, _f32p, ctypes.c_int32, _i32p, ctypes.c_int32, _i32p, _i32p, _i32p, _i32p, _f32p, _char_p, _size_t],
    ),
    "clef_cpu_extra_buft_names": (_int, [_char_p, _size_t]),
    "clef_cpu_extra_buft": (_void_p, [_char_p]),
    "clef_cpu_buft_supports_weight": (ctypes.c_bool, [_void_p, _int, ctypes.c_int64, ctypes.c_int64]),
}


def library_path() -> Path:
    """The installed libclef_head, in clef_gguf/_native/.

    An editable install (scikit-build-core's redirect mode) keeps the Python sources in
    the checkout and the CMake install in site-packages: the package's __path__ lists both.
    """
    if os.environ.get(ENV_LIBRARY):
        return Path(os.environ[ENV_LIBRARY])
    candidates = [Path(d) / "_native" / LIBRARY_NAME for d in sys.modules[__name__.partition(".")[0]].__path__]
    for candidate in candidates:  # (the clef_gguf package is imported first)
        if candidate.is_file():
            return candidate
    # Where it looked: a source tree with no build (a checkout on the path before the installed package) says so.
    looked = " or ".join(str(c) for c in candidates)
    raise ModelFileError(
        f"{LIBRARY_NAME} (clef-gguf's native head) is not at {looked}: if that is a source checkout imported instead "
        "of the installed package (it is on sys.path first, e.g. the working directory), run from elsewhere; "
        f"otherwise reinstall with `pip install .` (or `pip install -e .`), which builds it, or set {ENV_LIBRARY}"
    )


@cache
def library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_path()))
    for name, (restype, argtypes) in _PROTOTYPES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib

"""Rows of an embedding matrix, dequantized by ggml itself (whatever the stored type).

The runtime needs rows of token_embd (the backbone's input, fed as embeddings) and of
output.weight (the head's lexical prior). ggml's own `to_float` gives exactly the
values llama.cpp's get_rows would, for every type, in one call per gather.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import llama_cpp
import numpy as np
from gguf import GGMLQuantizationType

from ..errors import ModelFileError
from ..format.header import GGUFFile


class _TypeTraits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


# The file libllama links (its soname; on macOS its install name, on Windows its DLL name), so that this is the ggml
# already in the process, not a second copy: a wheel holds copies, not links, of libggml-base.so and .so.0.
GGML_BASE = {"win32": "ggml-base.dll", "darwin": "libggml-base.0.dylib"}.get(sys.platform, "libggml-base.so.0")
_ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / GGML_BASE))
_ggml.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
_ggml.ggml_get_type_traits.argtypes = [ctypes.c_int]
_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class RowTable:
    """Gather rows of a 2-D tensor of a GGUF file as float32."""

    def __init__(self, f: GGUFFile, name: str) -> None:
        t = f.header.tensors[name]
        self.name, self.type = name, t.type
        self.n_rows, self.width = t.shape
        self._rows = f.tensor_bytes(name).reshape(self.n_rows, -1)
        traits = _ggml.ggml_get_type_traits(int(t.type)).contents
        self._to_float = _TO_FLOAT(traits.to_float) if traits.to_float else None

    def rows(self, ids: np.ndarray | list[int]) -> np.ndarray:
        gathered = np.ascontiguousarray(self._rows[np.asarray(ids, dtype=np.int64)])
        if self.type == GGMLQuantizationType.F32:
            return gathered.view(np.float32).reshape(-1, self.width)
        out = np.empty((len(gathered), self.width), dtype=np.float32)
        if self._to_float is None:
            raise ModelFileError(f"ggml cannot dequantize {self.type.name} rows of {self.name}")
        self._to_float(gathered.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
        return out

"""Rows of an embedding matrix, dequantized by ggml itself (whatever the stored type).

The runtime needs rows of token_embd (the backbone's input, fed as embeddings) and of
output.weight (the head's lexical prior). ggml's own `to_float` gives exactly the
values llama.cpp's get_rows would, for every type, in one call per gather.
"""

from __future__ import annotations

import ctypes

import numpy as np
from gguf import GGMLQuantizationType

from ..errors import ModelFileError
from ..format.header import GGUFFile
from .ggml_base import ggml_base

_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class RowTable:
    """Gather rows of a 2-D tensor of a GGUF file as float32."""

    def __init__(self, f: GGUFFile, name: str) -> None:
        t = f.header.tensors[name]
        self.name, self.type = name, t.type
        self.n_rows, self.width = t.shape
        self._rows = f.tensor_bytes(name).reshape(self.n_rows, -1)
        traits = ggml_base().ggml_get_type_traits(int(t.type)).contents
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

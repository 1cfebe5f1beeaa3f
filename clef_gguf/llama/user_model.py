"""A view (llama/qwen35_view.py) loaded by llama_model_init_from_user: the portable route of llama/loader.py.

llama.cpp builds the model from a gguf_context of the view's header alone (gguf_init_from_buffer: keys and tensor
infos, no data) and, once it has allocated the weights, calls back once for each tensor it created: the callback
fills it from the view. No FILE*, no libc, no temporary file: the same on Linux, macOS and Windows.

What llama.cpp creates on this route is not the header's list (0.3.36's src/llama-model-loader.cpp, create_tensor
without a file): its own shapes, the header's types, and every optional tensor the header lacks, as F32 (IDENTITIES):
  * the q, k and v biases of the full-attention layers (create_tensor_qkv), which the graph adds (llama-graph.cpp,
    build_qkv): filled with -0.0, the exact additive identity (x + -0.0 == x for every x, where +0.0 would turn a
    -0.0 into +0.0);
  * a `.scale` and an `.input_scale` of every weight (llama_model's generic pass for NVFP4, llama-model.cpp): the
    graph multiplies each product by the first (build_lora_mm) and never reads the second: filled with 1.0.
So the activations are the cookie route's bit for bit, at the price of an elementwise add or multiply after each
product (docs/benchmarks.md). Any other tensor the view lacks is an error. This route also turns use_extra_bufts off
(src/llama.cpp): llama/loader.py routes the weights CPU_REPACK would hold there by buffer overrides instead, and
those weights are written through ggml_backend_tensor_set (the repacking buffer's set_tensor repacks them; a device
buffer's copies them over).
"""

from __future__ import annotations

import ctypes
import re

import llama_cpp as L
import numpy as np

from ..errors import ModelFileError
from .ggml_base import GgufInitParams, ggml_base
from .qwen35_view import F32, View

# The optional tensors llama.cpp creates for qwen35 that a Clef backbone has none of, and the value that makes each
# change nothing (the module's docstring).
IDENTITIES = ((re.compile(r"^blk\.\d+\.attn_[qkv]\.bias$"), -0.0), (re.compile(r"^blk\.\d+\.\w+\.(input_)?scale$"), 1.0))
_SET_TENSOR_DATA = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)  # llama_model_set_tensor_data_t


class _TensorHead(ctypes.Structure):
    """The first fields of struct ggml_tensor (ggml.h): ggml has no accessor for a tensor's buffer."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p)]


class _Filler:
    """The set_tensor_data callback over a view; the first error it met (an exception must not cross into C)."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.error: str | None = None
        self.callback = _SET_TENSOR_DATA(self._set)  # referenced for as long as llama.cpp may call it

    def _set(self, tensor: int, _userdata: int) -> None:
        if self.error is not None:
            return
        try:
            self._fill(tensor)
        except Exception as e:  # reported by load, after llama.cpp returns
            self.error = str(e) or type(e).__name__

    def _fill(self, tensor: int) -> None:
        lib = ggml_base()
        name, size = lib.ggml_get_name(tensor).decode(), lib.ggml_nbytes(tensor)
        head = _TensorHead.from_address(tensor)
        extent = self.view.extents.get(name)
        if extent is None:
            value = next((v for pattern, v in IDENTITIES if pattern.match(name)), None)
            if value is None or head.type != F32:
                raise ModelFileError(f"llama.cpp asked for a tensor {name} that the file does not have")
            made_up = np.full(size // 4, value, dtype=np.float32)
            lib.ggml_backend_tensor_set(tensor, made_up.ctypes.data, 0, size)
            return
        if extent.size != size:
            raise ModelFileError(f"{name}: llama.cpp's tensor has {size} bytes, the file's {extent.size}")
        host = lib.ggml_backend_buffer_is_host(head.buffer)
        staging = None if host else np.empty(size, dtype=np.uint8)  # the whole tensor: a repacking buffer wants it so
        address = lib.ggml_get_data(tensor) if host else staging.ctypes.data
        out = memoryview((ctypes.c_char * size).from_address(address)).cast("B")
        if self.view.readinto(out, len(self.view.header) + extent.start) != size:
            raise ModelFileError(f"the file ends inside tensor {name}")
        if staging is not None:
            lib.ggml_backend_tensor_set(tensor, address, 0, size)


def load(view: View, params: L.llama_model_params) -> L.llama_model_p | None:
    """The model llama.cpp builds from the view, or None where it refused it (llama/log.py has its reason);
    ModelFileError where the view could not fill a tensor."""
    lib = ggml_base()
    metadata = lib.gguf_init_from_buffer(view.header, len(view.header), GgufInitParams(True, None))
    if not metadata:
        raise ModelFileError("ggml could not read the view's header")
    filler = _Filler(view)
    try:
        model = L.llama_model_init_from_user(metadata, filler.callback, None, params)
    finally:
        lib.gguf_free(metadata)  # llama.cpp copied what it keeps of the keys while loading
    if filler.error is not None:
        if model:
            L.llama_model_free(model)
        raise ModelFileError(filler.error)
    return model

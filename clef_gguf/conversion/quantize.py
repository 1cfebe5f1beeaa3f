"""llama.cpp's own quantizer on a qwen35 backbone GGUF (K-quants, mixtures, IQ4).

`llama_model_quantize` decides the mixture (which tensors get Q6_K in a Q4_K_M, ...)
exactly as llama-quantize does, so a Q4_K_M here is the Q4_K_M llama.cpp users know.
An importance matrix (llama-imatrix's GGUF output) is passed through.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import numpy as np

from ..errors import ConversionError
from ..format.header import GGUFFile
from .writer import Progress

# Bytes per weight, roughly, to check free disk space before starting.
APPROX_BYTES_PER_WEIGHT = {"q2_k": 0.35, "q3_k_m": 0.45, "q3_k_l": 0.5, "q6_k": 0.82}
_PROGRESS_LINE = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")


def approx_bytes_per_weight(file_type: str) -> float:
    if file_type in APPROX_BYTES_PER_WEIGHT:
        return APPROX_BYTES_PER_WEIGHT[file_type]
    return 0.7 if file_type.startswith("q5") else 0.6


def load_imatrix(path: Path) -> dict[str, np.ndarray]:
    """An importance matrix in llama-imatrix's GGUF format: name -> mean squared activations."""
    try:
        f = GGUFFile.open(path)
    except Exception as e:
        raise ConversionError(f"{path}: not an imatrix GGUF file ({e}); convert a legacy .dat with llama-imatrix") from e
    try:
        tensors = f.header.tensors
        data: dict[str, np.ndarray] = {}
        for name in tensors:
            if not name.endswith(".in_sum2"):
                continue
            base = name[: -len(".in_sum2")]
            sums = np.array(f.tensor_bytes(name).view(np.float32)).reshape(tensors[name].shape)
            counts = np.array(f.tensor_bytes(base + ".counts").view(np.float32)).reshape(-1, 1)
            # Same normalization as llama-quantize: per-expert means, 1 where nothing was seen.
            data[base] = np.where(counts > 0, sums / np.maximum(counts, 1), 1.0).astype(np.float32).reshape(-1)
    except KeyError as e:
        raise ConversionError(f"{path}: imatrix entry without its counts ({e})") from e
    finally:
        f.close()
    if not data:
        raise ConversionError(f"{path}: no importance matrix entries")
    return data


def quantize(src: Path, dst: Path, file_type: str, imatrix: Path | None = None, progress: Progress | None = None) -> None:
    """Quantize the qwen35 GGUF `src` into `dst` with llama.cpp."""
    from ..llama import llama_cpp as L
    from ..llama import log as llama_log

    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{file_type.upper()}")
    params.nthread = os.cpu_count() or 1
    keep_alive: list[object] = []
    if imatrix is not None:
        entries = load_imatrix(imatrix)
        array = (L.llama_model_imatrix_data * (len(entries) + 1))()  # terminated by a NULL name
        for slot, (name, values) in zip(array, entries.items(), strict=False):
            slot.name = name.encode()
            slot.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            slot.size = values.size
        keep_alive += [array, entries]
        params.imatrix = ctypes.cast(array, type(params.imatrix))

    def on_log(text: str) -> None:
        if progress and (m := _PROGRESS_LINE.search(text)):
            progress(f"quantizing {file_type}", int(m[1]), int(m[2]), m[3])

    with llama_log.capture_info(on_log):
        status = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if status != 0:
        raise ConversionError(f"llama.cpp's quantizer failed for {file_type}: {llama_log.last_error('see stderr')}")

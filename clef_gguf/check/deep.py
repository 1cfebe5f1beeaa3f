"""--deep and --sha256: reading every tensor's values, and hashing the file."""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT

from ..format.header import GGUFFile
from .report import Problem, corrupt

CHUNK_BYTES = 8 << 20


# No trained weight comes near this: products of such values overflow float32 (3e38 gave Inf scores).
MAX_WEIGHT = 1e20


@cache
def _dequantizable(qtype: GT) -> bool:
    """Whether gguf-py dequantizes `qtype` (--deep decodes quantized tensors with it)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(size, dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def _values(raw: np.ndarray, qtype: GT) -> np.ndarray | None:
    """`raw` (whole blocks of `qtype`) as float32; None when gguf-py cannot decode it."""
    if qtype == GT.F32:
        return raw.view(np.float32)
    if qtype == GT.F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == GT.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if not _dequantizable(qtype):
        return None
    with np.errstate(all="ignore"):  # a NaN scale is a finding, not a warning on stderr
        return gguf.quants.dequantize(raw, qtype)


def check_data(f: GGUFFile) -> tuple[list[Problem], list[str]]:
    """Reads every tensor: NaN, Inf or overflowing values, and matrices of zeros (a sparse or interrupted download).

    Vectors may be all zeros (biases often are), matrices may not.
    """
    problems, skipped = [], []
    for name, t in f.header.tensors.items():
        _, type_size = gguf.GGML_QUANT_SIZES[t.type]
        step = max(type_size, CHUNK_BYTES // type_size * type_size)
        data = f.tensor_bytes(name)
        bad, zeros, unknown = None, True, False
        for start in range(0, t.n_bytes, step):
            chunk = data[start : start + step]
            zeros = zeros and not chunk.any()
            values = _values(chunk, t.type)
            if values is None:
                unknown = True
                continue
            with np.errstate(all="ignore"):
                if not np.isfinite(values).all():
                    bad = "holds NaN or Inf values"
                elif np.abs(values).max(initial=0) > MAX_WEIGHT:
                    bad = f"holds values of magnitude {float(np.abs(values).max()):.3g}, which overflow float32 arithmetic"
            if bad:
                break
        if bad:
            problems.append(corrupt("data", f"tensor {name} {bad}"))
        elif zeros and len(t.dims) > 1 and t.dims[1] > 1:
            problems.append(corrupt("data", f"tensor {name} is all zeros: a sparse or interrupted download?"))
        if unknown:
            skipped.append(name)
    notes = (
        [f"--deep could not decode {len(skipped)} tensors of types gguf-py does not read (their values unchecked)"]
        if skipped
        else []
    )
    return problems, notes


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()

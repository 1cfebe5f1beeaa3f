"""NaN and Inf in tensor data: what convert and graft check before writing, and validate in a file's head.

A quantized block's values are finite exactly when its float16 scale (and minimum) fields are: the other fields
are small integers. So a quantized tensor is checked from those fields alone, a few bytes per block, and decoded
(gguf-py) only to count the values of the blocks found bad.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT

from ..format import contract as C
from ..format.header import GGUFFile
from .report import Problem, corrupt

CHUNK_BYTES = 8 << 20

# Byte offsets of the float16 fields in one block (ggml-common.h's block_* structs).
F16_FIELDS: dict[GT, tuple[int, ...]] = {
    GT.Q4_0: (0,),
    GT.Q4_1: (0, 2),
    GT.Q5_0: (0,),
    GT.Q5_1: (0, 2),
    GT.Q8_0: (0,),
    GT.Q8_1: (0, 2),
    GT.Q2_K: (80, 82),
    GT.Q3_K: (108,),
    GT.Q4_K: (0, 2),
    GT.Q5_K: (0, 2),
    GT.Q6_K: (208,),
    GT.IQ4_NL: (0,),
    GT.IQ4_XS: (0,),
    GT.IQ2_XXS: (0,),
    GT.IQ2_XS: (0,),
    GT.IQ2_S: (0,),
    GT.IQ3_XXS: (0,),
    GT.IQ3_S: (0,),
    GT.IQ1_S: (0,),
    GT.TQ1_0: (52,),
    GT.TQ2_0: (64,),
}


def _bad_float_values(raw: np.ndarray, qtype: GT) -> int | None:
    if qtype == GT.F32:
        values = raw.view(np.float32)
        return int(values.size - np.count_nonzero(np.isfinite(values)))
    # A float16 or bfloat16 is NaN or Inf exactly when its exponent bits are all ones (bit tests: faster than isfinite).
    exponent = {GT.F16: 0x7C00, GT.BF16: 0x7F80}.get(qtype)
    if exponent is None:
        return None
    return int(np.count_nonzero((raw.view(np.uint16) & exponent) == exponent))


def _bad_blocks(raw: np.ndarray, qtype: GT) -> np.ndarray | None:
    """Per block of `raw`, whether one of its float16 fields is NaN or Inf; None for a type not in F16_FIELDS."""
    fields = F16_FIELDS.get(qtype)
    if fields is None:
        return None
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    bad = np.zeros(len(blocks), dtype=bool)
    for offset in fields:
        half = np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16).reshape(-1)
        bad |= ~np.isfinite(half)
    return bad


def _decoded_bad(raw: np.ndarray, qtype: GT) -> int:
    """Types without plain float16 scales (IQ1_M, MXFP4): decoded by gguf-py; 0 (unchecked) where it cannot."""
    try:
        with np.errstate(all="ignore"):
            values = gguf.quants.dequantize(raw, qtype)
    except (NotImplementedError, ValueError, TypeError):
        return 0
    return int(values.size - np.count_nonzero(np.isfinite(values)))


def _bad_quantized(raw: np.ndarray, qtype: GT) -> int:
    bad = _bad_blocks(raw, qtype)
    if bad is None:
        return _decoded_bad(raw, qtype)
    if not bad.any():
        return 0
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        with np.errstate(all="ignore"):
            values = gguf.quants.dequantize(raw.reshape(-1, size)[bad].reshape(-1), qtype)
        return int(values.size - np.count_nonzero(np.isfinite(values))) or int(bad.sum()) * block
    except (NotImplementedError, ValueError, TypeError):
        return int(bad.sum()) * block  # every value of a block with a non-finite scale is, or may be, non-finite


def count_nonfinite(data: np.ndarray, qtype: GT) -> int:
    """How many of the values that `data` (the bytes of whole blocks of `qtype`, any dtype) encodes are NaN or Inf.

    Quantized types without an entry in F16_FIELDS are decoded by gguf-py; those it cannot decode count 0 (unchecked,
    as --deep notes them).
    """
    raw = np.asarray(data).reshape(-1).view(np.uint8)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    step = max(type_size, CHUNK_BYTES // type_size * type_size)
    total = 0
    for start in range(0, raw.size, step):
        chunk = raw[start : start + step]
        found = _bad_float_values(chunk, qtype)
        total += found if found is not None else _bad_quantized(chunk, qtype)
    return total


def check_head_values(f: GGUFFile) -> list[Problem]:
    """The head's tensors (a small part of a file) read for NaN and Inf: a diverged fine-tune, a bad conversion."""
    bad: list[tuple[str, int, int]] = []
    for name, t in f.header.tensors.items():
        if C.is_head_tensor(name):
            n = count_nonfinite(f.tensor_bytes(name), t.type)
            if n:
                bad.append((name, n, t.n_elements))
    if not bad:
        return []
    name, n, total = bad[0]
    more = f" (and {len(bad) - 1} more head tensors)" if len(bad) > 1 else ""
    return [
        corrupt(
            "head values",
            f"head tensor {name} holds {n} NaN or Inf values of {total}{more}: every decision would be NaN "
            "(a diverged fine-tune?); convert the model again from sound weights",
        )
    ]

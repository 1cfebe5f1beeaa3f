"""Where a model file's weights came from, and whether an adapter's own LoRA is in them already.

The norms fingerprint (format/adapter.model_fingerprint) tells one release from another, but not a base from its
fine-tunes: a LoRA never changes a norm. Two layers do (docs/finetune.md, "How a pair is checked"):

- Keys clef-gguf writes. Every conversion records the weights digest of the release it converted (`weights_digest`:
  sampled values, so one value for every quantization of that release, and llama-quantize copies the key), and a
  file whose weights hold a merged fine-tune says so, with the digest of the release it was fine-tuned from. An
  adapter records the digest of its base. Equal digests: the pair fits; a merged file is refused.
- A content check for files without those keys (llama.cpp's converter, older clef-gguf files). An adapter stores a
  few rows of its base's original weights and of its own update D (as llama.cpp applies it: alpha / r x B'A'); the
  candidate's rows are dequantized and projected on D: `lora_share` is 0 for the base in any quantization (the
  quantization's error does not follow D) and 1 for a file with this LoRA merged in.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import gguf
import numpy as np

from .adapter import KEY_PREFIX as ADAPTER_KEYS
from .contract import ARCH
from .header import GGUFFile, Header

# A model file's keys (clef-gguf's own: llama.cpp reads none of them).
KEY_SOURCE_DIGEST = f"{ARCH}.source.digest"  # string: weights_digest of the release converted (merged: merged_digest)
KEY_SOURCE_MERGED = f"{ARCH}.source.merged"  # bool: its weights hold a fine-tune's LoRA, merged
KEY_SOURCE_BASE_DIGEST = f"{ARCH}.source.base.digest"  # string: a merged file's base release, where known
# string: vision.tower_fingerprint of the release's vision tower, the mmproj convert writes beside the model (its
# pairing compares the mmproj's content with it: check/pair.py)
KEY_SOURCE_VISION = f"{ARCH}.source.vision.fingerprint"
# An adapter's keys.
KEY_BASE_DIGEST = f"{ADAPTER_KEYS}base.digest"  # string: weights_digest of the release it was trained over
SAMPLE_PREFIX = f"{ADAPTER_KEYS}base.sample."
KEY_SAMPLE_TENSORS = f"{SAMPLE_PREFIX}tensors"  # array[string]: the sampled row's model tensor, one per row
KEY_SAMPLE_ROWS = f"{SAMPLE_PREFIX}rows"  # array[int32]: its row (numpy order, the model file's layout)
KEY_SAMPLE_WIDTHS = f"{SAMPLE_PREFIX}widths"  # array[int32]: its length (the tensor's columns)
KEY_SAMPLE_WEIGHTS = f"{SAMPLE_PREFIX}weights"  # array[f32]: the base release's values of the rows, concatenated
KEY_SAMPLE_DELTA = f"{SAMPLE_PREFIX}delta"  # array[f32]: the adapter's update of the rows, concatenated

DIGEST_DOMAIN = b"clef-gguf weights digest 1\n"
MERGED_DOMAIN = b"clef-gguf merged weights digest 1\n"
DIGEST_WINDOWS, DIGEST_WINDOW = 16, 1024  # values read per tensor: all of a small one, else 16 spans of 1024
SAMPLE_BUDGET = 65536  # values per sample array (256 KiB of f32 each): 16 rows of a 4096-wide matrix
SAMPLE_ROWS_PER_TENSOR = 4  # so that the sample spreads over several matrices
# The content check's rule, from the measured values (docs/finetune.md): a share at or beyond 0.5 (from 0) is a
# merged LoRA; an error above MAX_SHARE_ERROR leaves both 0 and 1 within 4 errors of 0.5: no verdict.
MERGED_SHARE = 0.5
MAX_SHARE_ERROR = 0.125

SpanReader = Callable[[int, int], np.ndarray]  # (first value, count) -> float32 values, row-major order


def digest_spans(n: int) -> list[tuple[int, int]]:
    """The (start, count) spans of an n-value tensor that its digest reads: all of it, or windows evenly spaced."""
    if n <= DIGEST_WINDOWS * DIGEST_WINDOW:
        return [(0, n)]
    step = (n - DIGEST_WINDOW) / (DIGEST_WINDOWS - 1)
    return [(round(i * step), DIGEST_WINDOW) for i in range(DIGEST_WINDOWS)]


def weights_digest(tensors: Iterable[tuple[str, tuple[int, ...], SpanReader]]) -> str:
    """sha256 (hex) over (name, shape, the float32 values of digest_spans) of every tensor, in name order.

    Values, not bytes: a release saved in bf16 and the same values in f32 have one digest. A LoRA changes every
    value of the matrices it adapts (B @ A is dense), so a fine-tune's weights have another. Sampled, as
    header.GGUFFile.identity samples: a change confined to unread values of a large tensor keeps the digest."""
    h = hashlib.sha256(DIGEST_DOMAIN)
    for name, shape, read in sorted(tensors, key=lambda t: t[0]):
        h.update(f"{name} {'x'.join(map(str, shape))}\n".encode())
        for start, count in digest_spans(math.prod(shape)):
            h.update(np.ascontiguousarray(read(start, count), dtype="<f4").tobytes())
    return h.hexdigest()


def merged_digest(base_digest: str, update_digest: str) -> str:
    """The digest of a release merged with a fine-tune while converting: its base's and the update's, combined."""
    return hashlib.sha256(MERGED_DOMAIN + f"{base_digest}\n{update_digest}\n".encode()).hexdigest()


def is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


@dataclass(frozen=True)
class SampleRow:
    tensor: str
    row: int
    weights: np.ndarray  # float32 (width,)
    delta: np.ndarray


def read_sample(h: Header) -> list[SampleRow] | None:
    """An adapter's base sample; [] when it has none (written before clef-gguf stored one); None when its keys do
    not agree with each other (a damaged file)."""
    keys = (KEY_SAMPLE_TENSORS, KEY_SAMPLE_ROWS, KEY_SAMPLE_WIDTHS, KEY_SAMPLE_WEIGHTS, KEY_SAMPLE_DELTA)
    values = [h.get(k) for k in keys]
    if all(v is None for v in values):
        return []
    if not all(isinstance(v, list) for v in values):
        return None
    tensors, rows, widths, weights, delta = values
    n = len(tensors)
    if not n or len(rows) != n or len(widths) != n or not all(isinstance(t, str) for t in tensors):
        return None
    if not all(type(x) is int and x >= 0 for x in rows + widths) or not len(weights) == len(delta) == sum(widths):
        return None
    try:
        w, d = np.asarray(weights, dtype=np.float32), np.asarray(delta, dtype=np.float32)
    except (TypeError, ValueError):
        return None
    if not (np.isfinite(w).all() and np.isfinite(d).all()):
        return None
    ends = np.cumsum([0, *widths])
    return [SampleRow(t, r, w[a:b], d[a:b]) for t, r, a, b in zip(tensors, rows, ends[:-1], ends[1:], strict=True)]


def tensor_rows(f: GGUFFile, name: str, rows: list[int]) -> np.ndarray:
    """Rows of a 2-D tensor of a model file as float32, dequantized (gguf-py knows every ggml type's blocks)."""
    t = f.header.tensors[name]
    data = f.tensor_bytes(name).reshape(t.shape[0], -1)[rows]
    return gguf.quants.dequantize(data, t.type).reshape(len(rows), t.shape[1]).astype(np.float32)


@dataclass(frozen=True)
class Share:
    """How much of an adapter's update a file's weights hold beyond its base's: 0 for the base, 1 merged once."""

    value: float
    error: float  # one standard error, from the residual: the quantization's error, taken as independent of D
    n: int  # values compared

    @property
    def conclusive(self) -> bool:
        return self.error <= MAX_SHARE_ERROR

    @property
    def merged(self) -> bool:
        return self.conclusive and abs(self.value) >= MERGED_SHARE


def lora_share(weights: np.ndarray, delta: np.ndarray, candidate: np.ndarray) -> Share | None:
    """The least-squares share of `delta` in candidate - weights (flat float arrays); None where delta is 0."""
    d, diff = delta.astype(np.float64), candidate.astype(np.float64) - weights.astype(np.float64)
    dd = float(d @ d)
    if not dd > 0:
        return None
    value = float(diff @ d) / dd
    residual = diff - value * d
    return Share(value, math.sqrt(float(residual @ residual) / d.size / dd), d.size)


def sample_share(f: GGUFFile, sample: list[SampleRow]) -> Share | None:
    """lora_share over the sample's rows that the file has in the sample's shapes (the others are the shape
    check's to report); None when none is left or the rows cannot be read as numbers."""
    by_tensor: dict[str, list[SampleRow]] = {}
    for s in sample:
        t = f.header.tensors.get(s.tensor)
        if t is not None and len(t.shape) == 2 and t.shape[1] == s.weights.size and s.row < t.shape[0]:
            by_tensor.setdefault(s.tensor, []).append(s)
    if not by_tensor:
        return None
    weights, delta, candidate = [], [], []
    for name, rows in by_tensor.items():
        try:
            values = tensor_rows(f, name, [s.row for s in rows])
        except (NotImplementedError, ValueError, KeyError):  # a type gguf-py cannot dequantize
            return None
        candidate += list(values)
        weights += [s.weights for s in rows]
        delta += [s.delta for s in rows]
    found = np.concatenate(candidate)
    if not np.isfinite(found).all():
        return None
    return lora_share(np.concatenate(weights), np.concatenate(delta), found)

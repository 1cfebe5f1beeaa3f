"""Reading a GGUF header from its first bytes, and what ggml's reader refuses in its layout."""

from __future__ import annotations

import struct
from typing import Any

from gguf import GGUFValueType as VT
from gguf import Keys

from ..errors import ModelFileError
from ..format.header import GGUF_MAGIC, Header, TruncatedHeader, parse_header
from .report import Problem, corrupt

# Limits no real model comes near. A Clef header is ~16 MB (a 248k-token vocabulary and its
# merges); parsing the largest header allowed stays within seconds.
MAX_HEADER_BYTES = 64 << 20
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 16
GGML_MAX_NAME = 64  # ggml's tensor name buffer, terminating NUL included


EMPTY = "the file is empty (0 bytes)"


def _declared_counts(buf: Any) -> tuple[int, int] | None:
    if len(buf) < 24:
        return None
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    return n_tensors, n_kv


def parse_prefix(buf: Any, file_size: int) -> tuple[Header | None, list[Problem], int | None]:
    """Parse the header from `buf`, the first bytes of a file of `file_size` bytes.

    Returns (header, problems, more): `more` is the prefix length to fetch next when `buf`
    ends before the header does and the file has more bytes; otherwise None.
    """
    if file_size == 0:
        return None, [corrupt("source", EMPTY)], None
    if len(buf) >= 4 and bytes(buf[:4]) != GGUF_MAGIC:
        return None, [corrupt("header", f"not a GGUF file: it starts with {bytes(buf[:4])!r}, not {GGUF_MAGIC!r}")], None
    counts = _declared_counts(buf)
    if counts and (counts[0] > MAX_TENSORS or counts[1] > MAX_KEYS):
        message = f"the header declares {counts[0]} tensors and {counts[1]} key-values, far beyond any model: it is corrupt"
        return None, [corrupt("header", message)], None
    try:
        return parse_header(buf), [], None
    except TruncatedHeader as e:
        limit = min(file_size, MAX_HEADER_BYTES)
        if len(buf) < limit:
            return None, [], min(limit, max(e.needed or 0, 2 * len(buf)))
        if (e.needed or 0) > file_size or len(buf) >= file_size:
            message = f"the file ends inside its header: truncated, or a count or length in it is corrupt ({e})"
        else:
            message = (
                f"the header is larger than {MAX_HEADER_BYTES >> 20} MiB, which no model needs: a count or length is corrupt"
            )
        return None, [corrupt("header", message)], None
    except ModelFileError as e:
        return None, [corrupt("header", f"corrupt header: {e}")], None


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def check_layout(h: Header, file_size: int) -> list[Problem]:
    """What ggml's GGUF reader and llama.cpp's loader refuse: names, alignment, offsets, data past EOF."""
    problems = []
    alignment = h.fields.get(Keys.General.ALIGNMENT)
    if alignment is not None and alignment.type != VT.UINT32:
        problems.append(corrupt("layout", f"{Keys.General.ALIGNMENT} is stored as {alignment.type.name}; GGUF requires UINT32"))
    long_names = [n for n in h.tensors if len(n.encode()) >= GGML_MAX_NAME]
    if long_names:
        problems.append(corrupt("layout", f"tensor name {long_names[0][:80]!r} is longer than ggml's {GGML_MAX_NAME - 1} bytes"))
    expected = 0
    for t in h.tensors.values():  # ggml requires the data in tensor-info order, each tensor padded to the alignment
        if t.offset != expected:
            message = (
                f"tensor {t.name} starts at data offset {t.offset}, where ggml expects {expected}: the tensor infos are corrupt"
            )
            problems.append(corrupt("layout", message))
            break
        expected += _pad(t.n_bytes, h.alignment)
    end = max((h.data_offset + t.offset + t.n_bytes for t in h.tensors.values()), default=h.data_offset)
    if end > file_size:
        missing = 100 * (end - file_size) / max(end - h.data_offset, 1)
        problems.append(
            corrupt(
                "layout",
                f"the file is truncated: its tensor data ends at byte {end} but the file has {file_size} bytes "
                f"({min(missing, 100):.0f}% of the data is missing); download it again",
            )
        )
    return problems

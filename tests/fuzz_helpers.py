"""GGUF bytes damaged on purpose, shared by the fuzz tests of validate (test_fuzz_validate.py) and of the vision
tower (test_mmproj_validate.py): where a header's structure lies, edits aimed at it, and validate_remote's reader over
bytes in memory."""

from __future__ import annotations

import struct

from hypothesis import strategies as st

from clef_gguf.format.header import parse_header

INTERESTING = (0, 1, 2, 3, 4, 7, 8, 31, 32, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1)
Edit = tuple  # ("poke", position, bytes) | ("truncate", position) | ("insert", position, bytes) | ("delete", position, n)


def anchors(data: bytes) -> tuple[int, ...]:
    """Positions of the header's structure: counts, key and string lengths, value types, dims, types, offsets."""
    h = parse_header(data)
    points = {0, 4, 8, 16, 24, h.header_end, h.data_offset}
    for field in h.fields.values():
        points |= {field.start, field.start + 8, field.value_start, field.value_start + 4, field.value_start + 8}
        points |= {field.value_start + 16, field.end - 1}
    for t in h.tensors.values():
        points |= {t.start, t.start + 8, t.end - 20, t.end - 12, t.end - 8, h.data_offset + t.offset}
    return tuple(sorted(p for p in points if p < len(data)))


def apply_edits(data: bytes, edits: list[Edit]) -> bytes:
    for edit in edits:
        kind, position = edit[0], min(edit[1], len(data))
        if kind == "poke":
            data = data[:position] + edit[2] + data[position + len(edit[2]) :]
        elif kind == "truncate":
            data = data[:position]
        elif kind == "insert":
            data = data[:position] + edit[2] + data[position:]
        else:
            data = data[:position] + data[position + edit[2] :]
    return data


def _values() -> st.SearchStrategy[bytes]:
    numbers = st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**64 - 1))
    return st.one_of(
        st.binary(min_size=1, max_size=8),
        numbers.map(lambda n: struct.pack("<Q", n)),
        numbers.map(lambda n: struct.pack("<I", n % 2**32)),
        st.sampled_from([b"\xff", b"\x00" * 8, b"\x7f\x80\x00\x00", b"GGUF", "é".encode()]),
    )


@st.composite
def edits_of(draw: st.DrawFn, data: bytes, anchors: tuple[int, ...]) -> list[Edit]:
    """One to four edits of `data`: at one of its anchors, in its header (up to anchors[-1] + 64) or anywhere."""
    positions = st.one_of(st.sampled_from(anchors), st.integers(0, anchors[-1] + 64), st.integers(0, len(data)))
    edit = st.one_of(
        st.tuples(st.just("poke"), positions, _values()),
        st.tuples(st.just("truncate"), positions),
        st.tuples(st.just("insert"), positions, st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), positions, st.integers(1, 16)),
    )
    return draw(st.lists(edit, min_size=1, max_size=4))


class MemoryReader:
    """validate_remote's reader over bytes in memory: the HTTP path without the network."""

    def __init__(self, data: bytes, source: str) -> None:
        self.data, self.source, self.size, self.bytes_read = data, source, None, 0

    def read(self, start: int, end: int) -> bytes:
        self.size = len(self.data)
        chunk = self.data[start:end]
        self.bytes_read += len(chunk)
        return chunk

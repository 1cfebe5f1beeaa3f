"""Fuzzing validate: whatever bytes a file holds, a one-line report within seconds, never a traceback.

Seeded with real files (the demo Clef in F32, the same requantized to Q8_0, and its
backbone-only export), damaged by a few edits aimed mostly at the header's counts,
lengths, types and offsets. Header-only local validation must agree with the remote
path (a growing prefix, as over HTTP), and the runtime's gate with the verdict.

CI runs CLEF_FUZZ_EXAMPLES examples (default 800: ~30 s on a loaded 2-core machine, ~35 ms
each). CLEF_FUZZ_SECONDS=N also fuzzes for N seconds (test_fuzz_for_a_time_budget). Inputs that once failed stay below as
regression cases (REGRESSIONS).
"""

from __future__ import annotations

import functools
import json
import os
import random
import struct
import tempfile
import time
from pathlib import Path
from unittest import mock

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from clef_gguf.check import validate as V
from clef_gguf.check.report import Verdict
from clef_gguf.check.validate import open_validated, validate, validate_remote
from clef_gguf.data import DEMO_MODEL
from clef_gguf.format import contract as C
from clef_gguf.format.header import GGUFFile, parse_header
from clef_gguf.llama.qwen35_view import write_backbone_gguf
from clef_gguf.testing.gguf_bytes import build, kvs_of, tensors_of

EXAMPLES = int(os.environ.get("CLEF_FUZZ_EXAMPLES", "800"))
TIME_LIMIT_S = 5.0
INTERESTING = (0, 1, 2, 3, 4, 7, 8, 31, 32, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1)
GT = gguf.GGMLQuantizationType
# Hypothesis writes failing-example patches under its home directory: keep them out of the work tree.
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "clef-gguf-hypothesis"))

Edit = tuple  # ("poke", position, bytes) | ("truncate", position) | ("insert", position, bytes) | ("delete", position, n)


# --- Seeds --------------------------------------------------------------------------------------------
def _q8_0(f: GGUFFile) -> bytes:
    """The demo with every backbone matrix whose rows are whole blocks in Q8_0, as convert would write it."""
    tensors = []
    for name, dims, qtype, data in tensors_of(f):
        t = f.header.tensors[name]
        if len(dims) == 2 and dims[0] % 32 == 0 and not name.endswith(C.F32_ONLY_SUFFIXES) and not C.is_head_tensor(name):
            values = np.frombuffer(data, dtype=np.float32).reshape(t.shape)
            tensors.append((name, dims, int(GT.Q8_0), gguf.quants.quantize(values, GT.Q8_0).tobytes()))
        else:
            tensors.append((name, dims, qtype, data))
    return build(kvs_of(f), tensors, f.header.alignment)


def _backbone_only(f: GGUFFile) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "backbone.gguf"
        write_backbone_gguf(f, out)
        return out.read_bytes()


def _anchors(data: bytes) -> tuple[int, ...]:
    """Positions of the header's structure: counts, key and string lengths, value types, dims, types, offsets."""
    h = parse_header(data)
    points = {0, 4, 8, 16, 24, h.header_end, h.data_offset}
    for field in h.fields.values():
        points |= {field.start, field.start + 8, field.value_start, field.value_start + 4, field.value_start + 8}
        points |= {field.value_start + 16, field.end - 1}
    for t in h.tensors.values():
        points |= {t.start, t.start + 8, t.end - 20, t.end - 12, t.end - 8, h.data_offset + t.offset}
    return tuple(sorted(p for p in points if p < len(data)))


@functools.cache
def seeds() -> dict[str, tuple[bytes, tuple[int, ...]]]:
    f = GGUFFile.open(DEMO_MODEL)
    try:
        files = {"clef_f32": DEMO_MODEL.read_bytes(), "clef_q8_0": _q8_0(f), "backbone_only": _backbone_only(f)}
    finally:
        f.close()
    return {name: (data, _anchors(data)) for name, data in files.items()}


def damage(seed: str, edits: list[Edit]) -> bytes:
    return apply_edits(seeds()[seed][0], edits)


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


# --- Strategies ---------------------------------------------------------------------------------------
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


@st.composite
def damaged_files(draw: st.DrawFn) -> tuple[str, list[Edit]]:
    seed = draw(st.sampled_from(sorted(seeds())))
    return seed, draw(edits_of(*seeds()[seed]))


# --- The property -------------------------------------------------------------------------------------
class MemoryReader:
    """validate_remote's reader over bytes in memory: the HTTP path without the network."""

    def __init__(self, data: bytes, source: str) -> None:
        self.data, self.source, self.size, self.bytes_read = data, source, None, 0

    def read(self, start: int, end: int) -> bytes:
        self.size = len(self.data)
        chunk = self.data[start:end]
        self.bytes_read += len(chunk)
        return chunk


def check_any_bytes(data: bytes, deep: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzzed.gguf"
        path.write_bytes(data)
        started = time.perf_counter()
        report = validate(path, deep=deep)
        assert time.perf_counter() - started < TIME_LIMIT_S
        assert isinstance(report.verdict, Verdict) and report.summary and len(report.summary.splitlines()) == 1
        assert all(len(p.message.splitlines()) == 1 for p in report.problems)
        assert report.exit_code == {"complete": 0, "corrupt": 5, "not_a_decision_model": 6, "incomplete": 7}[report.verdict]
        json.dumps(report.to_dict())
        with mock.patch.object(V, "FIRST_FETCH", 256):  # many small fetches, as for a large remote header
            remote = validate_remote(MemoryReader(data, str(path)))
        local = report if not deep else validate(path)
        if not any(p.check == "head values" for p in local.problems):  # read from a local file only (check/finite.py)
            assert (remote.verdict, remote.summary) == (local.verdict, local.summary)
        if local.ok:
            open_validated(path).close()  # the runtime's gate agrees
        else:
            with pytest.raises(type(local.error())):
                open_validated(path)


# Inputs that once failed (seed, edits, deep), kept as regression cases.
REGRESSIONS: list[tuple[str, list[Edit], bool]] = [
    # One byte inserted into a key length: the next "key" spans the tokenizer, newlines included, and the
    # message quoting it was many lines long (found by the fuzzer; messages are now escaped and bounded).
    ("backbone_only", [("insert", 937, b"\x04")], False),
]


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=damaged_files(), deep=st.booleans())
@example(case=("clef_f32", [("truncate", 0)]), deep=False)
@example(case=("backbone_only", [("poke", 8, struct.pack("<Q", 2**63))]), deep=False)
def test_any_bytes_get_a_one_line_report_within_seconds(case: tuple[str, list[Edit]], deep: bool) -> None:
    check_any_bytes(damage(*case), deep)


@pytest.mark.parametrize(("seed", "edits", "deep"), REGRESSIONS)
def test_regressions(seed: str, edits: list[Edit], deep: bool) -> None:
    check_any_bytes(damage(seed, edits), deep)


def test_the_seeds_are_what_they_claim():
    verdicts = {name: validate_remote(MemoryReader(data, name)).verdict for name, (data, _) in seeds().items()}
    assert verdicts == {
        "clef_f32": Verdict.COMPLETE,
        "clef_q8_0": Verdict.COMPLETE,
        "backbone_only": Verdict.NOT_A_DECISION_MODEL,
    }


def test_fuzz_for_a_time_budget():
    """Random byte strings drive the same property for CLEF_FUZZ_SECONDS seconds (hypothesis' fuzz_one_input)."""
    budget = float(os.environ.get("CLEF_FUZZ_SECONDS", "0"))
    if budget <= 0:
        pytest.skip("set CLEF_FUZZ_SECONDS to fuzz for a time budget")
    rng = random.Random(int(os.environ.get("CLEF_FUZZ_SEED", "0")))
    fuzz = test_any_bytes_get_a_one_line_report_within_seconds.hypothesis.fuzz_one_input
    deadline, runs = time.monotonic() + budget, 0
    while time.monotonic() < deadline:
        fuzz(rng.randbytes(rng.choice((64, 256, 1024))))
        runs += 1
    print(f"fuzzed {runs} inputs in {budget:.0f} s without a finding")

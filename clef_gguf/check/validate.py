"""Is a GGUF file a complete Clef decision model? Said in one line, before anything is loaded.

Without `deep` only the header is read (key-values and tensor infos: ~16 MB of a 6 GB
file), locally through a memory map or remotely with HTTP range requests (remote.py),
so an early backbone-only conversion is caught before its download; a local file's head
values are read too (check/finite.py: NaN or Inf there makes every decision NaN). Every check adds
a Problem; the problems decide the verdict, and the verdict the exit code:

    complete              0  a Clef decision model stock llama.cpp and the head can run
    corrupt               5  unreadable, not GGUF, truncated, bad offsets; NaN or Inf in the head (read without
                             --deep: the head is small); --deep: NaN, Inf, zeros in any tensor; --sha256
    not_a_decision_model  6  a sound GGUF without the decision model (e.g. a backbone-only qwen35 file)
    incomplete            7  a Clef file with missing or mismatched parts (head, backbone, tokenizer, metadata)

The checks live in their own modules (layout, tensors, metadata, deep; the hyperparameters
in format/hparams.py); this one judges their problems and reports. Whatever bytes a file
holds, validate returns a report: a count or length read from the file sizes a loop or an
allocation only once bounded by the bytes that exist or by the limits of layout.py and
hparams.py. The runtime refuses what validate rejects, and builds from the description
`open_validated` returns.
"""

from __future__ import annotations

import mmap
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from gguf import Keys

from ..errors import ModelFileError, NotADecisionModelError, SettingsError
from ..format import contract as C
from ..format.header import GGUFFile, Header, Signature, signature_of
from ..format.hparams import prefix_of, read_backbone_shape, read_head_config
from ..inputs import open_regular
from .adapter import is_adapter, judge_adapter, lora_values
from .deep import check_data, file_sha256
from .description import ClefDescription, ValidatedFile
from .finite import check_head_values
from .layout import EMPTY, MAX_HEADER_BYTES, check_layout, parse_prefix
from .metadata import OLD_LAYOUT_MESSAGE, check_decision_metadata, check_temperatures, check_tokenizer, old_layout
from .mmproj import is_mmproj, judge_mmproj
from .report import Counts, Findings, Problem, Report, corrupt, make_report
from .tensors import check_backbone, check_head, check_types

FIRST_FETCH = 2 << 20  # remote: the first range request; grown until the header parses
MAX_FETCHES = 16
T = TypeVar("T")


def judge_header(h: Header, file_size: int) -> Findings:
    if is_mmproj(h):  # a vision tower, llama.cpp's mmproj: its own checks and summary
        return judge_mmproj(h, file_size)
    if is_adapter(h):  # a fine-tune's LoRA and head over a base (check/adapter.py)
        return judge_adapter(h, file_size)
    tensors = h.tensors
    n_head = sum(C.is_head_tensor(n) for n in tensors)
    arch = h.get(Keys.General.ARCHITECTURE)
    found = Findings(decision=arch == C.ARCH or C.KEY_DECISION_TYPE in h.fields or n_head > 0)
    found.problems += check_layout(h, file_size)
    tokens = h.get(Keys.Tokenizer.LIST)
    counts: dict[str, int | None] = {"tensors": len(tensors), "backbone": len(tensors) - n_head, "head": n_head}
    counts["vocab"] = len(tokens) if isinstance(tokens, list) else 0
    if arch not in (C.ARCH, C.BACKBONE_ARCH) and not found.decision:
        found.counts = Counts(**counts)
        return found
    if found.decision and old_layout(h):
        found.problems.append(Problem("layout", OLD_LAYOUT_MESSAGE))
        found.counts = Counts(**counts)
        return found
    backbone = read_backbone_shape(h, prefix_of(h))
    found.shape, problems, counts["backbone_expected"] = _read_part(h, backbone, "metadata", check_backbone)
    found.problems += problems
    found.problems += check_tokenizer(h)
    found.problems += check_types(h)
    if found.decision:
        problems, found.template = check_decision_metadata(h)
        found.problems += problems
        problems, notes, found.temperatures = check_temperatures(h)
        found.problems += problems
        found.notes += notes
        config = read_head_config(h, found.shape.n_embd if found.shape else None)
        found.head, problems, counts["head_expected"] = _read_part(h, config, "head", check_head)
        found.problems += problems
        found.notes += _notes(h)
    found.counts = Counts(**counts)
    return found


def _read_part(
    h: Header, read: tuple[T | None, list[str]], kind: str, check: Callable[[Header, T], tuple[list[Problem], int]]
) -> tuple[T | None, list[Problem], int | None]:
    """The part `read` holds (the backbone's shape or the head's config, and what is wrong in it), the problems of
    reading it (as `kind`) and of its tensors (`check`), and how many tensors it implies (None if it was not read)."""
    part, messages = read
    problems = [Problem(kind, m) for m in messages]
    if part is None:
        return None, problems, None
    more, expected = check(h, part)
    return part, problems + more, expected


def _notes(h: Header) -> list[str]:
    notes = []
    digest = h.get(C.KEY_REFERENCE_SHA256)
    if digest is not None and digest != C.REFERENCE_SHA256:
        notes.append(f"converted from a joint_schema_model.py with sha256 {digest!r}, not the one this version implements")
    return notes


# --- Entry points -----------------------------------------------------------------------------------
def _normalize_sha256(sha256: str | None) -> str | None:
    if sha256 is None:
        return None
    if not re.fullmatch(r"[0-9a-fA-F]{64}", sha256.strip()):
        raise SettingsError(f"--sha256 must be 64 hex digits, not {sha256!r}")
    return sha256.strip().lower()


def _open_map(path: Path) -> tuple[mmap.mmap | None, Signature | None, list[Problem]]:
    """The file mapped, and the signature of the version mapped (what the runtime pins: format/pinned.py)."""
    try:
        with open_regular(path) as fh:  # (a FIFO is refused, not waited on)
            signature = signature_of(os.fstat(fh.fileno()))
            if signature[2] == 0:
                return None, None, [corrupt("source", EMPTY)]
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), signature, []
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return None, None, [corrupt("source", f"cannot read {path}: {reason}")]


def _judge_local(path: Path, deep: bool, sha256: str | None, started: float) -> tuple[Report, GGUFFile | None, Findings]:
    mapped, signature, problems = _open_map(path)
    size = signature[2] if signature is not None else 0
    if mapped is None:
        found = Findings(problems=problems)
        return make_report(str(path), found, None, None, started), None, found
    view = memoryview(mapped)[: min(size, MAX_HEADER_BYTES)]  # parsing never looks past the limit
    try:
        header, problems, _ = parse_prefix(view, size)
    finally:
        view.release()
    if header is None:
        mapped.close()
        found = Findings(problems=problems)
        return make_report(str(path), found, None, size, started), None, found
    found = judge_header(header, size)
    f = GGUFFile(path, mapped, header, signature)
    extra: dict[str, Any] = {"deep": deep}
    laid_out = not any(p.check == "layout" for p in found.problems)
    if deep and laid_out:
        problems, notes = check_data(f)
        found.problems += problems
        found.notes += notes
    elif laid_out:  # the head is a small part of the file: its values are read even without --deep
        found.problems += check_head_values(f)
    if laid_out:  # an adapter's LoRA too (small): NaN or Inf (--deep found those), an alpha that overflows
        found.problems += lora_values(f, nonfinite=not deep)
    if sha256 is not None:
        extra["sha256"] = actual = file_sha256(path)
        if actual != sha256:
            found.problems.append(
                corrupt("sha256", f"sha256 is {actual}, expected {sha256}: the file is damaged or another file")
            )
    return make_report(str(path), found, header, size, started, **extra), f, found


def _fetch_header(reader: Any) -> tuple[Header | None, list[Problem]]:
    """Fetch a growing prefix until the header parses: each fetch at least doubles it, up to MAX_HEADER_BYTES."""
    buf = reader.read(0, FIRST_FETCH)
    for _ in range(MAX_FETCHES):
        header, problems, more = parse_prefix(buf, reader.size or len(buf))
        if more is None:
            return header, problems
        chunk = reader.read(len(buf), more)
        if not chunk:
            break
        buf += chunk
    return None, [corrupt("source", f"the server sent no more than {len(buf)} bytes of the header")]


def validate_remote(reader: Any) -> Report:
    """Header-only validation through `reader`: remote.RangeReader, or anything with `source`,
    `size` (known after the first read), `bytes_read` and `read(start, end) -> bytes`."""
    return _judge_remote(reader)[0]


def judge_reader(reader: Any) -> tuple[Report, Header | None]:
    """validate_remote's header-only judgment, with the parsed header: `reader` may read an open local file as well
    (the runtime judges an adapter file's header from its open descriptor before it copies a byte of it)."""
    return _judge_remote(reader)


def _judge_remote(reader: Any) -> tuple[Report, Header | None]:
    started = time.perf_counter()
    try:
        header, problems = _fetch_header(reader)
    except ModelFileError as e:
        return make_report(reader.source, Findings(problems=[corrupt("source", str(e))]), None, None, started), None
    extra = {"bytes_read": reader.bytes_read}
    if header is None:
        return make_report(reader.source, Findings(problems=problems), None, reader.size, started, **extra), None
    found = judge_header(header, reader.size or 0)
    return make_report(reader.source, found, header, reader.size, started, **extra), header


def judge_source(source: str | os.PathLike[str], deep: bool = False, sha256: str | None = None) -> tuple[Report, Header | None]:
    """validate(), with the parsed header (None when the file has none that parses): what check/pair.py compares."""
    from .remote import RangeReader, is_remote

    started = time.perf_counter()
    expected = _normalize_sha256(sha256)
    text = os.fspath(source)
    if is_remote(text) and not Path(text).exists():
        if deep or expected:
            raise SettingsError("--deep and --sha256 read the whole file: download it, then validate the local copy")
        return _judge_remote(RangeReader(text))
    report, f, _ = _judge_local(Path(text), deep, expected, started)
    if f is None:
        return report, None
    f.close()
    return report, f.header


def validate(source: str | os.PathLike[str], deep: bool = False, sha256: str | None = None) -> Report:
    """Judge a GGUF file: a local path, `REPO_ID[@REVISION]:FILENAME` on the Hub, or an http(s) URL.

    A Clef model, or a vision tower (llama.cpp's mmproj, general.architecture "clip": check/mmproj.py).
    Never raises for what the file holds: the Report says it. Header-only unless `deep`
    (reads every tensor) or `sha256` (hashes the file), which need a local file.
    """
    return judge_source(source, deep, sha256)[0]


def open_validated(path: str | os.PathLike[str]) -> ValidatedFile:
    """Map a GGUF file for the runtime after a header-only validation; raise validate's error unless complete.

    The description holds what the checks read (shapes, head config, compiled template), so the
    runtime parses nothing again.
    """
    report, f, found = _judge_local(Path(path), deep=False, sha256=None, started=time.perf_counter())
    if f is not None and is_mmproj(f.header):
        f.close()
        raise NotADecisionModelError(f"{path}: this is a vision tower (an mmproj), not a Clef model: load the model file")
    if f is not None and is_adapter(f.header):
        f.close()
        raise NotADecisionModelError(f"{path}: this is an adapter file, not a Clef model: load its base with the adapter")
    if not report.ok:
        if f is not None:
            f.close()
        report.raise_for_verdict()
    assert f is not None and found.shape and found.head and found.template  # complete: every check read its part
    h = f.header
    description = ClefDescription(
        path=f.path,
        name=str(h.get(Keys.General.NAME) or f.path.stem),
        shape=found.shape,
        head=found.head,
        template=found.template,
        nfc=h.get(C.KEY_NORMALIZER, "NFC") == "NFC",
        tensors=MappingProxyType(h.tensors),
        temperatures=MappingProxyType(found.temperatures),
    )
    return ValidatedFile(f, description)

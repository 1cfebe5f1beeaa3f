"""Requests as bytes: the one strict JSON reader, of the server's bodies and of `clef-gguf decide`'s files; and the
one JSON Lines reader (read_records: bounded lines), of decide's, eval's, compare's and calibrate's files.

Strict means UTF-8 (no other encoding; no BOM, but at the start of a file, where it is skipped), RFC 8259 JSON
(no NaN or Infinity, which Python's json takes), no lone UTF-16 surrogate (an escape like "\\ud800" decodes to
a string that cannot be encoded again, which would fail deep in tokenization or in writing the response), and
arrays and objects nested at most MAX_REQUEST_NESTING deep (json, and the prompt renderer after it, recurse once
per level). Every failure is a RequestJsonError saying where; the CLI makes it exit 2, the server a 422.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..errors import RequestError, RequestJsonError
from ..settings import MAX_LINE_BYTES
from .images import MAX_IMAGE_BYTES

MAX_REQUEST_NESTING = 256
_SKIP_CHUNK = 1 << 16  # what a JSON Lines line over the limit is read in
UTF8_BOM = b"\xef\xbb\xbf"  # skipped at the start of a file (Windows editors write it); refused in a body
_TOO_DEEP = f"nests arrays and objects more than {MAX_REQUEST_NESTING} deep"
# A \uD800-\uDFFF escape in the raw bytes is the only way a JSON text yields a surrogate (strict UTF-8
# decoding refuses encoded ones), and nesting past the limit takes that many brackets: only then is the
# parsed value walked, so that a large body of plain text is never walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> Any:
    """The strict JSON value of `raw`; raises RequestJsonError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        message = f"the request is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start}"
        raise RequestJsonError(message, offset=e.start) from e
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:  # (FastAPI's words for a body that is not JSON)
        raise RequestJsonError(f"JSON decode error: {e}", offset=e.pos) from e
    except RecursionError as e:
        raise RequestJsonError(f"the request {_TOO_DEEP}") from e
    except ValueError as e:  # NaN and Infinity, integers past Python's digit limit
        raise RequestJsonError(f"JSON decode error: {e}") from e
    if raw.count(b"[") + raw.count(b"{") > MAX_REQUEST_NESTING or _SURROGATE_ESCAPE.search(raw):
        _check_text(value)
    return value


def _check_text(value: Any) -> None:
    """Bounded nesting, and no lone surrogate in a string or a key, the first in document order.

    Iterative, so that the walk itself never meets Python's recursion limit.
    """
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if len(path) > MAX_REQUEST_NESTING:  # named by its top-level field: the full path would be as deep
            raise RequestJsonError(_TOO_DEEP, path[:1])
        if isinstance(item, str):
            _check_unicode(item, path)
        elif isinstance(item, dict):
            for key in item:
                _check_unicode(key, (*path, key))
            stack.extend(((v, (*path, k)) for k, v in reversed(item.items())))
        elif isinstance(item, list):
            stack.extend(((v, (*path, i)) for i, v in reversed(list(enumerate(item)))))


def _check_unicode(text: str, path: tuple[str | int, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        message = f"holds a lone surrogate (U+{ord(text[e.start]):04X}), which is not Unicode text"
        raise RequestJsonError(message, path, kind="string_unicode") from None


def read_request(source: str, images: Sequence[Path] = ()) -> Any:
    """`clef-gguf decide`'s request: the JSON file `source` ("-": stdin), read strictly, and `images` files
    after the request's own images (as bytes: the runtime reads their format). Raises RequestError."""
    try:
        raw = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except OSError as e:
        raise RequestError(f"cannot read the request: {e.strerror or e}") from e
    request = parse_json(raw.removeprefix(UTF8_BOM))  # (a file's byte order mark, as JSON Lines files' line 1)
    if images:
        if not isinstance(request, dict):
            raise RequestError("the request must be a JSON object")
        given = request.get("images") or []
        if not isinstance(given, list):
            raise RequestError("must be a list of images", "images")
        request["images"] = [*given, *(read_image(path) for path in images)]
    return request


def read_image(path: Path) -> bytes:
    """An image file, under the API's limits: a regular file (not a FIFO that never ends, nor /dev/zero),
    read no further than one byte past the limit of an image (MAX_IMAGE_BYTES)."""
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer; fstat then refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise RequestError(f"{path} is not a regular file", "images")
            data = file.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:
        raise RequestError(f"cannot read {path}: {e.strerror or e}", "images") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise RequestError(f"{path} is over the limit of an image, {MAX_IMAGE_BYTES >> 20} MiB", "images")
    return data


# --- JSON Lines files: decide's, eval's, compare's and calibrate's -------------------------------------
@dataclass(frozen=True)
class Record:
    line: int  # 1-based
    raw: bytes  # without the line ending; empty for a line over the limit, which is never held whole
    over: int = 0  # a line over the limit: its length in bytes (without the line ending)
    over_sha256: str = ""  # and its digest, computed as it streamed past

    @property
    def sha256(self) -> str:
        """request_sha256 of the line's bytes."""
        return self.over_sha256 or hashlib.sha256(self.raw).hexdigest()  # (dataset.request_sha256)


def read_records(file: IO[bytes], max_line_bytes: int = MAX_LINE_BYTES, first_line: int = 1) -> Iterator[Record]:
    """The non-blank lines of a JSON Lines file, the one reader of decide's, eval's, compare's and calibrate's.
    `first_line`: the number of the line the file is positioned at (a Ray worker reads its part of the file from
    an offset: dataset_ray.py); the byte order mark rule is line 1's only.

    A UTF-8 byte order mark at the start of line 1 is skipped (Windows editors write one). A line longer than
    max_line_bytes is read in bounded chunks, hashed and skipped to its newline, never held whole: it becomes a
    Record with `over` set, which the callers answer with an error (a 50 MB line was read, parsed and tokenized
    whole before: 3.5 GB of memory)."""
    try:
        number = first_line - 1
        while chunk := file.readline(max_line_bytes + 2):  # the longest line taken whole, and its "\r\n"
            number += 1
            whole = chunk.endswith(b"\n") or len(chunk) < max_line_bytes + 2  # (shorter without a newline: the end)
            chunk = chunk.removeprefix(UTF8_BOM) if number == 1 else chunk
            if not whole:
                yield Record(number, b"", *_skip_line(file, chunk))
                continue
            raw = chunk.rstrip(b"\n").removesuffix(b"\r")
            if len(raw) > max_line_bytes:
                yield Record(number, b"", len(raw), hashlib.sha256(raw).hexdigest())
            elif raw.strip():
                yield Record(number, raw)
    except OSError as e:  # an I/O error, a directory: the requests read before are answered first (decide_outcomes)
        raise RequestError(f"cannot read the requests: {e.strerror or e}") from None


def _skip_line(file: IO[bytes], head: bytes) -> tuple[int, str]:
    """The length and digest of a line whose first bytes are `head`, read to its end in chunks of _SKIP_CHUNK.

    One chunk is held back, so that a "\\r\\n" split between two chunks is still the line ending, not its bytes."""
    digest, size, held = hashlib.sha256(), 0, head
    while True:
        part = file.readline(_SKIP_CHUNK)
        if not part or part.endswith(b"\n"):
            last = (held + part).rstrip(b"\n").removesuffix(b"\r")
            digest.update(last)
            return size + len(last), digest.hexdigest()
        digest.update(held)
        size += len(held)
        held = part


def over_limit(record: Record, max_line_bytes: int) -> str:
    """What is wrong with a line over the limit, in one line."""
    return f"the line is {record.over} bytes, over the limit of {max_line_bytes} (--max-line-bytes): not read"


def count_records(path: Path) -> int | None:
    """The requests in a regular file, for the progress bar; None for a pipe, a FIFO or a device, which can be read
    once only (counting it would consume the requests)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with open(path, "rb") as file:
            return _count_lines(file)
    except OSError:
        return None


def _count_lines(file: IO[bytes]) -> int:
    """The non-blank lines, read in blocks: a line of any length costs a block of memory."""
    count, content = 0, False
    while block := file.read(1 << 20):
        *ended, tail = block.split(b"\n")
        for piece in ended:
            count += content or bool(piece.strip())
            content = False
        content = content or bool(tail.strip())
    return count + content

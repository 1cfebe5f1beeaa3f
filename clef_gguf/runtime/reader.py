"""Requests as bytes: the one strict JSON reader, of the server's bodies and of `clef-gguf decide`'s files.

Strict means UTF-8 (no BOM, no other encoding), RFC 8259 JSON (no NaN or Infinity, which Python's json
takes), no lone UTF-16 surrogate (an escape like "\\ud800" decodes to a string that cannot be encoded
again, which would fail deep in tokenization or in writing the response), and arrays and objects nested
at most MAX_REQUEST_NESTING deep (json, and the prompt renderer after it, recurse once per level). Every
failure is a RequestJsonError saying where; the CLI makes it exit 2, the server a 422.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import RequestError, RequestJsonError
from .images import MAX_IMAGE_BYTES

MAX_REQUEST_NESTING = 256
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
    request = parse_json(raw)
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

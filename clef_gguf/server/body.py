"""A request body: bounded in size, Content-Encoding undone, parsed as strict JSON.

Everything a client can get wrong here is a 4xx: a body over the limit (413), an encoding or
media type the server cannot read (415), bytes that are not UTF-8 JSON (422). Strict JSON
means no NaN or Infinity (Python's json accepts them), and no lone UTF-16 surrogates
(escapes like "\\ud800" decode to strings that cannot be encoded again, which would fail
deep in tokenization or in writing the response).
"""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request

from .problems import ApiError, Invalid, Location

# The decoded body is capped at the model's token limit times this many bytes, so that a body no prompt
# could fit is refused while it is decoded (in milliseconds), never tokenized. Measured on Qwen3.5's vocabulary
# (the Clef backbone's): a state of English text is 4.1 body bytes per prompt token, code 3.7, CJK, Japanese or
# emoji 4.0 to 5.8 as UTF-8 and 11.1 to 12.0 as the \uXXXX escapes json.dumps writes by default. Only runs of
# one character (a token covers up to 128 spaces) go past 16: such a body is refused as too large.
BYTES_PER_TOKEN = 16
DEFAULT_BODY_TIMEOUT_S = 30.0  # to send a whole body: 35 KB/s for the 1 MiB cap of a 65,536-token context


# With a vision tower, room for the images on top (Workers AI's: 8 MiB of image files, base64 in JSON, and a
# request body of at most 13 MiB in all).
IMAGE_ALLOWANCE = 13 << 20


def body_limit(max_prompt_tokens: int, images: bool = False) -> int:
    """The largest decoded (and raw) body worth reading for a model with this token limit (and images)."""
    return max_prompt_tokens * BYTES_PER_TOKEN + (IMAGE_ALLOWANCE if images else 0)


# A \uD800-\uDFFF escape in the raw bytes is the only way a JSON text yields a surrogate
# (strict UTF-8 decoding rejects encoded ones): only then is the parsed value walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _zstd_decompressor() -> Callable[[bytes, int], tuple[bytes, bool]] | None:
    try:  # Python 3.14 has zstd; before it, backports.zstd (a dependency) provides the same API
        from compression.zstd import ZstdDecompressor  # type: ignore[import-not-found]
    except ImportError:
        try:
            from backports.zstd import ZstdDecompressor  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return None

    def decompress(data: bytes, limit: int) -> tuple[bytes, bool]:
        d = ZstdDecompressor()
        return d.decompress(data, max_length=limit), d.eof

    return decompress


def _zlib(wbits: int) -> Callable[[bytes, int], tuple[bytes, bool]]:
    def decompress(data: bytes, limit: int) -> tuple[bytes, bool]:
        d = zlib.decompressobj(wbits)
        return d.decompress(data, limit), d.eof

    return decompress


# typesafe-sdk compresses bodies of 1 KiB or more with zstd whenever zstd is importable
# (Python >= 3.14, or its [zstd] extra): a compatible server must read them.
DECODERS = {"gzip": _zlib(16 + zlib.MAX_WBITS), "x-gzip": _zlib(16 + zlib.MAX_WBITS), "deflate": _zlib(zlib.MAX_WBITS)}
if (_zstd := _zstd_decompressor()) is not None:
    DECODERS["zstd"] = _zstd


def too_large(limit: int) -> ApiError:
    return ApiError(413, "request_too_large", f"the request body is larger than this server's limit of {limit} bytes")


async def _collect(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read(request: Request, limit: int, timeout_s: float) -> bytes:
    """The raw body, refused as soon as it passes `limit` bytes (never buffered whole first), and
    within `timeout_s` seconds: a client trickling its body (slowloris) gets 408 and a closed connection."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    try:
        return await asyncio.wait_for(_collect(request, limit), timeout_s)
    except asyncio.TimeoutError:
        message = f"the request body did not arrive within {timeout_s:g} s"
        raise ApiError(408, "request_timeout", message, {"Connection": "close"}) from None
    except ClientDisconnect:  # nobody reads the answer; typed so that it is not logged as a server fault
        raise ApiError(400, "invalid_request_error", "the client closed the connection before its body ended") from None


def check_media_type(content_type: str | None) -> None:
    # typesafe-sdk sends multipart/form-data to carry images (server/media.py); no client sends another multipart.
    media = (content_type or "").split(";")[0].strip().lower()
    if media.startswith("multipart/") and media != "multipart/form-data":
        raise ApiError(415, "invalid_request_error", f"{media} is not read; images come in multipart/form-data (typesafe-sdk's)")


def decode(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """Undo Content-Encoding (applied in the order listed, so undone last to first), bounded by `limit`."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        decoder = DECODERS.get(coding)
        if decoder is None:
            supported = ", ".join(DECODERS)
            raise ApiError(415, "invalid_request_error", f"unsupported Content-Encoding {coding!r} (supported: {supported})")
        try:
            raw, complete = decoder(raw, limit + 1)
        except Exception as e:  # zlib.error, ZstdError: the codecs share no base class but Exception
            raise Invalid(["body"], f"the {coding} body cannot be decoded: {e}") from e
        if len(raw) > limit:
            raise too_large(limit)
        if not complete:
            raise Invalid(["body"], f"the {coding} body is truncated")
    return raw


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _surrogate_at(value: Any, loc: Location) -> Location | None:
    """Where the first string (or key) with a lone surrogate is, if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return loc
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _surrogate_at(key, [*loc, key]) or _surrogate_at(item, [*loc, key])
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _surrogate_at(item, [*loc, index])
            if found:
                return found
    return None


def parse(raw: bytes) -> Any:
    """Strict JSON (RFC 8259) of a UTF-8 body; every failure is a 422 naming where."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Invalid(["body", e.start], "the body is not UTF-8", "json_invalid") from e
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise Invalid(["body", e.pos], f"JSON decode error: {e.msg}", "json_invalid") from e
    except RecursionError as e:
        raise Invalid(["body"], "the JSON is nested too deeply", "json_invalid") from e
    except ValueError as e:  # NaN/Infinity, integers over Python's digit limit
        raise Invalid(["body"], f"JSON decode error: {e}", "json_invalid") from e
    if _SURROGATE_ESCAPE.search(raw):
        try:
            where = _surrogate_at(value, ["body"])
        except RecursionError as e:
            raise Invalid(["body"], "the JSON is nested too deeply", "json_invalid") from e
        if where:
            raise Invalid(where, "a string holds a lone UTF-16 surrogate (not Unicode text)", "string_unicode")
    return value

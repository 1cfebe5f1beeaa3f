"""A request body: bounded in size, Content-Encoding undone, parsed as strict JSON.

Everything a client can get wrong here is a 4xx, each a row of the error table (errors.py): a
body over the limit (REQUEST_TOO_LARGE), too slow (BODY_TIMEOUT) or cut off (BODY_CUT_OFF), an encoding or media
type the server cannot read (UNSUPPORTED_MEDIA), bytes that are not strict UTF-8 JSON (INVALID: the runtime's
reader, runtime/reader.py, which `clef-gguf decide` reads its files with too).

While a body arrives it holds no intake slot (intake.py takes one once it is whole), only a connection and the
bytes it sent: Bodies bounds both across the server, as nginx and Kestrel read bodies before handing them on.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from starlette.requests import ClientDisconnect, Request

from ..errors import BODY_CUT_OFF, BODY_TIMEOUT, REQUEST_TOO_LARGE, UNSUPPORTED_MEDIA, RequestJsonError
from ..runtime.failures import Invalid, from_request_error
from ..runtime.reader import parse_json
from ..settings import HttpLimits
from .problems import ApiError, overloaded


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
    return ApiError(REQUEST_TOO_LARGE, f"the request body is larger than this server's limit of {limit} bytes")


def _deadline(limits: HttpLimits, start: float, received: int) -> float:
    """When the body is late, having received `received` bytes since `start`: at the body timeout, or when its average
    rate falls under min_body_rate (after the grace period; 0: no rate)."""
    late = start + limits.body_timeout
    if limits.min_body_rate > 0:
        late = min(late, start + max(limits.body_grace, received / limits.min_body_rate))
    return late


def _late(limits: HttpLimits, start: float, received: int, now: float) -> ApiError:
    if now - start >= limits.body_timeout:
        message = f"the request body did not arrive within {limits.body_timeout:g} s"
    else:
        rate = received / max(now - start, 1e-9)
        message = f"the request body arrives at {rate:.0f} bytes/s, under this server's minimum of {limits.min_body_rate:g}"
    return ApiError(BODY_TIMEOUT, message)


class Bodies:
    """The request bodies arriving, across the server: at most `max_body_readers` at once, holding at most
    `max_body_buffer` bytes in all. A body is charged the bytes it has sent, never what it declares: a connection
    trickling a body costs the few bytes it sent, however long its Content-Length. Touched on the event loop only."""

    def __init__(self, limits: HttpLimits) -> None:
        self.max_readers = limits.max_body_readers
        self.max_bytes = limits.max_body_buffer
        self.readers = 0
        self.bytes = 0

    def _full(self, wanted: int, close: bool = False) -> ApiError:
        message = (
            f"request bodies still arriving hold {self.bytes} of this server's {self.max_bytes} bytes (--max-body-buffer): "
            f"no room for {wanted} more; retry shortly"
        )
        return overloaded(message, close=close)

    @contextmanager
    def reading(self, declared: int) -> Iterator[Callable[[int], None]]:
        """A body of `declared` bytes (0: not declared) admitted to be read, or OVERLOADED at once: past the readers,
        or when it does not fit the bytes left. Yields what charges its bytes as they come; a chunk that does not fit
        gets OVERLOADED and a closed connection. All are given back when the body is whole, refused or abandoned."""
        if self.readers >= self.max_readers:
            message = f"{self.readers} request bodies are being read, this server's limit (--max-body-readers); retry shortly"
            raise overloaded(message)
        if declared > self.max_bytes - self.bytes:
            raise self._full(declared)
        held = 0

        def take(size: int) -> None:
            nonlocal held
            if self.bytes + size > self.max_bytes:
                raise self._full(size, close=True)
            self.bytes += size
            held += size

        self.readers += 1
        try:
            yield take
        finally:
            self.readers -= 1
            self.bytes -= held


async def read(request: Request, limit: int, limits: HttpLimits, bodies: Bodies) -> bytes:
    """The raw body, refused as soon as it passes `limit` bytes (never buffered whole first), and as slow as `limits`
    allow: a client trickling its body (slowloris) gets BODY_TIMEOUT and a closed connection. It counts among `bodies` until
    it is whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    loop = asyncio.get_running_loop()
    chunks, size, start = [], 0, loop.time()
    stream = request.stream().__aiter__()
    with bodies.reading(int(declared) if declared.isdigit() else 0) as take:
        try:
            while True:
                wait = _deadline(limits, start, size) - loop.time()
                try:
                    chunk = await asyncio.wait_for(stream.__anext__(), max(wait, 0.0))
                except StopAsyncIteration:
                    return b"".join(chunks)
                except asyncio.TimeoutError:
                    raise _late(limits, start, size, loop.time()) from None
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                take(len(chunk))
                chunks.append(chunk)
        except ClientDisconnect:  # nobody reads the answer; typed so that it is not logged as a server fault
            raise ApiError(BODY_CUT_OFF, "the client closed the connection before its body ended") from None


# What a body may be: JSON (every client's), or typesafe-sdk's multipart/form-data carrying images (server/media.py).
# A body of any other type, or of none, is what another site's page can make a browser send without asking first
# (text/plain, a form: a CORS "simple" request); its Origin refuses such a page's multipart (guard.py).
MEDIA_TYPES = ("application/json", "multipart/form-data")


def check_media_type(content_type: str | None) -> None:
    media = (content_type or "").split(";")[0].strip().lower()
    if media not in MEDIA_TYPES:
        sent = f"Content-Type {media}" if media else "no Content-Type"
        message = f"a request body is JSON: send Content-Type: application/json (this request has {sent})"
        if media.startswith("multipart/"):
            message = f"{media} is not read; images come in multipart/form-data (typesafe-sdk's)"
        raise ApiError(UNSUPPORTED_MEDIA, message)


def decode(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """Undo Content-Encoding (applied in the order listed, so undone last to first), bounded by `limit`."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        decoder = DECODERS.get(coding)
        if decoder is None:
            supported = ", ".join(DECODERS)
            raise ApiError(UNSUPPORTED_MEDIA, f"unsupported Content-Encoding {coding!r} (supported: {supported})")
        try:
            raw, complete = decoder(raw, limit + 1)
        except Exception as e:  # zlib.error, ZstdError: the codecs share no base class but Exception
            raise Invalid(["body"], f"the {coding} body cannot be decoded: {e}") from e
        if len(raw) > limit:
            raise too_large(limit)
        if not complete:
            raise Invalid(["body"], f"the {coding} body is truncated")
    return raw


def parse(raw: bytes) -> Any:
    """Strict JSON of a UTF-8 body (the runtime's reader, as `clef-gguf decide` reads a file): INVALID, naming where."""
    try:
        return parse_json(raw)
    except RequestJsonError as e:
        raise from_request_error(e, None) from e

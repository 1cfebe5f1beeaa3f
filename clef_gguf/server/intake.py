"""Reading, validating and tokenizing request bodies, off the decision worker and bounded.

A body is read first (bounded in bytes and in time, body.py), holding no intake slot: while it arrives it
costs a connection and the bytes it sent, which body.Bodies bounds across the server (--max-body-readers,
--max-body-buffer). Once whole, it takes an intake slot until it is known to be a request that fits the
model: decoded, parsed, validated and tokenized. At most `max_reading` requests hold one, bounded like
decisions are (worker.py): past it, a whole body gets OVERLOADED, and the memory of bodies being prepared is
bounded by max_reading bodies of at most `limit` bytes. So clients trickling their bodies, however many,
never take the slots of requests whose bodies are in.

Tokenizing happens here, on intake threads, never on the decision worker: a prompt over the
token limit gets its PROMPT_TOO_LONG without waiting for (or delaying) any decision. Bodies over LARGE_BODY
bytes go to a lane of their own, one thread, so that however many large bodies arrive, a small
request is prepared at once on the other lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

from starlette.requests import Request

from ..errors import (
    REQUEST_TOO_LARGE,
    AdapterUnavailableError,
    ModelFileError,
    PromptTooLongError,
    RequestError,
    SettingsError,
    SourceUnavailableError,
    TemporarilyUnavailableError,
)
from ..runtime import images
from ..runtime.failures import from_request_error, problem_of
from ..runtime.protocols import Encoder
from ..runtime.sources import FetchPending, late, not_waiting
from ..settings import HttpLimits
from . import body, media
from .problems import ApiError, overloaded

LARGE_BODY = 64 * 1024  # a decoded body past this is prepared on the large lane (and memory trimmed after it)
# Times a request awaits an adapter being fetched before it is prepared once more waiting on its thread (a cache too
# small to keep what was just fetched would otherwise send it round for ever).
FETCH_ROUNDS = 3


async def _fetched(pending: FetchPending) -> None:
    """Await a fetch, at most its first-use bound (then SOURCE_UNAVAILABLE); its error is not raised here: the next
    preparation meets it as the sources keep it (its back-off)."""
    fetch = asyncio.wrap_future(pending.future)
    fetch.add_done_callback(lambda f: f.cancelled() or f.exception())  # (its error read, even by no one awaiting it)
    try:
        await asyncio.wait_for(asyncio.shield(fetch), pending.timeout_s)  # (shielded: the fetch serves other requests)
    except asyncio.TimeoutError:
        raise problem_of(late(pending.name, pending.timeout_s), None) from None
    except Exception:  # noqa: S110 (met again, as a request's error, when the request is prepared again)
        pass


def _glibc() -> bool:
    """Whether this process runs on glibc (os.confstr has no such name on macOS, musl or Windows)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False


@cache
def _malloc_trim() -> Callable[[], None]:
    """glibc keeps the heap pages of freed large bodies (tokens, lists, JSON) unless asked: malloc_trim hands
    them back, so memory returns to its baseline after a large body. A no-op elsewhere. Looked up at the first
    large body, not at import, in the symbols the process already has (CDLL(None): glibc is loaded, by Python)."""
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if _glibc() else None
    except OSError:
        trim = None
    if trim is None:
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


def _payload_bytes(image: Any) -> int:
    """The bytes an image takes in a body: its data URL or base64 string, its part's bytes, or the strings of
    its object ({content_type, base64})."""
    if isinstance(image, str | bytes):
        return len(image)
    if isinstance(image, dict):
        return sum(len(v) for v in image.values() if isinstance(v, str))
    return 0


def _text_bytes(decoded: bytes, value: Any) -> int:
    """A body's bytes less its images' (top-level `images`, TypeSafe's assets, chat messages' image parts)."""
    if not isinstance(value, dict):
        return len(decoded)
    try:
        found, _ = images.request_images(value, value.get("state"))
    except RequestError:  # a malformed images field: encode names it
        return len(decoded)
    return max(0, len(decoded) - sum(map(_payload_bytes, found)))


class Intake:
    def __init__(
        self,
        model: Encoder,
        max_reading: int,
        limit: int,
        limits: HttpLimits,
        text_limit: int | None = None,
        bodies: body.Bodies | None = None,
    ) -> None:
        if limits.max_body_buffer < limit:
            message = f"--max-body-buffer ({limits.max_body_buffer} bytes) is under the body limit ({limit} bytes)"
            raise SettingsError(f"{message}: the largest bodies could never be read; raise it")
        self.model = model
        self.max_reading = max_reading
        self.limit = limit  # bytes, raw and decoded
        # bytes of a body less its images' (settings.body_limit without images): a body that takes images may be
        # larger by their allowance, never its text, which is refused before it is tokenized
        self.text_limit = limit if text_limit is None else min(limit, text_limit)
        self.limits = limits  # how fast a body must arrive
        self.bodies = bodies or body.Bodies(limits)  # the bodies arriving (a server's apps may share one)
        self.preparing = 0  # whole bodies holding an intake slot; touched on the event loop only
        self._small = ThreadPoolExecutor(max_workers=2, thread_name_prefix="clef-intake")
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-intake-large")

    def _prepare(self, decoded: bytes, content_type: str | None, waiting: bool = False) -> Any:
        """Parse, validate and tokenize one decoded body, before it waits for the model (a 422 even when the
        server is busy): the encoded prompt, known to fit the model. Its images are decoded and sized here too.

        The worker decides on this very prompt: a request is parsed and tokenized once."""
        if media.is_multipart(content_type):  # typesafe-sdk's images: the JSON and the image files in parts
            parts = media.split_multipart(decoded, content_type or "")
            value = media.request_of_multipart(parts, body.parse)
        else:
            parts, value = {}, body.parse(decoded)
        value, origins = media.take_assets(value, parts)
        origins += media.chat_part_origins(value)
        if self.text_limit < self.limit and (text := _text_bytes(decoded, value)) > self.text_limit:
            message = f"the request's text is {text} bytes (its images aside), over this server's limit of {self.text_limit}"
            raise ApiError(REQUEST_TOO_LARGE, message)
        try:
            # A name whose adapter is being fetched raises FetchPending (awaited by request()), never blocking this
            # thread, on which the base's and the loaded adapters' requests are prepared too.
            with contextlib.nullcontext() if waiting else not_waiting():
                prompt = self.model.encode(value)
        except RequestError as e:  # (nesting was bounded by body.parse: the prompt renderer recurses per level)
            raise media.relocate(from_request_error(e, value), origins) from e
        except (ModelFileError, SettingsError, AdapterUnavailableError, TemporarilyUnavailableError, SourceUnavailableError) as e:
            # The adapter the request names, opened for it (runtime/catalog.py): its file refused, or gone for now, or
            # no room for its private copy now, or its source unreachable now (runtime/sources.py).
            raise problem_of(e, value) from e
        if len(prompt.tokens) > self.model.max_prompt_tokens:
            raise from_request_error(PromptTooLongError(len(prompt.tokens), self.model.max_prompt_tokens), value)
        return prompt

    def _prepare_large(self, decoded: bytes, content_type: str | None, waiting: bool = False) -> Any:
        try:
            return self._prepare(decoded, content_type, waiting)
        finally:
            _malloc_trim()()  # the tokens and the parse of a refused body are garbage by now

    @property
    def reading(self) -> int:
        """Requests whose body is not a prompt yet: arriving, or whole and being prepared."""
        return self.bodies.readers + self.preparing

    async def request(self, request: Request) -> Any:
        """The request of `request`, parsed, validated and encoded; raises a Failure (an ApiError too) or Invalid."""
        content_type = request.headers.get("content-type")
        body.check_media_type(content_type)
        raw = await body.read(request, self.limit, self.limits, self.bodies)  # no intake slot while it arrives
        if self.preparing >= self.max_reading:
            raise overloaded(f"{self.preparing} requests are already being prepared (--max-queue); retry shortly")
        self.preparing += 1
        try:
            # Decoding stays on the event loop: bounded by the limit, it takes milliseconds, and the decoded
            # size is what picks the lane (a small compressed body can decode to a large one).
            decoded = body.decode(raw, request.headers.get("content-encoding"), self.limit)
            del raw
            lane, prepare = (self._large, self._prepare_large) if len(decoded) > LARGE_BODY else (self._small, self._prepare)
            for _ in range(FETCH_ROUNDS):
                try:
                    return await asyncio.wrap_future(lane.submit(prepare, decoded, content_type))
                except FetchPending as pending:  # an adapter's first use: awaited here, holding no intake thread
                    await _fetched(pending)
            return await asyncio.wrap_future(lane.submit(prepare, decoded, content_type, waiting=True))
        finally:
            self.preparing -= 1

    def close(self) -> None:
        self._small.shutdown(wait=True, cancel_futures=True)
        self._large.shutdown(wait=True, cancel_futures=True)

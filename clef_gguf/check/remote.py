"""Reading byte ranges of a remote GGUF file, so that validate judges it before a download.

`REPO_ID[@REVISION]:FILENAME` names a file on the Hugging Face Hub (or the endpoint in
HF_ENDPOINT); an http(s) URL names any file. Requests go through huggingface_hub's
HTTP session (its proxies, retries and user agent); the Hub token is sent to the Hub
only, never to another host.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from ..errors import ClefError, CorruptModelError

HF_SOURCE = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[^:]+))?:(?P<filename>[^:]+\.gguf)$")
TIMEOUT_S = 30.0  # any one network operation (connect, one read)
# The whole remote validation, every range request included: a 64 MiB header (the most validate
# reads) at 1 MB/s. A server slower than that, or one sending a byte a second, is refused.
DEADLINE_S = 90.0
_CHUNK = 1 << 16
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


def is_remote(source: str) -> bool:
    return source.startswith(("https://", "http://")) or HF_SOURCE.match(source) is not None


def _endpoint() -> str:
    from huggingface_hub import constants

    # Read at call time, not import time: HF_ENDPOINT may be set after huggingface_hub was imported.
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def resolve(source: str) -> tuple[str, dict[str, str]]:
    """The URL of `source` and the headers to send there (the Hub token only to the Hub)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    match = HF_SOURCE.match(source)
    url = hf_hub_url(match["repo"], match["filename"], revision=match["revision"], endpoint=_endpoint()) if match else source
    to_hub = urlsplit(url).netloc == urlsplit(_endpoint()).netloc
    headers = build_hf_headers() if to_hub else {"user-agent": build_hf_headers().get("user-agent", "clef-gguf")}
    return url, headers


@contextmanager
def _get(url: str, headers: dict[str, str], timeout: float) -> Iterator[Any]:
    """A streamed GET through huggingface_hub's session: httpx-like (hub >= 1.0) or requests (older)."""
    from huggingface_hub import get_session

    session = get_session()
    if hasattr(session, "stream"):
        with session.stream("GET", url, headers=headers, follow_redirects=True, timeout=timeout) as response:
            yield response
    else:
        with session.get(url, headers=headers, stream=True, timeout=timeout, allow_redirects=True) as response:
            yield response


def _chunks(response: Any) -> Iterator[bytes]:
    """Bytes as they arrive, so that the deadline is checked between network reads, not per 64 KiB."""
    if hasattr(response, "iter_bytes"):
        return response.iter_bytes()  # httpx: with no size, one chunk per read
    if hasattr(response.raw, "read1"):  # requests on urllib3 >= 2.3
        return iter(lambda: response.raw.read1(_CHUNK), b"")
    return response.iter_content(_CHUNK)


def _total_size(status: int, headers: Any) -> int | None:
    if status == 206:
        match = _CONTENT_RANGE.match(headers.get("content-range", "").strip())
        return int(match[3]) if match else None
    length = headers.get("content-length")
    return int(length) if length and length.isdigit() else None


class RangeReader:
    """Bytes of a remote file by range. `size` is known after the first read."""

    def __init__(self, source: str, deadline_s: float | None = None) -> None:
        self.source = source
        self.url, self.headers = resolve(source)
        self.size: int | None = None
        self.bytes_read = 0  # what crossed the network, for the report and the tests
        self.deadline_s = DEADLINE_S if deadline_s is None else deadline_s
        self._deadline = time.monotonic() + self.deadline_s

    def _time_left(self) -> float:
        """Seconds left for all reads together; past the deadline, a CorruptModelError."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise CorruptModelError(
                f"cannot read {self.source}: the header did not arrive within {self.deadline_s:g} s (server too slow)"
            )
        return left

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file, fewer only where the file ends. Raises CorruptModelError."""
        try:
            return self._read(start, end)
        except ClefError:
            raise
        except Exception as e:  # requests, httpx or httpx2 (by huggingface_hub version) each have their own errors
            self._time_left()  # a read that timed out at the deadline: say so
            raise CorruptModelError(f"cannot read {self.source}: {type(e).__name__}: {e}") from e

    def _read(self, start: int, end: int) -> bytes:
        headers = {**self.headers, "Range": f"bytes={start}-{end - 1}"}
        # Each network operation waits at most what is left of the deadline, so a silent server cannot outlast it.
        with _get(self.url, headers, timeout=min(TIMEOUT_S, self._time_left())) as response:
            status = response.status_code
            if status == 416:  # the range starts at or after the end of the file
                return b""
            if status not in (200, 206):
                raise CorruptModelError(f"cannot read {self.source}: {_status_text(status)}")
            self.size = _total_size(status, response.headers)
            if self.size is None:
                raise CorruptModelError(f"cannot read {self.source}: the server does not say how large the file is")
            # A server that ignores Range sends the file from byte 0: skip to `start`, stop at `end`.
            skip = 0 if status == 206 else start
            data = bytearray()
            for chunk in _chunks(response):
                data += chunk
                self.bytes_read += len(chunk)
                if len(data) >= skip + end - start:
                    break
                self._time_left()  # a server trickling bytes is stopped here
        return bytes(data[skip : skip + end - start])


def _status_text(status: int) -> str:
    if status in (401, 403):
        return f"access denied (HTTP {status}): a gated or private repository needs `hf auth login` or HF_TOKEN"
    if status == 404:
        return "not found (HTTP 404): check the repository id, the revision and the file name"
    return f"HTTP {status}"

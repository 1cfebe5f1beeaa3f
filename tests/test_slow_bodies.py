"""Bodies still arriving hold no intake slot: on a real `clef-gguf serve` with the demo model.

Connections trickling their bodies cost a connection and the bytes they sent, bounded by --max-body-readers and
--max-body-buffer; an intake slot (--max-queue) is taken only by a whole body. Each case is bounded in time.
"""

from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from cli_helpers import run_cli  # the CLI in this process
from live_server import served
from server_helpers import answer_of, open_body, post_head

from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST
from clef_gguf.testing.processes import free_port

JSON = {"content-type": "application/json"}  # what a raw body says it is (body.check_media_type)

pytestmark = pytest.mark.slow  # servers with bodies held to their timeouts

NORMAL: dict[str, Any] = json.loads(DEMO_REQUEST.read_text())


def wait_reading(url: str, count: int) -> None:
    """Until /health counts `count` bodies being read (at most 10 s)."""
    deadline = time.monotonic() + 10
    while (reading := httpx.get(f"{url}/health").json()["reading"]) != count:
        assert time.monotonic() < deadline, f"{reading} bodies being read, not {count}"
        time.sleep(0.02)


def assert_overloaded(response: httpx.Response, flag: str) -> None:
    assert response.status_code == 503 and response.headers["retry-after"] == "1", (response.status_code, response.text)
    detail = response.json()["detail"]
    assert detail["error_type"] == "overloaded_error" and flag in detail["message"], detail


def test_trickling_bodies_beyond_the_intake_slots_leave_normal_requests_answered():
    """Three times as many connections trickling their bodies as there are intake slots: every normal request is
    answered 200 (it was 503: each trickler held a slot for its whole grace period), and no trickler is refused."""
    slots, tricklers = 4, 12
    options = ["--max-queue", str(slots), "--body-grace", "30", "--body-timeout", "30"]
    with served(DEMO_MODEL, *options) as (url, _), ExitStack() as stack:
        port = int(url.rsplit(":", 1)[1])
        open_bodies = [stack.enter_context(open_body(port, 1000)) for _ in range(tricklers)]
        wait_reading(url, tricklers)  # every head read: before this change, the tricklers past the slots got 503
        statuses = []
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(10):
                statuses.append(client.post("/v1/systemone", json=NORMAL).status_code)
                for sock in open_bodies:
                    sock.sendall(b" ")  # a byte each, as tricklers do
        assert statuses == [200] * 10, statuses
        assert httpx.get(f"{url}/health").json()["reading"] == tricklers
        assert [answer_of(sock, 0.0)[0] for sock in open_bodies] == [0] * tricklers  # still reading, none refused


def test_the_body_buffer_and_the_readers_cap_refuse_new_bodies_with_a_503():
    """--max-body-buffer bounds the bytes of bodies still arriving (a body is charged what it has sent) and
    --max-body-readers how many arrive at once: past either a new body gets 503 with Retry-After naming the option,
    and a chunked body whose bytes do not fit gets it (and a closed connection) when they arrive. The slow bodies
    keep their --body-timeout; once they end, the same requests are answered."""
    buffer, readers = 100_000, 3  # --ctx 4096: a body cap of 64 KiB
    options = ["--ctx", "4096", "--max-body-buffer", str(buffer), "--max-body-readers", str(readers)]
    # The checks before the held bodies' --body-timeout took 0.2 s here: 3 s leaves them ample time on a loaded machine.
    options += ["--min-body-rate", "0", "--body-timeout", "3"]
    padded = json.dumps(NORMAL).encode() + b" " * 59_000  # JSON whitespace: a valid request of 60,000 bytes and more
    with served(DEMO_MODEL, *options) as (url, _), ExitStack() as stack:
        port = int(url.rsplit(":", 1)[1])
        held = stack.enter_context(open_body(port, 60_000, b" " * 50_000))  # half the buffer, then stalls
        wait_reading(url, 1)
        with httpx.Client(base_url=url, timeout=30) as client:
            deadline = time.monotonic() + 5
            while (refused := client.post("/v1/systemone", content=padded, headers=JSON)).status_code == 200:
                assert time.monotonic() < deadline  # (answered while the 50,000 bytes were not all read yet)
            assert_overloaded(refused, "--max-body-buffer")
            assert client.post("/v1/systemone", json=NORMAL).status_code == 200  # a small body still fits
        with socket.create_connection(("127.0.0.1", port)) as chunked:  # no declared length: refused as it arrives
            piece = b" " * 10_000
            head = post_head(extra="transfer-encoding: chunked\r\n")
            chunked.sendall(head + b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(6)))
            status, headers, body = answer_of(chunked, 5.0)
            assert status == 503 and headers["connection"] == "close", (status, body)
            assert "--max-body-buffer" in json.loads(body)["detail"]["message"]
        slow = [stack.enter_context(open_body(port, 1000)) for _ in range(readers - 1)]
        wait_reading(url, readers)
        assert_overloaded(httpx.post(f"{url}/v1/systemone", json=NORMAL, timeout=30), "--max-body-readers")
        for sock in [held, *slow]:  # --body-timeout still ends them
            assert answer_of(sock, 10.0)[0] == 408
        wait_reading(url, 0)
        assert httpx.post(f"{url}/v1/systemone", content=padded, headers=JSON, timeout=30).status_code == 200


def test_a_body_buffer_under_the_body_cap_is_refused_before_serving():
    """A --max-body-buffer no largest body fits would refuse those bodies forever: serve says so and exits 2."""
    done = run_cli("serve", DEMO_MODEL, "--port", str(free_port()), "--threads", "1", "--max-body-buffer", "64KiB", timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--max-body-buffer (65536 bytes) is under the body limit (1048576 bytes)" in done.stderr, done.stderr

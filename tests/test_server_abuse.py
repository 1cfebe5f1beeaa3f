"""`clef-gguf serve` under abuse, as an attacker would try it, on loopback: huge and slow heads, slow
bodies, compression bombs, prompts over the limit, odd Unicode, a full intake, memory after large bodies.

One real server (the demo model, one llama.cpp thread) with short timeouts so that every slow case
ends in seconds; every loop is bounded in count and in time. No bad input may get a 5xx or plain
text, and none may delay a normal request by more than 100 ms beyond its decision time.
"""

from __future__ import annotations

import gzip
import json
import select
import signal
import socket
import statistics
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from live_server import rss_bytes, served
from server_helpers import parse_answer, post_head, receive

from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST
from clef_gguf.server import body_limit

try:
    from compression.zstd import compress as zstd_compress  # Python >= 3.14
except ImportError:
    from backports.zstd import compress as zstd_compress

HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE, MAX_QUEUE = 1.0, 2.0, 1.0, 8
CTX = 65536  # serve's default context: the body cap is body_limit(CTX)
JSON = {"content-type": "application/json"}  # what a raw body says it is (body.check_media_type)
NORMAL: dict[str, Any] = json.loads(DEMO_REQUEST.read_text())


@dataclass
class Server:
    url: str
    port: int
    pid: int


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    options = ["--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT)]
    options += ["--keep-alive", str(KEEP_ALIVE), "--max-queue", str(MAX_QUEUE)]
    with served(DEMO_MODEL, *options) as (url, process):
        yield Server(url, int(url.rsplit(":", 1)[1]), process.pid)


@dataclass
class Answer:
    status: int  # 0: the connection closed without an answer
    headers: dict[str, str]
    body: bytes
    seconds: float  # from the first byte sent to the connection's end (or to the last answer awaited)


def exchange(port: int, chunks: list[bytes], pause_s: float = 0.0, limit_s: float = 20.0, answers: int | None = None) -> Answer:
    """Send `chunks` (pause_s apart) on one raw connection, reading whatever the server answers meanwhile,
    then read until the server closes (at most limit_s), or until `answers` whole answers have come where the test
    is not about closing (a kept-alive connection closes only at the keep-alive timeout). Stops sending as soon as an
    answer arrives."""
    sock = socket.create_connection(("127.0.0.1", port))
    started = time.perf_counter()
    try:
        for i, chunk in enumerate(chunks):
            if i and pause_s:
                time.sleep(pause_s)  # (between chunks: after the last, the answer is read at once)
            if select.select([sock], [], [], 0)[0]:
                break  # answered (or closed) early: what an attacker would see
            try:
                sock.sendall(chunk)
            except OSError:
                break
        received = receive(sock, started + limit_s, answers)
    finally:
        sock.close()
    status, headers, body = parse_answer(received)
    return Answer(status, headers, body, time.perf_counter() - started)


def assert_json_error(answer: Answer, status: int) -> dict[str, Any]:
    assert answer.status == status, (answer.status, answer.body[:200])
    assert answer.headers["content-type"] == "application/json" and answer.headers["connection"] == "close"
    return json.loads(answer.body)


def normal_latency(client: httpx.Client) -> tuple[float, float]:
    """One normal request: its latency and the decide time the server reports (Server-Timing)."""
    started = time.perf_counter()
    response = client.post("/v1/systemone", json=NORMAL)
    latency = time.perf_counter() - started
    assert response.status_code == 200, response.text
    metrics = response.headers["server-timing"].split(",")
    timing = dict(part.strip().split(";dur=") for part in metrics if ";dur=" in part)  # cache;desc= has no duration
    return latency, float(timing["decide"].split(";")[0]) / 1e3  # (decide;dur=...;desc="batch of N")


def excess_under(server: Server, abuse: Callable[[threading.Event], None], abusers: int, requests: int = 20) -> list[float]:
    """Seconds beyond its decision time that each of `requests` normal requests took while `abusers`
    threads ran `abuse` until told to stop."""
    stop = threading.Event()
    with httpx.Client(base_url=server.url, timeout=60) as client, ThreadPoolExecutor(abusers) as pool:
        normal_latency(client)  # a warm connection, as a normal client has
        running = [pool.submit(abuse, stop) for _ in range(abusers)]
        time.sleep(0.3)  # the abuse under way
        try:
            excess = []
            for _ in range(requests):
                latency, decide = normal_latency(client)
                excess.append(latency - decide)
        finally:
            stop.set()
        for future in running:
            future.result(timeout=60)
    return excess


# --- Heads: size, request line, slowloris, idle --------------------------------------------------------------
HEADS: dict[str, tuple[list[bytes], int]] = {
    "one 20 KiB header": ([b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-a: " + b"a" * 20_000 + b"\r\n\r\n"], 431),
    "3,000 small headers": ([b"GET /health HTTP/1.1\r\nhost: localhost\r\n" + b"x-a: b\r\n" * 3000 + b"\r\n"], 431),
    "a 64 MiB header, streamed": ([b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-a: "] + [b"a" * 65536] * 1024, 431),
    "a 9 KiB request line": ([b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nhost: localhost\r\n\r\n"], 414),
    "a 64 MiB request line, streamed": ([b"GET /"] + [b"a" * 65536] * 1024, 414),
    "not HTTP": ([b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64], 400),
    "a bad header line": ([b"GET /health HTTP/1.1\r\nhost x\r\n\r\n"], 400),
    "a header with a NUL": ([b"GET /health HTTP/1.1\r\nhost: x\x00y\r\n\r\n"], 400),
}


@pytest.mark.parametrize("name", list(HEADS))
def test_oversized_or_broken_heads_get_a_json_4xx_at_once(server, name):
    chunks, status = HEADS[name]
    answer = exchange(server.port, chunks)
    body = assert_json_error(answer, status)
    assert answer.seconds < 1.0, answer.seconds  # well before a 64 MiB head could have been sent
    assert set(body["detail"]) == {"error_type", "message"}


@pytest.mark.slow
def test_a_streamed_64_mib_header_delays_no_one(server):
    def abuse(stop: threading.Event) -> None:
        while not stop.is_set():
            exchange(server.port, HEADS["a 64 MiB header, streamed"][0])

    excess = excess_under(server, abuse, abusers=2)
    print(f"\n64 MiB headers x2: excess over decide p50 {statistics.median(excess) * 1e3:.1f} ms, max {max(excess) * 1e3:.1f} ms")
    # A loop blocked by the header's parsing delays everyone by seconds. On a loaded 2-core machine one decision
    # in a run was seen 106 ms late (median 11 to 35 ms): the bound is on the median and a generous max.
    assert statistics.median(excess) < 0.05 and max(excess) < 0.25, excess


def test_a_request_line_the_parser_refuses_is_answered_in_its_routes_shape(server):
    """Raw non-ASCII bytes in the target: httptools refuses the line before the route is known, so the shape comes
    from the bytes received: Workers AI's envelope on its paths, TypeSafe's elsewhere."""
    line = b"POST /client/v4/accounts/\xc3\xa9/ai/run/@cf/cloudflare/clef HTTP/1.1\r\nhost: localhost\r\n\r\n"
    workers_ai = exchange(server.port, [line])
    body = assert_json_error(workers_ai, 400)
    assert body["success"] is False and [e["code"] for e in body["errors"]] == [400], body
    system_one = assert_json_error(exchange(server.port, [b"POST /v1/syst\xc3\xa9mone HTTP/1.1\r\nhost: localhost\r\n\r\n"]), 400)
    assert system_one["detail"]["error_type"] == "invalid_request_error", system_one


SLOW_HEADS: dict[str, tuple[list[bytes], int]] = {
    "nothing sent": ([], 0),
    "a request line trickled": ([bytes([b]) for b in b"GET /health HTTP/1.1\r\n"], 408),
    "headers trickled forever": ([b"GET /health HTTP/1.1\r\n"] + [b"x-a: b\r\n"] * 100, 408),
    "a partial line, then silence": ([b"POST /v1/syst"], 408),
}


def test_slow_and_idle_connections_are_closed_after_the_header_timeout(server):
    """20 connections at once (5 of each kind): each ends at the header timeout, answered 408 if it sent anything."""
    cases = [name for name in SLOW_HEADS for _ in range(5)]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda name: exchange(server.port, SLOW_HEADS[name][0], pause_s=0.1), cases))
    for name, answer in zip(cases, answers, strict=True):
        status = SLOW_HEADS[name][1]
        if status:
            assert_json_error(answer, status)
        else:
            assert answer.status == 0 and answer.body == b""
        assert HEADER_TIMEOUT - 0.05 < answer.seconds < HEADER_TIMEOUT + 1.5, (name, answer.seconds)


def test_an_idle_keep_alive_connection_is_closed(server):
    request = b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n"
    answer = exchange(server.port, [request])
    assert answer.status == 200 and KEEP_ALIVE - 0.05 < answer.seconds < KEEP_ALIVE + 1.5, answer.seconds


@pytest.mark.slow
def test_slow_but_timely_requests_pipelining_and_long_decisions_are_answered(server):
    """The limits refuse only what passes them: a body sent over longer than the header timeout (but within
    the body timeout), two pipelined requests, and a decision longer than the header timeout on a
    keep-alive connection, followed by another request on it."""
    raw = json.dumps(NORMAL).encode()
    pieces = [raw[: len(raw) // 3], raw[len(raw) // 3 : 2 * len(raw) // 3], raw[2 * len(raw) // 3 :]]
    answer = exchange(server.port, [post_head(len(raw)), *pieces], pause_s=(HEADER_TIMEOUT + 0.3) / 3, answers=1)
    assert answer.status == 200, answer.body[:200]
    pipelined = exchange(server.port, [b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n" * 2], answers=2)
    assert pipelined.status == 200 and pipelined.body.count(b"HTTP/1.1 200 OK") == 1
    slow = {"state": "word " * 2500, "questions": {"q": {"type": "noul"}}}  # about 7,500 tokens: over a second here
    with httpx.Client(base_url=server.url, timeout=60) as client:
        started = time.perf_counter()
        assert client.post("/v1/systemone", json=slow).status_code == 200
        took = time.perf_counter() - started
        assert client.post("/v1/systemone", json=NORMAL).status_code == 200
    print(f"\na decision of {took:.2f} s on a keep-alive connection, then another request: answered")


# --- Bodies: slowloris, early answers, compression bombs, prompts over the limit --------------------------------
@pytest.mark.slow
def test_a_body_still_coming_after_an_early_answer_is_dropped_until_the_body_timeout(server):
    """A 413 (declared length over the cap) is answered at once; the rest of the body is read and dropped
    (closing at once would reset the answer away) until the body timeout, then the connection closes."""
    declared = body_limit(CTX) + 1
    sock = socket.create_connection(("127.0.0.1", server.port))
    started = time.perf_counter()
    try:
        sock.sendall(post_head(declared))
        first = sock.recv(65536)
        assert parse_answer(first)[0] == 413 and time.perf_counter() - started < 0.5
        closed_after = None
        while time.perf_counter() - started < BODY_TIMEOUT + 3:  # keep trickling, as a slowloris would
            try:
                sock.sendall(b" " * 100)
            except OSError:
                closed_after = time.perf_counter() - started
                break
            if select.select([sock], [], [], 0.1)[0] and sock.recv(65536) == b"":
                closed_after = time.perf_counter() - started
                break
    finally:
        sock.close()
    assert closed_after is not None and BODY_TIMEOUT - 0.05 < closed_after < BODY_TIMEOUT + 1.5, closed_after


def _valid_json_of(size: int) -> bytes:
    """A valid System One request of about `size` bytes: one long string state."""
    return json.dumps({"state": "x" * size, "questions": {"q": {"type": "noul"}}}).encode()


ENCODERS: dict[str, Callable[[bytes], bytes]] = {"zstd": zstd_compress, "gzip": gzip.compress, "deflate": zlib.compress}


@pytest.mark.parametrize("coding", [*ENCODERS, "gzip, gzip", "zstd, zstd"])
def test_a_16_mib_compressed_body_is_refused_in_under_100_ms(server, coding):
    raw = _valid_json_of(16 << 20)
    for step in [c.strip() for c in coding.split(",")]:
        raw = ENCODERS[step](raw)
    assert len(raw) < 64 << 10
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.get("/health")  # connected: the time below is the server's
        times = []
        for _ in range(5):
            started = time.perf_counter()
            response = client.post("/v1/systemone", content=raw, headers={"content-encoding": coding, **JSON})
            times.append(time.perf_counter() - started)
            assert response.status_code == 413 and response.json()["detail"]["error_type"] == "request_too_large"
    print(f"\n16 MiB {coding} body ({len(raw)} bytes): 413 in max {max(times) * 1e3:.1f} ms")
    assert max(times) < 0.1, times


def _over_the_token_limit() -> bytes:
    """The largest body under the cap whose prompt is over the limit: the costliest refusal there is."""
    words = (body_limit(CTX) - 100) // 5
    return json.dumps({"state": "word " * words, "questions": {"q": {"type": "noul"}}}).encode()


@pytest.mark.slow
def test_prompts_over_the_limit_are_refused_without_delaying_a_normal_request(server):
    over = zstd_compress(_over_the_token_limit())
    bomb = zstd_compress(_valid_json_of(16 << 20))

    def abuse(stop: threading.Event) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            while not stop.is_set():
                for raw in (over, bomb):
                    response = client.post("/v1/systemone", content=raw, headers={"content-encoding": "zstd", **JSON})
                    assert response.status_code == 413, response.text

    excess = excess_under(server, abuse, abusers=4)
    p50, worst = statistics.median(excess) * 1e3, max(excess) * 1e3
    print(f"\nprompts over the limit + bombs x4: excess over decide p50 {p50:.1f} ms, max {worst:.1f} ms")
    assert max(excess) < 0.1, excess


@pytest.mark.slow
def test_uploads_in_progress_hold_no_intake_slot(server):
    """MAX_QUEUE slow uploads take no intake slot (one is taken once a body is whole): one more request is
    answered at once, not refused. Their own cap is --max-body-readers (tests/test_slow_bodies.py). Each trickled
    body gets a JSON 408 at the body timeout."""
    with ThreadPoolExecutor(MAX_QUEUE) as pool:
        slow = [pool.submit(exchange, server.port, [post_head(1000)] + [b" "] * 40, 0.1) for _ in range(MAX_QUEUE)]
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health").json()["reading"] < MAX_QUEUE:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        started = time.perf_counter()
        answered = httpx.post(f"{server.url}/v1/systemone", json=NORMAL, timeout=60)
        assert time.perf_counter() - started < 0.5
        assert answered.status_code == 200, answered.text
        for future in slow:
            trickled = future.result(timeout=30)
            assert_json_error(trickled, 408)
            assert BODY_TIMEOUT - 0.05 < trickled.seconds < BODY_TIMEOUT + 1.5, trickled.seconds
    assert httpx.post(f"{server.url}/v1/systemone", json=NORMAL, timeout=60).status_code == 200


@pytest.mark.slow
def test_memory_returns_to_its_baseline_after_large_bodies(server):
    over = _over_the_token_limit()
    large_valid = json.dumps({**NORMAL, "padding": "p" * (body_limit(CTX) - 10_000)}).encode()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(3):  # warm-up: allocator pools, first-call caches
            client.post("/v1/systemone", content=over, headers=JSON)
            client.post("/v1/systemone", content=large_valid, headers=JSON)
        baseline = rss_bytes(server.pid)
        peak = baseline
        for _ in range(10):
            assert client.post("/v1/systemone", content=over, headers=JSON).status_code == 413
            assert client.post("/v1/systemone", content=large_valid, headers=JSON).status_code == 200
            peak = max(peak, rss_bytes(server.pid))
        after = rss_bytes(server.pid)
    mib = 1 << 20
    print(f"\nRSS baseline {baseline / mib:.1f} MiB, peak {peak / mib:.1f} MiB, after 20 bodies of 1 MiB {after / mib:.1f} MiB")
    assert after - baseline < 8 * mib, (baseline, after)


# --- Unicode: every user error a 4xx with JSON ------------------------------------------------------------------
def _noul(qid: str = "q") -> str:
    return f'"questions": {{"{qid}": {{"type": "noul"}}}}'


UNICODE: dict[str, tuple[bytes, int, list[Any] | None]] = {
    "a surrogate in a question id": (('{"state": "s", ' + _noul("\\ud800") + "}").encode(), 422, ["body", "questions", "\ud800"]),
    "a surrogate in an option name": (
        b'{"state": "s", "questions": {"q": {"type": "choice", "criteria": {"\\udfff": null, "b": null}}}}',
        422,
        ["body", "questions", "q", "criteria", "\udfff"],
    ),
    "a surrogate in a state key": (('{"state": {"\\ud800": 1}, ' + _noul() + "}").encode(), 422, ["body", "state", "\ud800"]),
    "a surrogate in a state value": (('{"state": ["\\udc00x"], ' + _noul() + "}").encode(), 422, ["body", "state", 0]),
    "a surrogate in the model": (('{"model": "\\ud83d", "state": "s", ' + _noul() + "}").encode(), 422, ["body", "model"]),
    "a surrogate in an unknown field": (('{"x\\ud800": 1, "state": "s", ' + _noul() + "}").encode(), 422, ["body", "x\ud800"]),
    "a surrogate pair (valid)": (('{"state": "\\ud83d\\ude42", ' + _noul("\\ud83d\\ude42") + "}").encode(), 200, None),
    "a CESU-8 surrogate": (b'{"state": "\xed\xa0\x80", ' + _noul().encode() + b"}", 422, ["body", 11]),
    "an overlong UTF-8 slash": (b'{"state": "\xc0\xaf", ' + _noul().encode() + b"}", 422, ["body", 11]),
    "a UTF-8 BOM": (b"\xef\xbb\xbf{" + b'"state": "s", ' + _noul().encode() + b"}", 422, ["body", 0]),
    "NUL and noncharacters": (('{"state": "\\u0000\\uffff\\ufffe", ' + _noul("\\u0000") + "}").encode(), 200, None),
    "UTF-16 body": (('{"state": "s", ' + _noul() + "}").encode("utf-16"), 422, ["body", 0]),
}


@pytest.mark.parametrize("name", list(UNICODE))
@pytest.mark.parametrize("route", ["/v1/systemone", "/accounts/a/ai/run/@cf/cloudflare/clef"])
def test_any_unicode_gets_an_answer_or_a_422_naming_the_field(server, name, route):
    raw, status, loc = UNICODE[name]
    response = httpx.post(server.url + route, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()  # valid JSON, whatever was sent
    if status == 422 and route == "/v1/systemone":
        [problem] = body["detail"]
        assert problem["loc"] == loc
    elif status == 422:
        assert body["success"] is False and body["errors"][0]["code"] == 422


ODD_TARGETS = ["/v1/%ff", "/v1/%ed%a0%80", "/accounts/%ff/ai/run/@cf/cloudflare/%ed%a0%80", "/v1/systemone?x=%ff%00", "/%"]


@pytest.mark.parametrize("target", ODD_TARGETS)
def test_odd_request_targets_get_a_json_4xx(server, target):
    head = f"POST {target} HTTP/1.1\r\nhost: localhost\r\ncontent-length: 2\r\n\r\n{{}}"
    answer = exchange(server.port, [head.encode()], limit_s=3, answers=1)
    assert 400 <= answer.status < 500, answer
    assert answer.headers["content-type"] == "application/json"
    json.loads(answer.body)


# --- Drain: requests cut off at SIGTERM --------------------------------------------------------------------------
@pytest.mark.slow
def test_requests_cut_off_by_the_drain_timeout_get_a_json_503(tmp_path):
    """SIGTERM with --drain-timeout 1 and several seconds of decisions queued: those finished in time are
    answered, the others get a JSON 503 with Retry-After (never uvicorn's plain-text 500), and serve exits 128+15."""

    def slow(i: int) -> dict:  # about 4,500 tokens on the demo vocabulary, a state of its own: no state cache hit
        return {"state": f"Request {i}: " + "word " * 1500, "questions": {"q": {"type": "noul"}}}

    with served(DEMO_MODEL, "--drain-timeout", "1") as (url, process):
        with httpx.Client(base_url=url, timeout=60) as client:
            started = time.perf_counter()
            assert client.post("/v1/systemone", json=slow(-1)).status_code == 200
            one = time.perf_counter() - started
        count = min(16, max(4, int(3 / one) + 1))  # about 3 s of decisions: 1 s of drain cuts most of them off
        with ThreadPoolExecutor(count) as pool, httpx.Client(base_url=url, timeout=60) as client:
            queued = [pool.submit(httpx.post, f"{url}/v1/systemone", json=slow(i), timeout=60) for i in range(count)]
            deadline = time.monotonic() + 30
            while client.get("/health").json()["pending"] < count:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            process.send_signal(signal.SIGTERM)
            responses = [future.result() for future in queued]
        _, stderr = process.communicate(timeout=60)
    statuses = sorted(r.status_code for r in responses)
    print(f"\ndrain 1 s over {count} requests of {one * 1e3:.0f} ms: statuses {statuses}")
    assert set(statuses) <= {200, 503} and 503 in statuses, statuses
    for response in responses:
        if response.status_code == 503:
            assert response.headers["content-type"] == "application/json" and response.headers["retry-after"] == "1"
            assert response.json()["detail"]["error_type"] == "overloaded_error"
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr and "Exception in ASGI application" not in stderr, stderr


@pytest.mark.slow
def test_bodies_under_the_minimum_rate_cannot_lock_others_out():
    """Every intake slot taken by a connection trickling its body a byte at a time (a lock-out: 503 for
    everyone until the body timeout): each gets 408 once the grace period has passed, a normal client is answered
    within about that time, and an honest slow client (1 KiB/s, over the grace period) still passes."""
    grace, rate, slots = 1.0, 240.0, 4
    options = ["--body-timeout", "30", "--body-grace", str(grace), "--min-body-rate", str(rate), "--max-queue", str(slots)]
    with served(DEMO_MODEL, *options) as (url, process):
        port = int(url.rsplit(":", 1)[1])
        started = time.perf_counter()
        with ThreadPoolExecutor(slots) as pool:
            trickled = [pool.submit(exchange, port, [post_head(500)] + [b" "] * 60, 0.5) for _ in range(slots)]
            time.sleep(0.3)  # every slot is taken now
            answered_at = None
            with httpx.Client(base_url=url, timeout=30) as client:
                while time.perf_counter() - started < 10:
                    if client.post("/v1/systemone", json=NORMAL).status_code == 200:
                        answered_at = time.perf_counter() - started
                        break
                    time.sleep(0.1)
            answers = [f.result() for f in trickled]
        for answer in answers:
            detail = assert_json_error(answer, 408)["detail"]
            assert "under this server's minimum of 240" in detail["message"]
            assert grace - 0.05 < answer.seconds < grace + 1.5, answer.seconds
        assert answered_at is not None and answered_at < grace + 2.0, answered_at
        raw = json.dumps({**NORMAL, "state": "x" * 2000}).encode()
        pieces = [raw[i : i + 256] for i in range(0, len(raw), 256)]
        sending = 0.25 * len(pieces)  # 1 KiB/s: past the grace period
        honest = exchange(port, [post_head(len(raw)), *pieces], 0.25, answers=1)
        assert honest.status == 200 and sending > grace, honest.status
        print(
            f"\n{slots} trickling bodies: 408 after {max(a.seconds for a in answers):.2f} s; a normal request answered "
            f"after {answered_at:.2f} s; a 1 KiB/s body of {len(raw)} bytes sent over {sending:.2f} s: 200"
        )

"""`clef-gguf serve`: the real server (uvicorn on 127.0.0.1) spoken to over HTTP, by httpx and by the
official typesafe-sdk client, against TypeSafe's System One contract."""

from __future__ import annotations

import copy
import gzip
import json
import math
import os
import signal
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import httpx
import httpx2
import numpy as np
import pytest
import typesafe_sdk as ts
from cli_helpers import run_cli  # the CLI in this process
from live_server import free_port, rss_bytes, serve_process, wait_healthy
from server_helpers import MALFORMED, TIMEOUT, WORKERS_AI_PATHS, BlockingModel, Live, reuse_apart, start, with_change

import clef_gguf
from clef_gguf.errors import ModelFileError
from clef_gguf.runtime.reader import MAX_REQUEST_NESTING
from clef_gguf.server import create_app
from clef_gguf.server.body import DECODERS
from clef_gguf.testing.request_suite import all_requests, long_state_request, mixed_request, within

Request = dict[str, Any]
JSON = {"content-type": "application/json"}  # what a raw body says it is (body.check_media_type)


# --- A live server in this process (for the contract), or a `clef-gguf serve` subprocess ---------------------
@pytest.fixture(scope="module")
def model(ws):
    return ws.model("untied_f32", "f32")


@pytest.fixture(scope="module")
def live(model) -> Iterator[Live]:
    server = start(create_app(model, owns_model=False, max_body_bytes=1 << 20))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def expected(model) -> Callable[[Request], dict[str, Any]]:
    """What a direct decide() answers: the server must answer exactly that (reuse_apart: whatever the cache reused)."""
    memo: dict[str, dict[str, Any]] = {}

    def decide(request: Request) -> dict[str, Any]:
        key = json.dumps(request, sort_keys=False)
        if key not in memo:
            memo[key] = reuse_apart(model.decide(copy.deepcopy(request)))
        return memo[key]

    return decide


# --- The response contract -----------------------------------------------------------------------------------
def choice_confidence(p: list[float]) -> float:
    """TypeSafe's documented choice confidence: (p_max - 1/n) / (1 - 1/n)."""
    n = len(p)
    return (max(p) - 1 / n) / (1 - 1 / n)


def score_confidence(p: list[float]) -> float:
    """TypeSafe's documented score confidence: 1 - sum p_i |i - mode| / the same for a uniform distribution."""
    n = len(p)
    mode = max(range(n), key=p.__getitem__)
    return 1 - sum(p[i] * abs(i - mode) for i in range(n)) / (sum(abs(i - (n - 1) / 2) for i in range(n)) / n)


def test_the_confidence_formulas_give_typesafe_documented_figures():
    assert math.isclose(choice_confidence([0.07, 0.01, 0.92]), 0.88, abs_tol=0.005)
    assert math.isclose(score_confidence([0.16, 0.10, 0.75]), 0.37, abs_tol=0.01)


def _no_constants(name: str) -> Any:
    raise AssertionError(f"{name} in a response")


def check_contract(request: Request, response: httpx.Response) -> dict[str, Any]:
    """Every rule a System One response obeys, checked on the raw HTTP response."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    body = json.loads(response.content, parse_constant=_no_constants)  # no NaN, no Infinity
    assert {"model", "answers", "usage"} <= set(body) and all(
        k.startswith("x_") for k in set(body) - {"model", "answers", "usage"}
    )
    assert isinstance(body["model"], str)
    assert body["usage"]["output_tokens"] == 0 and body["usage"]["input_tokens"] > 0
    questions = request["questions"]
    assert list(body["answers"]) == list(questions)  # exactly one answer per question id, in order
    for qid, question in questions.items():
        answer = body["answers"][qid]
        assert answer["type"] == question["type"]
        # Non-ASCII ids and option names come back byte for byte (UTF-8, not escaped, not normalized).
        assert json.dumps(qid, ensure_ascii=False).encode() in response.content
        if question["type"] == "noul":
            assert set(answer) == {"type", "noul"} and 0 <= answer["noul"] <= 1
            continue
        p = answer["probabilities"]
        n = len(question["criteria"])
        tolerance = n * 5e-5 + 1e-9  # each probability is rounded to 4 decimals
        assert abs(sum(p.values()) - 1) <= tolerance and all(0 <= v <= 1 for v in p.values())
        if question["type"] == "choice":
            assert list(p) == list(question["criteria"])
            for name in question["criteria"]:
                assert json.dumps(name, ensure_ascii=False).encode() in response.content
            assert p[answer["choice"]] == max(p.values())
            expected_confidence = choice_confidence(list(p.values()))
        else:
            levels = [str(i) for i in range(n)]
            assert list(p) == levels and answer["legend"] == dict(zip(levels, question["criteria"], strict=True))
            assert abs(answer["score"] - sum(i * p[level] for i, level in enumerate(levels))) <= n * tolerance
            expected_confidence = score_confidence(list(p.values()))
        assert 0 <= answer["confidence"] <= 1
        assert abs(answer["confidence"] - min(max(expected_confidence, 0), 1)) <= 4 * n * tolerance
    return reuse_apart(body)


@pytest.mark.parametrize("name", list(all_requests()))
@pytest.mark.slow
def test_every_suite_request_is_answered_as_a_direct_decide(client, expected, name):
    request = all_requests()[name]
    response = client.post("/v1/systemone", json=request)
    assert check_contract(request, response) == expected(request)
    assert len(response.headers["x-typesafe-request-id"]) == 32


def _question(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


ACCEPTED: dict[str, Request] = {
    "jev-latest": {"model": "jev-latest", "state": "s", "questions": {"q": _question("noul")}},
    "any model name": {"model": "gpt-5 / whatever", "state": "s", "questions": {"q": _question("noul")}},
    "state an array": {"model": "m", "state": [1, {"a": None}, "x"], "questions": {"q": _question("noul")}},
    "instructions an object, an array, null": {
        "model": "m",
        "state": {"t": "x"},
        "questions": {
            "a": _question("noul", instructions={"k": [1, 2]}),
            "b": _question("noul", instructions=["one", 2]),
            "c": _question("noul", instructions=None),
        },
    },
    "noul criteria absent, null, one-sided, two-sided": {
        "model": "m",
        "state": "s",
        "questions": {
            "absent": _question("noul", instructions="?"),
            "null": _question("noul", instructions="?", criteria=None),
            "true only": _question("noul", criteria={"true": "yes"}),
            "false only": _question("noul", criteria={"false": {"no": True}}),
            "both": _question("noul", criteria={"true": ["y"], "false": None}),
        },
    },
    "choice descriptions of every shape and non-ASCII names": {
        "model": "m",
        "state": "s",
        "questions": {
            "ünïcødé id.with.dots": _question(
                "choice",
                criteria={"cafe\u0301": None, "café": "NFC", "🙂": {"tone": 1}, "名前": ["a"], "a.b": "dots"},
            )
        },
    },
    "choice with 2 options, score with 2 and 10 levels": {
        "model": "m",
        "state": "s",
        "questions": {
            "c": _question("choice", criteria={"yes": None, "no": None}),
            "s2": _question("score", criteria=["low", {"level": "high"}]),
            "s10": _question("score", criteria=[f"level {i}" for i in range(10)]),
        },
    },
    "choice with 255 options": {
        "model": "m",
        "state": "s",
        "questions": {"c": _question("choice", criteria={f"label {i:03d}": None for i in range(255)})},
    },
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_every_documented_request_shape_is_accepted(client, expected, name):
    request = ACCEPTED[name]
    raw = json.dumps(request, ensure_ascii=False).encode()  # UTF-8 on the wire, as clients send it
    response = client.post("/v1/systemone", content=raw, headers={"content-type": "application/json"})
    assert check_contract(request, response) == expected(request)


def test_unknown_fields_are_ignored_and_the_authorization_header_too(client, expected):
    request = mixed_request()
    noisy = {**request, "temperature": 0.2, "metadata": {"trace": [1, 2]}, "stream": False}
    response = client.post("/v1/systemone", json=noisy, headers={"Authorization": "Bearer sk-anything"})
    assert check_contract(request, response) == expected(request)


# --- Errors --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_request_gets_422_with_the_location(client, name):
    body, loc = MALFORMED[name]
    raw = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    response = client.post("/v1/systemone", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/json"
    [problem] = response.json()["detail"]
    assert problem["loc"] == loc and isinstance(problem["msg"], str) and problem["msg"]
    assert problem["type"] in {"json_invalid", "missing", "value_error", "string_unicode"}


def _nested(depth: int) -> bytes:
    return b'{"state": ' + b"[" * depth + b"]" * depth + b', "questions": {"q": {"type": "noul"}}}'


# What the one strict reader (runtime/reader.py) decides of a request's bytes, whoever reads them.
STRICT: dict[str, tuple[bytes, bool]] = {  # the bytes, and whether they are read
    "NaN": (b'{"state": NaN, "questions": {"q": {"type": "noul"}}}', False),
    "-Infinity": (b'{"state": [-Infinity], "questions": {"q": {"type": "noul"}}}', False),
    "NaN as text": (b'{"state": "NaN", "questions": {"q": {"type": "noul"}}}', True),
    "not UTF-8": (b'{"state": "caf\xe9", "questions": {"q": {"type": "noul"}}}', False),
    "a lone surrogate in a key": (b'{"state": {"k\\ud800": 1}, "questions": {"q": {"type": "noul"}}}', False),
    "a huge integer": (b'{"state": ' + b"9" * 5000 + b', "questions": {"q": {"type": "noul"}}}', False),
    "nesting at the limit": (_nested(MAX_REQUEST_NESTING), True),  # the innermost array is at depth 256
    "nesting past the limit": (_nested(MAX_REQUEST_NESTING + 1), False),
    "nesting past Python's recursion limit": (_nested(5000), False),
}


def test_a_byte_order_mark_starts_a_file_never_a_body(client, tmp_path):
    """The one exception to the same rules: a file may start with a UTF-8 BOM (Windows editors write one), which every
    file reader skips (runtime/reader.py); a JSON text sent over HTTP must not (RFC 8259, 8.1), and is refused."""
    raw = b'\xef\xbb\xbf{"state": "s", "questions": {"q": {"type": "noul"}}}'
    response = client.post("/v1/systemone", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["detail"][0]["type"] == "json_invalid"
    (tmp_path / "request.json").write_bytes(raw)
    run = run_cli("decide", tmp_path / "request.json")
    assert run.returncode == 0 and json.loads(run.stdout)["answers"]["q"]["noul"] >= 0, run.stderr[-2000:]


@pytest.mark.parametrize("name", list(STRICT))
def test_the_server_and_the_cli_read_a_request_by_the_same_rules(client, name, tmp_path):
    """The server's 422 and `clef-gguf decide`'s exit 2 for the same bytes, with the same message; or both answer."""
    raw, read = STRICT[name]
    response = client.post("/v1/systemone", content=raw, headers={"content-type": "application/json"})
    (tmp_path / "request.json").write_bytes(raw)
    run = run_cli("decide", tmp_path / "request.json")  # the demo model: a request the reader refuses is refused before a load
    stderr = run.stderr
    if read:
        assert response.status_code == 200 and run.returncode == 0, (response.text, stderr[-2000:])
        return
    assert response.status_code == 422 and run.returncode == 2, (response.text, stderr[-2000:])
    [problem] = response.json()["detail"]
    assert problem["type"] in {"json_invalid", "string_unicode"}
    assert stderr.startswith("error: ") and stderr.rstrip("\n").endswith(problem["msg"].encode("unicode_escape").decode()), stderr


def _api_error(response: httpx.Response, status: int, error_type: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    detail = response.json()["detail"]
    assert set(detail) == {"error_type", "message"} and detail["error_type"] == error_type
    return detail["message"]


def test_a_prompt_over_the_limit_gets_413_naming_its_size_and_the_limit(client, model):
    request = long_state_request(paragraphs=50)
    n_tokens = len(model.encode(request).tokens)
    assert n_tokens > model.max_prompt_tokens
    message = _api_error(client.post("/v1/systemone", json=request), 413, "prompt_too_long")
    assert f"{n_tokens} tokens" in message and f"limit of {model.max_prompt_tokens} tokens" in message


def test_compressed_bodies_are_read_and_bad_ones_are_4xx(client, expected):
    request = mixed_request()
    raw = json.dumps(request).encode()
    encoders: dict[str, Callable[[bytes], bytes]] = {"gzip": gzip.compress, "deflate": zlib.compress}
    if "zstd" in DECODERS:
        try:
            from compression.zstd import compress as zstd_compress  # Python >= 3.14
        except ImportError:
            from backports.zstd import compress as zstd_compress
        encoders["zstd"] = zstd_compress
    assert "zstd" in encoders, "typesafe-sdk sends zstd bodies when zstd is importable: the server must read them"
    for coding, encode in encoders.items():
        response = client.post("/v1/systemone", content=encode(raw), headers={"content-encoding": coding, **JSON})
        assert check_contract(request, response) == expected(request), coding
    brotli = client.post("/v1/systemone", content=raw, headers={"content-encoding": "br", **JSON})
    _api_error(brotli, 415, "invalid_request_error")
    corrupt = client.post("/v1/systemone", content=b"\x28\xb5\x2f\xfdgarbage", headers={"content-encoding": "zstd", **JSON})
    assert corrupt.status_code == 422 and corrupt.json()["detail"][0]["loc"] == ["body"]
    bomb = gzip.compress(b" " * (2 << 20))  # 2 KiB that inflate past the 1 MiB limit of this server
    _api_error(client.post("/v1/systemone", content=bomb, headers={"content-encoding": "gzip", **JSON}), 413, "request_too_large")
    _api_error(client.post("/v1/systemone", content=b" " * (1 << 20) + b" ", headers=JSON), 413, "request_too_large")
    multipart = {"content-type": "multipart/form-data; boundary=x"}
    empty = client.post("/v1/systemone", content=b"--x--\r\n", headers=multipart)  # typesafe-sdk's form, with no parts
    assert empty.status_code == 422 and empty.json()["detail"][0]["loc"] == ["body"], empty.text
    mixed = {"content-type": "multipart/mixed; boundary=x"}
    _api_error(client.post("/v1/systemone", content=b"--x--\r\n", headers=mixed), 415, "invalid_request_error")


# --- The Workers AI route: the same answers in Cloudflare's envelope ---------------------------------------------
def _envelope_error(response: httpx.Response, status: int, code: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["success"] is False and body["result"] is None and body["messages"] == []
    [error] = body["errors"]
    assert error["code"] == code and isinstance(error["message"], str) and error["message"]
    return error["message"]


@pytest.mark.parametrize("path", WORKERS_AI_PATHS)
def test_the_workers_ai_route_wraps_the_systemone_answer_in_the_envelope(client, expected, path):
    request = {**mixed_request(), "model": "clef-flash"}  # the body model field Workers AI clients send
    response = client.post(path, json=request, headers={"Authorization": "Bearer cf-api-token"})
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    envelope = response.json()
    assert {**envelope, "result": reuse_apart(envelope["result"])} == {
        "result": expected(request),
        "success": True,
        "errors": [],
        "messages": [],
    }
    direct = client.post("/v1/systemone", json=request)
    assert response.content == b'{"result":' + direct.content + b',"success":true,"errors":[],"messages":[]}'
    assert len(response.headers["x-typesafe-request-id"]) == 32 and "decide;dur=" in response.headers["server-timing"]


def test_server_timing_and_usage_say_how_many_prompt_tokens_the_state_cache_reused(client, model):
    state = "A state this test alone sends. " + long_state_request(paragraphs=2)["state"]
    first = {**mixed_request(), "state": state}
    second = {**long_state_request(), "state": state}  # the same state, another schema
    prefix, preamble = model.encode(first).state_prefix, model.encode(first).preamble
    miss, hit = client.post("/v1/systemone", json=first), client.post("/v1/systemone", json=second)
    # The state is new: only the template's preamble comes from the cache.
    assert miss.headers["server-timing"].endswith(f', cache;desc="hit {preamble} tokens"')
    assert hit.headers["server-timing"].endswith(f', cache;desc="hit {prefix} tokens"')
    assert miss.json()["usage"]["input_tokens_details"] == {"cached_tokens": preamble}
    usage = hit.json()["usage"]
    assert usage["input_tokens_details"] == {"cached_tokens": prefix}
    assert usage["input_tokens"] == len(model.encode(second).tokens)  # still every prompt token
    # The answers are the cache's own business: a direct decide of the same request, on a cold cache, answers the same.
    with clef_gguf.load(model.path, max_prompt_tokens=model.max_prompt_tokens, ubatch=model.ubatch) as cold:
        assert cold.decide(second)["answers"] == hit.json()["answers"]


def test_workers_ai_errors_keep_their_status_in_the_envelope(client):
    path = WORKERS_AI_PATHS[-1]
    unknown = client.post("/client/v4/accounts/a/ai/run/@cf/meta/llama-3.1-8b-instruct", json=mixed_request())
    assert "@cf/meta/llama-3.1-8b-instruct" in _envelope_error(unknown, 400, 5007)
    null_level = with_change(lambda r: r["questions"]["severity"].update(criteria=["a", None]))
    assert _envelope_error(client.post(path, json=null_level), 422, 422).startswith("body.questions.severity.criteria.1: ")
    assert _envelope_error(client.post(path, content=b"{", headers=JSON), 422, 422).startswith("body.1: JSON decode error")
    too_long = _envelope_error(client.post(path, json=long_state_request(paragraphs=50)), 413, 3006)
    assert "tokens" in too_long
    _envelope_error(client.post(path, content=b" " * (1 << 20) + b" ", headers=JSON), 413, 3006)
    _envelope_error(client.get(path), 405, 405)


@pytest.mark.parametrize(
    "path",
    [
        "/accounts//ai/run/@cf/cloudflare/clef",  # an empty account id
        "/client/v4/accounts/a%2Fb/ai/run/@cf/cloudflare/clef",  # a slash in it
        "/client/v4//accounts/a/ai/run/@cf/cloudflare/clef",  # a doubled slash
        "/accounts/a//ai/run/@cf/cloudflare/clef",
        "/client/v4/accounts/a/ai/models",  # a route this server does not have
    ],
)
def test_workers_ai_paths_no_route_matches_get_the_envelope(client, path):
    message = _envelope_error(client.post(path, json=mixed_request()), 404, 404)
    assert "/v1/systemone" in message and "/accounts/ACCOUNT_ID/ai/run/@cf/cloudflare/clef" in message


def test_unknown_routes_and_methods_get_the_error_shape(client):
    _api_error(client.get("/v1/nothing"), 404, "not_found_error")
    _api_error(client.get("/v1/systemone"), 405, "invalid_request_error")


def test_models_and_health(client, model):
    listed = client.get("/v1/models").json()["models"]
    assert [m["name"] for m in listed] == [model.name, "jev-latest"]
    assert all(len(m["release_date"]) == 10 and m["description"] for m in listed)
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["model"] == model.name and health["max_prompt_tokens"] == model.max_prompt_tokens


def test_an_api_key_is_required_when_set(model):
    live = start(create_app(model, owns_model=False, api_key="s3cret"))
    try:
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
            request = mixed_request()
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "Basic s3cret"},
                {"Authorization": "s3cret"},
            ):
                response = c.post("/v1/systemone", json=request, headers=headers)
                _api_error(response, 401, "authentication_error")
                assert response.headers["www-authenticate"] == "Bearer"
            _api_error(c.get("/v1/models"), 401, "authentication_error")
            # The key is checked before the body is read: a malformed body without a key is still a 401.
            _api_error(c.post("/v1/systemone", content=b"{"), 401, "authentication_error")
            assert c.post("/v1/systemone", json=request, headers={"Authorization": "Bearer s3cret"}).status_code == 200
            workers = WORKERS_AI_PATHS[0]
            refused = c.post(workers, json=request, headers={"Authorization": "Bearer wrong"})
            assert "Bearer" in _envelope_error(refused, 401, 401) and refused.headers["www-authenticate"] == "Bearer"
            assert c.post(workers, json=request, headers={"Authorization": "Bearer s3cret"}).json()["success"] is True
            assert c.get("/health").status_code == 200  # liveness probes carry no key
            sdk = ts.TypeSafeClient(base_url=live.url, api_key="wrong", retry=ts.RetryPolicy(max_retries=0))
            with sdk, pytest.raises(ts.TypeSafeAuthenticationError):
                sdk.system_one(state="s", questions={"q": ts.Noul(instructions="?")})
    finally:
        live.stop()


# --- Concurrency ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_16_concurrent_clients_get_the_sequential_answers(live, expected):
    """Concurrent requests are decided in batches (tests/test_batching.py): the answers alone, within float noise,
    which the responses' 4 decimals show as at most a step of the last one."""
    suite = all_requests()
    requests = [suite["mixed"], suite["ten_level_score"], *(r for name, r in ACCEPTED.items() if "255" not in name)]
    sequential = [expected(r) for r in requests]
    per_client = 4  # 16 clients x 4 requests, every request sent by 8 clients, in a rotating order

    def client_run(offset: int) -> list[tuple[int, int, Any]]:
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
            order = [(offset + k) % len(requests) for k in range(per_client)]
            return [(i, (r := c.post("/v1/systemone", json=requests[i])).status_code, r.json()) for i in order]

    with ThreadPoolExecutor(16) as pool:
        results = [item for run in pool.map(client_run, range(16)) for item in run]
    assert len(results) == 16 * per_client
    for i, status, body in results:
        assert status == 200 and within(reuse_apart(body), sequential[i], 1e-4 + 1e-9)


def test_a_full_queue_gets_503_and_a_bad_request_never_waits(model, expected):
    blocking = BlockingModel(model)
    live = start(create_app(blocking, max_queue=2))
    request = ACCEPTED["jev-latest"]
    try:
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c, ThreadPoolExecutor(2) as pool:
            held = [pool.submit(httpx.post, f"{live.url}/v1/systemone", json=request, timeout=TIMEOUT) for _ in range(2)]
            deadline = time.monotonic() + 30
            while c.get("/health").json()["pending"] < 2:  # /health answers while decide is busy
                assert time.monotonic() < deadline
                time.sleep(0.01)
            busy = c.post("/v1/systemone", json=request)
            _api_error(busy, 503, "overloaded_error")
            assert busy.headers["retry-after"] == "1"
            busy = c.post(WORKERS_AI_PATHS[0], json=request)
            assert "retry" in _envelope_error(busy, 503, 503) and busy.headers["retry-after"] == "1"
            assert c.post("/v1/systemone", json={"state": "s"}).status_code == 422  # validated before admission
            blocking.release.set()
            assert [reuse_apart(f.result().json()) for f in held] == [expected(request)] * 2
    finally:
        blocking.release.set()
        live.stop()


# --- The official client -------------------------------------------------------------------------------------
def test_the_typesafe_sdk_client_parses_every_answer_type(live, expected, model):
    questions = {
        "spam": ts.Noul(instructions="Is this spam?", criteria={"true": "Unsolicited"}),
        "tone ✓": ts.Choice(instructions={"ask": "tone"}, criteria={"calm": None, "ängry": "upset", "🙂": ["happy"]}),
        "urgency": ts.Score(instructions="How urgent?", criteria=["low", "medium", {"level": "high"}]),
    }
    state = {"message": "Refund me now, the café order was wrong! " * 40}  # > 1 KiB: the SDK compresses it
    sent: list[httpx2.Request] = []

    def capturing() -> httpx2.Client:
        return httpx2.Client(timeout=120, event_hooks={"request": [sent.append]})

    no_retry = ts.RetryPolicy(max_retries=0)
    clients = (  # first uncompressed, to read the body; then zstd, as the SDK sends by default when zstd is importable
        ts.TypeSafeClient(base_url=live.url, api_key="local", retry=no_retry, http_client=capturing(), compression=False),
        ts.TypeSafeClient(base_url=live.url, api_key="local", retry=no_retry, http_client=capturing()),
    )
    for sdk in clients:
        with sdk:
            got = sdk.system_one(state=state, questions=questions)
            want = expected(json.loads(sent[0].content))  # the body the SDK put on the wire, answered directly
            assert got.model == "jev-latest" and got.usage.input_tokens == want["usage"]["input_tokens"]
            assert got.nouls["spam"].noul == want["answers"]["spam"]["noul"]
            choice = got.choices["tone ✓"]
            assert choice.choice == want["answers"]["tone ✓"]["choice"]
            assert choice.probabilities == want["answers"]["tone ✓"]["probabilities"]
            assert choice.confidence == want["answers"]["tone ✓"]["confidence"]
            score = got.scores["urgency"]
            assert (
                score.score == want["answers"]["urgency"]["score"]
                and score.confidence == want["answers"]["urgency"]["confidence"]
            )
            assert score.probabilities == {int(k): v for k, v in want["answers"]["urgency"]["probabilities"].items()}
            assert score.legend == {0: "low", 1: "medium", 2: {"level": "high"}}
            assert len(got.request_id) == 32
            assert [m.name for m in sdk.models.list().models] == [model.name, "jev-latest"]
    assert [r.headers.get("content-encoding") for r in sent if r.method == "POST"] == [None, "zstd"]
    # The SDK's own errors for this server's 4xx: typed, and not retried (only 408, 429 and 5xx are).
    with ts.TypeSafeClient(base_url=live.url, api_key="local") as sdk:
        with pytest.raises(ts.TypeSafeUnprocessableEntityError, match="questions.s.criteria"):
            sdk.system_one(state="s", questions={"s": ts.Score(criteria=["only one level"])})
        with pytest.raises(ts.TypeSafeAPIError) as too_long:
            sdk.system_one(state=long_state_request(paragraphs=50)["state"], questions={"q": ts.Noul(instructions="?")})
        assert too_long.value.status == 413 and "tokens" in str(too_long.value)


# --- Semantics: the ids and the other questions are part of the prompt ----------------------------------------
def test_ids_and_question_order_are_sent_to_the_model_unchanged(client, expected):
    """Renaming an id, adding a question or reordering them changes the prompt (the head decides
    fields jointly): the server answers each variant as decide() does, and rewrites nothing."""
    base = mixed_request()
    renamed = {**base, "questions": {f"x_{qid}": q for qid, q in base["questions"].items()}}
    reordered = {**base, "questions": dict(reversed(base["questions"].items()))}
    added = {**base, "questions": {**base["questions"], "extra": {"type": "noul", "instructions": "Is it Monday?"}}}
    answers = {}
    for name, request in {"base": base, "renamed": renamed, "reordered": reordered, "added": added}.items():
        answers[name] = check_contract(request, client.post("/v1/systemone", json=request))
        assert answers[name] == expected(request)
    assert answers["renamed"]["usage"]["input_tokens"] != answers["base"]["usage"]["input_tokens"]
    assert answers["added"]["usage"]["input_tokens"] > answers["base"]["usage"]["input_tokens"]


# --- The command: refusing bad files, memory, SIGTERM ----------------------------------------------------------
def _plain_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow
def test_serve_refuses_a_file_that_is_not_a_clef_model(tmp_path):
    random_bytes = tmp_path / "random.gguf"
    random_bytes.write_bytes(os.urandom(4096))
    for path in (random_bytes, _plain_gguf(tmp_path / "llama.gguf")):
        with pytest.raises(ModelFileError) as refused:  # what loading (validate) says of the file
            clef_gguf.load(path)
        port = free_port()
        process = serve_process(path, port)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == refused.value.exit_code, stderr
        assert str(refused.value) in stderr and "Traceback" not in stderr and "Uvicorn running" not in stderr
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_a_missing_native_head_names_the_path_it_looked_in(monkeypatch, tmp_path):
    """What a replica importing a source checkout (no build) instead of the installed package says (serve --ray)."""
    from clef_gguf.llama import native

    monkeypatch.delenv(native.ENV_LIBRARY, raising=False)
    monkeypatch.setattr(clef_gguf, "__path__", [str(tmp_path / "clef_gguf")])
    with pytest.raises(ModelFileError) as missing:
        native.library_path()
    assert str(tmp_path / "clef_gguf" / "_native" / native.LIBRARY_NAME) in str(missing.value)


@pytest.mark.slow
def test_memory_stays_flat_under_repeated_requests(ws):
    """A short soak (tools/bench/load_test.py --soak runs 10,000): RSS after 450 more requests stays within 8 MiB."""
    port = free_port()
    process = serve_process(ws.gguf("untied_f32", "f32"), port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url)
        good = ACCEPTED["jev-latest"]
        bad = {"state": "s", "questions": {"q": {"type": "score", "criteria": {"0": "map"}}}}
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c:

            def burst(count: int) -> None:
                for i in range(count):
                    response = c.post("/v1/systemone", json=bad if i % 10 == 9 else good)
                    assert response.status_code == (422 if i % 10 == 9 else 200)

            burst(150)  # warm-up: allocator pools, llama.cpp buffers, first-call caches
            before = rss_bytes(process.pid)
            burst(450)
            after = rss_bytes(process.pid)
        assert after - before < 8 << 20, (before, after)
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_drains_in_flight_requests_then_exits_128_plus_n(ws, model, signum):
    """SIGTERM, SIGINT and SIGHUP alike (SIGHUP killed the server at once, dropping what it was answering): the
    requests inside are answered, then the exit status says the signal, as every command's does."""
    port = free_port()
    process = serve_process(ws.gguf("untied_f32", "f32"), port)
    url = f"http://127.0.0.1:{port}"
    request = long_state_request()  # the slowest small request: several are in flight at once
    try:
        wait_healthy(process, url)
        with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=url, timeout=TIMEOUT) as c:
            in_flight = [pool.submit(httpx.post, f"{url}/v1/systemone", json=request, timeout=TIMEOUT) for _ in range(4)]
            deadline = time.monotonic() + 60
            while c.get("/health").json()["pending"] < 4:
                assert time.monotonic() < deadline and not any(f.done() for f in in_flight), "requests finished too soon"
                time.sleep(0.005)
            process.send_signal(signum)
            responses = [f.result() for f in in_flight]
        assert [r.status_code for r in responses] == [200] * 4
        want = reuse_apart(model.decide(request))
        assert all(reuse_apart(r.json()) == want for r in responses)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 128 + signum, stderr
        assert "Traceback" not in stderr and "Application shutdown complete" in stderr
        assert stderr.rstrip().endswith(f"stopped by {signum.name}; drained: the requests admitted before it were answered")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_serve_that_cannot_listen_says_where_and_why_and_claims_nothing(ws):
    """A port in use, an address that is none: one line naming the address and the reason, exit 2 (a bad setting),
    and no line saying it serves."""
    import socket

    model = ws.gguf("untied_f32", "f32")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = run_cli("serve", model, "--port", str(port), "--ctx", "512", "--threads", "1", timeout=300)
    assert run.returncode == 2 and "serving" not in run.stderr, run.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in run.stderr and "Traceback" not in run.stderr
    run = run_cli("serve", model, "--host", "999.1.1.1", "--ctx", "512", "--threads", "1", timeout=300)
    assert run.returncode == 2 and "serving" not in run.stderr and "cannot listen on 999.1.1.1:8000" in run.stderr


@pytest.mark.parametrize("command", ["serve", "decide"])
def test_an_empty_model_path_is_a_bad_setting(command, tmp_path):
    """'' is no file (pathlib makes it ".", the working directory, which was read as a model): a bad setting, exit 2."""
    request = tmp_path / "request.json"
    request.write_text("{}")
    run = run_cli(command, "", *([request] if command == "decide" else []))
    assert run.returncode == 2 and "an empty path names" in run.stderr and "Is a directory" not in run.stderr, run.stderr


def test_an_ipv6_host_is_bracketed_in_urls():
    from clef_gguf.server.run import url_host

    assert [url_host(h) for h in ("::1", "127.0.0.1", "localhost", "[::1]")] == ["[::1]", "127.0.0.1", "localhost", "[::1]"]

"""The server answers its own names and its own page only (server/guard.py): what a hostile web page can make its
user's browser send to a server on loopback (a request under a rebound name, a cross-origin "simple" POST) is refused
before it is read, while requests without an Origin (curl, httpx, the SDKs) and the page's own are answered. The
app is `serve`'s (run.settings_app, from ServeSettings), on uvicorn on loopback in this process."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from cli_helpers import run_cli
from server_helpers import TIMEOUT, parse_answer, receive, start

from clef_gguf.data import DEMO_MODEL
from clef_gguf.errors import SettingsError
from clef_gguf.server.run import settings_app
from clef_gguf.settings import ServeSettings

REQUEST = {"state": "The parcel arrived broken.", "questions": {"complaint": {"type": "noul"}}}
ATTACKER = "http://attacker.example"
SIMPLE_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]


@pytest.fixture(scope="module")
def model(ws):
    return ws.model("untied_f32", "f32")


@contextmanager
def served(model: Any, settings: ServeSettings) -> Iterator[str]:
    live = start(settings_app(model, settings, owns_model=False))
    try:
        yield live.url
    finally:
        live.stop()


@pytest.fixture(scope="module")
def url(model) -> Iterator[str]:
    with served(model, ServeSettings()) as url:
        yield url


def refused(response: httpx.Response, status: int, says: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json" and says in response.json()["detail"]["message"]


def decisions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    counts = [line for line in text.splitlines() if line.startswith("clef_decision_seconds_count") and 'phase="compute"' in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in counts)


def test_a_cross_origin_simple_post_is_refused_unread(url):
    """What any page can make a browser send without a preflight: a body of a simple type, with the page's Origin."""
    before = decisions(url)
    body = b'{"state": "x", "questions": {"q": {"type": "noul"}}}'
    for media in SIMPLE_TYPES:
        sent = {"Content-Type": media, "Origin": ATTACKER}
        response = httpx.post(f"{url}/v1/systemone", content=body, headers=sent, timeout=TIMEOUT)
        refused(response, 403, "pages of 'http://attacker.example' may not call this server")
        assert response.json()["detail"]["error_type"] == "permission_error"
    on_workers_ai = httpx.post(f"{url}/accounts/a/ai/run/@cf/cloudflare/clef", content=body, headers=sent, timeout=TIMEOUT)
    assert on_workers_ai.status_code == 403 and on_workers_ai.json()["success"] is False  # the route's envelope
    for null_origin in ("null", "http://127.0.0.1.attacker.example"):
        sent = {"Content-Type": "application/json", "Origin": null_origin}
        assert httpx.post(f"{url}/v1/systemone", content=body, headers=sent, timeout=TIMEOUT).status_code == 403
    # Without an Origin (no browser sent it), a body still must say it is JSON: a simple type is never decided.
    for media in [*SIMPLE_TYPES[:2], None]:
        sent = {"Content-Type": media} if media else {}
        response = httpx.post(f"{url}/v1/systemone", content=body, headers=sent, timeout=TIMEOUT)
        refused(response, 415, "send Content-Type: application/json")
    assert decisions(url) == before  # nothing was decided


def test_a_foreign_host_is_refused_on_every_route(url):
    """DNS rebinding: a page whose own name now points at 127.0.0.1 sends its name as Host."""
    for method, path in [("GET", "/"), ("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/systemone")]:
        response = httpx.request(method, url + path, json=REQUEST, headers={"Host": "attacker.example:8000"}, timeout=TIMEOUT)
        refused(response, 403, "this server does not answer as 'attacker.example' (Host)")
    port = url.rsplit(":", 1)[1]
    for own in ["127.0.0.1", f"localhost:{port}", "LOCALHOST.", f"[::1]:{port}", "ui.localhost", "10.1.2.3:80"]:
        assert httpx.get(f"{url}/health", headers={"Host": own}, timeout=TIMEOUT).status_code == 200, own


def _raw(url: str, target: str, headers: list[tuple[str, str]]) -> tuple[int, bytes]:
    """One request as written here, header by header (httpx merges a repeated Host): its status and body."""
    head = "".join(f"{name}: {value}\r\n" for name, value in headers)
    body = b'{"state": "x", "questions": {"q": {"type": "noul"}}}'
    request = f"POST {target} HTTP/1.1\r\n{head}content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(request.encode("latin-1") + b"connection: close\r\n\r\n" + body)
        status, _, answer = parse_answer(receive(sock, time.perf_counter() + 60))
    return status, answer


@pytest.mark.parametrize(
    "headers, status, says",
    [
        ([("host", "attacker.example"), ("host", "localhost")], 400, b"2 Host headers"),
        ([("host", "localhost"), ("host", "attacker.example")], 400, b"2 Host headers"),
        ([("host", "localhost"), ("host", "localhost")], 400, b"2 Host headers"),
        ([("host", "localhost:abc")], 400, b"is not a name or address"),
        ([("host", "localhost:99999")], 400, b"is not a name or address"),
        ([("host", "localhost:0")], 400, b"is not a name or address"),
        ([("host", "")], 400, b"is not a name or address"),
        ([("host", "::1")], 400, b"is not a name or address"),
        ([("host", "localhost"), ("origin", "http://localhost"), ("origin", ATTACKER)], 403, b"may not call this server"),
        ([("host", "localhost"), ("origin", ATTACKER), ("origin", "http://localhost")], 403, b"may not call this server"),
    ],
)
def test_a_request_with_two_hosts_a_bad_host_or_two_origins_is_refused(url, headers, status, says):
    got, body = _raw(url, "/v1/systemone", headers)
    assert got == status and says in body, body


def test_an_absolute_target_names_the_host_the_request_is_for(url):
    """`POST http://NAME/path` (RFC 9112's absolute form) is for NAME, whatever Host says: refused as a foreign host."""
    port = url.rsplit(":", 1)[1]
    status, body = _raw(url, "http://attacker.example/v1/systemone", [("host", "localhost")])
    assert status == 403 and b"does not answer as 'attacker.example'" in body, body
    status, body = _raw(url, f"http://localhost:{port}/v1/systemone", [("host", "attacker.example")])
    assert status == 200, body


def test_the_page_and_clients_without_an_origin_are_answered_with_safe_headers(url):
    before = decisions(url)
    by_name = url.replace("127.0.0.1", "localhost")
    for headers in ({}, {"Origin": url}, {"Origin": by_name, "Host": by_name.split("//")[1]}):
        response = httpx.post(f"{url}/v1/systemone", json=REQUEST, headers=headers, timeout=TIMEOUT)
        assert response.status_code == 200, (headers, response.text)
        assert response.headers["x-content-type-options"] == "nosniff" and response.headers["cache-control"] == "no-store"
    assert decisions(url) == before + 3
    for path in ("/health", "/v1/models", "/nowhere"):
        answer = httpx.get(url + path, timeout=TIMEOUT)
        assert (answer.headers["x-content-type-options"], answer.headers["cache-control"]) == ("nosniff", "no-store"), path
    assert httpx.get(url + "/", timeout=TIMEOUT).headers["cache-control"] == "no-cache"  # the page's files revalidate


def test_no_redirect_follows_the_host_header(url):
    for path in ("/v1/models/", "/health/"):
        answer = httpx.get(url + path, timeout=TIMEOUT)
        assert answer.status_code == 404 and "location" not in answer.headers, path
    assert "location" not in httpx.get(url + "/v1/models/", headers={"Host": "attacker.example"}, timeout=TIMEOUT).headers


def test_settings_name_a_proxys_hosts_and_other_sites_pages(model):
    settings = ServeSettings(allowed_hosts=("clef.example.com", ".corp.example"), allowed_origins=("https://app.example.com",))
    with served(model, settings) as url:

        def post(**headers: str) -> int:
            return httpx.post(f"{url}/v1/systemone", json=REQUEST, headers=headers, timeout=TIMEOUT).status_code

        assert [post(Host=h) for h in ("clef.example.com", "a.corp.example:443", "corp.example.evil")] == [200, 200, 403]
        assert post(Origin="https://app.example.com") == 200 and post(Origin="https://evil.example") == 403
        # Behind a TLS proxy that keeps the Host: the page's https origin is the server's own name.
        assert post(Host="clef.example.com", Origin="https://clef.example.com") == 200
    with served(model, ServeSettings(allowed_hosts=("*",), allowed_origins=("*",))) as url:
        anyone = {"Host": "any.example", "Origin": ATTACKER}
        assert httpx.post(f"{url}/v1/systemone", json=REQUEST, headers=anyone, timeout=TIMEOUT).status_code == 200


def test_settings_that_name_no_host_or_origin_are_refused():
    for bad in ({"allowed_hosts": ("a b",)}, {"allowed_hosts": ("",)}, {"allowed_origins": ("app.example.com",)}):
        with pytest.raises(SettingsError, match="allowed_"):
            ServeSettings(**bad)  # type: ignore[arg-type]
    run = run_cli("serve", DEMO_MODEL, "--allowed-origin", "app.example.com", timeout=60)
    assert run.returncode == 2 and "is not an origin" in run.stderr and "Traceback" not in run.stderr

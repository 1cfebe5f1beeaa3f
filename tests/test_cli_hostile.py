"""The CLI against hostile input: request files that are not Unicode JSON, names with terminal
escapes, out-of-range options, and a remote server that trickles bytes. Each is one line and an
exit code (or a bounded wait), never a traceback.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import run_cli as cli  # the CLI in this process

from clef_gguf.check import remote
from clef_gguf.check.report import Verdict
from clef_gguf.check.validate import validate
from clef_gguf.data import DEMO_MODEL
from clef_gguf.runtime.reader import MAX_REQUEST_NESTING
from clef_gguf.testing.gguf_bytes import kv_str, rebuild
from clef_gguf.testing.processes import free_port

NOUL = {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}
LIMIT = MAX_REQUEST_NESTING


def assert_one_line_error(run: subprocess.CompletedProcess[str], code: int, says: str) -> None:
    assert run.returncode == code, (run.returncode, run.stderr[-2000:])
    assert says in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert len(run.stderr.strip().splitlines()) == 1 and run.stdout == "", run.stderr[-2000:]


# --- decide: request files -----------------------------------------------------------------------------
def _nested(depth: int) -> str:
    return json.dumps({**NOUL, "state": None}).replace("null", "[" * depth + "]" * depth)


REQUESTS = {
    "invalid UTF-8": (b'{"model": "m", "state": "caf\xe9", "questions": {}}', "not UTF-8 text: byte 0xe9 at offset 28"),
    "a truncated UTF-8 sequence": (json.dumps(NOUL).encode()[:-2] + b"\xe2\x82", "not UTF-8 text"),
    "a lone surrogate in the state": (
        json.dumps({**NOUL, "state": "\ud800"}).encode(),
        "state: holds a lone surrogate (U+D800)",
    ),
    "a lone surrogate in a question id": (
        json.dumps({**NOUL, "questions": {"q\udfff": {"type": "noul"}}}).encode(),
        "questions.q\\udfff: holds a lone surrogate (U+DFFF)",  # the key itself (as the server's loc names it), escaped
    ),
    "a lone surrogate in an option name": (
        json.dumps({**NOUL, "questions": {"c": {"type": "choice", "criteria": {"a": None, "\udc80b": None}}}}).encode(),
        "questions.c.criteria.\\udc80b: holds a lone surrogate (U+DC80)",
    ),
    "a lone surrogate in a state key": (
        json.dumps({**NOUL, "state": {"k\ud83d": 1}}).encode(),
        "state.k\\ud83d: holds a lone surrogate (U+D83D)",
    ),
    "nesting past the limit": (_nested(MAX_REQUEST_NESTING + 5).encode(), f"state: nests arrays and objects more than {LIMIT}"),
    "nesting past Python's recursion limit": (_nested(5000).encode(), f"more than {MAX_REQUEST_NESTING} deep"),
    "not JSON": (b"{'model': 1}", "JSON decode error: Expecting property name enclosed in double quotes: line 1 column 2"),
    "NaN": (json.dumps({**NOUL, "state": float("nan")}).encode(), "NaN is not valid JSON"),  # json.dumps writes it
    "Infinity": (json.dumps({**NOUL, "state": [float("-inf")]}).encode(), "-Infinity is not valid JSON"),
}


@pytest.mark.parametrize("case", list(REQUESTS))
def test_decide_prints_one_line_for_a_request_that_is_not_unicode_json(case, tmp_path):
    raw, says = REQUESTS[case]
    path = tmp_path / "request.json"
    path.write_bytes(raw)
    assert_one_line_error(cli("decide", str(path)), 2, says)  # the demo model


def test_decide_reads_stdin_as_utf8_bytes_too():
    assert_one_line_error(cli("decide", "-", stdin=b'{"state": "\xff"}'), 2, "not UTF-8 text")
    assert_one_line_error(cli("decide", "-", stdin=json.dumps({**NOUL, "state": "\ud800"}).encode()), 2, "lone surrogate")


def test_nesting_within_the_limit_is_answered(tmp_path):
    path = tmp_path / "request.json"
    path.write_text(_nested(MAX_REQUEST_NESTING - 2))
    run = cli("decide", str(path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["answers"]["q"]["type"] == "noul"


# --- general.name is printed escaped ----------------------------------------------------------------------
@pytest.mark.slow
def test_a_file_name_with_terminal_escapes_is_never_printed_raw(tmp_path):
    name = "evil\x1b[2J\x1b]0;owned\x07\nsecond line\r"
    path = rebuild(DEMO_MODEL, tmp_path / "evil.gguf", replace={"general.name": kv_str("general.name", name)})
    assert validate(path).ok
    request = tmp_path / "request.json"
    request.write_text(json.dumps(NOUL))
    decided = cli("decide", str(path), str(request))
    assert decided.returncode == 0 and "\x1b" not in decided.stdout and "\x1b" not in decided.stderr, decided.stderr
    assert json.loads(decided.stdout)  # the name inside the JSON is escaped by JSON
    server = subprocess.Popen(
        [sys.executable, "-m", "clef_gguf.cli", "serve", str(path), "--port", str(free_port())],
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(120, server.kill)  # readline must not wait forever on a server that hangs
    watchdog.start()
    try:
        lines = (server.stderr.readline() for _ in range(100))  # llama.cpp may log first
        line = next((x for x in lines if x.startswith("serving") or not x), "")  # "" once the server is gone
        assert line.startswith("serving evil\\x1b[2J"), line
        assert "\x1b" not in line and "\x07" not in line and "\r" not in line and line.count("\n") == 1, repr(line)
    finally:
        watchdog.cancel()
        server.terminate()
        server.wait(timeout=60)


# --- serve options ------------------------------------------------------------------------------------
def test_serve_refuses_options_that_cannot_work():
    model = str(DEMO_MODEL)
    for port in ("70000", "0", "-1"):
        run = cli("serve", model, "--port", port)
        assert run.returncode == 2 and "Invalid value for '--port'" in run.stderr, run.stderr
    run = cli("serve", model, "--api-key", "")
    assert run.returncode == 2 and "the key is empty" in run.stderr, run.stderr
    run = cli("serve", model, env={"CLEF_GGUF_API_KEY": ""})
    assert run.returncode == 2 and "set but empty" in run.stderr, run.stderr
    for key in ("clé-secrète", "two words", "tab\tkey"):
        run = cli("serve", model, "--api-key", key)
        assert run.returncode == 2 and "visible ASCII" in run.stderr, (key, run.stderr)
    assert "Traceback" not in run.stderr


# --- validate URL: an overall deadline -------------------------------------------------------------------
class TricklingServer:
    """A loopback HTTP server that answers every GET with a 206 for the range, then sends its body one byte
    every `interval` seconds (or, with interval None, sends nothing at all after the request)."""

    def __init__(self, interval: float | None, size: int = 1 << 30) -> None:
        self.interval, self.size = interval, size
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/model.gguf"
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            request = b""
            while b"\r\n\r\n" not in request and not self.stopped.is_set():
                chunk = conn.recv(4096)
                if not chunk:
                    return
                request += chunk
            if self.interval is None:
                self.stopped.wait()
                return
            header = f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-{self.size - 1}/{self.size}\r\n"
            conn.sendall((header + f"Content-Length: {self.size}\r\n\r\n").encode())
            while not self.stopped.wait(self.interval):
                try:
                    conn.sendall(b"G")
                except OSError:
                    return

    def close(self) -> None:
        self.stopped.set()
        self.listener.close()


@pytest.fixture(params=[0.5, None], ids=["a byte every 0.5 s", "silent"])
def slow_server(request) -> Iterator[TricklingServer]:
    server = TricklingServer(request.param)
    yield server
    server.close()


def test_validate_url_gives_up_at_its_deadline(slow_server, monkeypatch):
    monkeypatch.setattr(remote, "DEADLINE_S", 1.0)  # (documented: docs/validation.md) two of the trickler's bytes
    started = time.monotonic()
    report = validate(slow_server.url)
    elapsed = time.monotonic() - started
    assert elapsed < 1.0 + 1.5, elapsed
    assert report.verdict is Verdict.CORRUPT and report.exit_code == 5, report.summary
    assert "did not arrive within 1 s" in report.summary, report.summary


def test_the_deadline_is_documented():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert f"{remote.DEADLINE_S:g} s" in readme


def test_user_text_is_never_parsed_as_markup():
    run = cli("plan", str(DEMO_MODEL), "--vram", "[/b]8GiB")  # Rich would fail on a closing tag it never opened
    assert run.returncode == 2 and "[/b]8GiB" in run.stderr and "Traceback" not in run.stderr, run.stderr

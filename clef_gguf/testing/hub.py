"""A local stand-in of the Hugging Face Hub: the routes huggingface-hub's own client uses to download (FACTS.md, "The
Hugging Face Hub, offline"), serving a folder of repositories, ROOT/ORG/REPO/..., each one revision (a push: its files
changed, a new commit). The real client is pointed at it with HF_ENDPOINT. It counts downloads (GETs of a file's
bytes) and revision lookups (a repository's information asked for its sha alone), records the bearer tokens sent, and
can be made slow (`delay_s` before every answer) to stand for a Hub that answers slowly, or held (`gate` cleared:
every answer waits until it is set again, at most GATE_MAX_S) for a test that needs every first use waiting at once,
made to lie in its listing (`listed`: a file's size as the listing gives it) or to drip a file's bytes (`drip_s`
between its 1 KiB pieces).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

_INFO = re.compile(r"^/api/models/([^/]+)/([^/?]+)(?:/revision/([^/?]+))?(?:\?(.*))?$")
_RESOLVE = re.compile(r"^/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$")
GATE_MAX_S = 120.0


class Hub:
    """The stand-in, on a free loopback port (url); close() stops it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.downloads: Counter[str] = Counter()  # "ORG/REPO/FILE" -> GETs of its bytes
        self.lookups: Counter[str] = Counter()  # "ORG/REPO" -> its information asked for the sha alone (expand=sha)
        self.tokens: list[str] = []  # the Authorization headers received
        self.delay_s = 0.0
        self.gate = threading.Event()
        self.gate.set()
        self.drip_s = 0.0
        self.listed: dict[str, int] = {}  # "ORG/REPO/FILE" -> the size the listing says, whatever the file's
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802
                hub._answer(self, body=False)

            def do_GET(self) -> None:  # noqa: N802
                hub._answer(self, body=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def repo(self, org: str, name: str) -> Path:
        """The folder of repository ORG/NAME (made if missing): put its files there."""
        path = self.root / org / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def sha(self, org: str, name: str) -> str:
        """The repository's one revision: a digest of its files' names and bytes (40 hex digits, as a commit's)."""
        digest = hashlib.sha1(usedforsecurity=False)
        for file in self._files(self.root / org / name):
            digest.update(str(file.relative_to(self.root / org / name)).encode() + b"\0" + file.read_bytes())
        return digest.hexdigest()

    @staticmethod
    def _files(repo: Path) -> list[Path]:
        return sorted(p for p in repo.rglob("*") if p.is_file())

    def downloads_of(self, org: str, name: str) -> int:
        with self._lock:
            return sum(n for key, n in self.downloads.items() if key.startswith(f"{org}/{name}/"))

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        with self._lock:
            self.tokens.append(handler.headers.get("Authorization", ""))
        self.gate.wait(GATE_MAX_S)
        if self.delay_s:
            time.sleep(self.delay_s)
        path = handler.path
        if (m := _INFO.match(path)) is not None:
            if parse_qs(m[4] or "").get("expand") == ["sha"]:
                with self._lock:
                    self.lookups[f"{m[1]}/{m[2]}"] += 1
            return self._info(handler, m[1], m[2], m[3] or "main", body)
        if (m := _RESOLVE.match(path)) is not None:
            return self._file(handler, m[1], m[2], m[3], m[4], body)
        return _send(handler, 404, b'{"error":"not found"}', {"X-Error-Code": "EntryNotFound"}, body)

    def _revision_ok(self, org: str, name: str, revision: str) -> bool:
        return revision == "main" or revision == self.sha(org, name)

    def _info(self, handler: BaseHTTPRequestHandler, org: str, name: str, revision: str, body: bool) -> None:
        repo = self.root / org / name
        if not repo.is_dir():
            return _send(handler, 404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        if not self._revision_ok(org, name, revision):
            return _send(handler, 404, b'{"error":"Revision not found"}', {"X-Error-Code": "RevisionNotFound"}, body)
        siblings = [
            {"rfilename": (f := str(p.relative_to(repo))), "size": self.listed.get(f"{org}/{name}/{f}", p.stat().st_size)}
            for p in self._files(repo)
        ]
        info: dict[str, Any] = {
            "id": f"{org}/{name}",
            "modelId": f"{org}/{name}",
            "sha": self.sha(org, name),
            "siblings": siblings,
        }
        _send(handler, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)

    def _file(self, handler: BaseHTTPRequestHandler, org: str, name: str, revision: str, file: str, body: bool) -> None:
        repo = self.root / org / name
        if not repo.is_dir():
            return _send(handler, 404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        target = repo / file
        if not self._revision_ok(org, name, revision) or ".." in file or not target.is_file():
            return _send(handler, 404, b'{"error":"Entry not found"}', {"X-Error-Code": "EntryNotFound"}, body)
        data = target.read_bytes()
        if body:
            with self._lock:
                self.downloads[f"{org}/{name}/{file}"] += 1
        headers = {"X-Repo-Commit": self.sha(org, name), "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        _send(handler, 200, data, headers | {"Content-Type": "application/octet-stream"}, body, self.drip_s)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _send(
    handler: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool, drip_s: float = 0.0
) -> None:
    handler.send_response(status)
    for key, value in headers.items():
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if body:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if not drip_s:
                handler.wfile.write(data)
            for start in range(0, len(data) if drip_s else 0, 1024):
                handler.wfile.write(data[start : start + 1024])
                handler.wfile.flush()
                time.sleep(drip_s)

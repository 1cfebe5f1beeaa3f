"""clef-gguf serve and llama-server side by side on one file, as tools/bench/bench_vs_llama_server.py, perf_servers.py
and bench_batch.py run them: each server started as a child, a kept-alive client, and the requests by size that both
accept, each round about a state of its own."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from http.client import HTTPConnection, RemoteDisconnected
from pathlib import Path
from typing import Any

from ..data import DEMO_REQUEST
from .llama_server import as_llama_server_accepts, placement_flags
from .request_suite import long_state_text

LLAMA_SERVER_MAX_BATCH = 28672  # the largest -c = -b = -ub llama-server starts with for qwen35 (32768 aborts)


class Client:
    """A kept-alive HTTP connection to one server (reopened should the server close it)."""

    def __init__(self, url: str) -> None:
        self.host, _, port = url.removeprefix("http://").partition(":")
        self.port = int(port)
        self.connection = HTTPConnection(self.host, self.port, timeout=900)

    def send(self, request: dict[str, Any]) -> tuple[float, int, bytes]:
        body = json.dumps(request).encode()
        for attempt in (1, 2):
            started = time.perf_counter()
            try:
                self.connection.request("POST", "/v1/systemone", body, {"Content-Type": "application/json"})
                response = self.connection.getresponse()
                data = response.read()
                break
            except (ConnectionError, RemoteDisconnected):  # closed by the server since the last request
                self.connection.close()
                if attempt == 2:
                    raise
        seconds = time.perf_counter() - started
        if response.getheader("connection", "").lower() == "close":
            self.connection.close()
        return seconds, response.status, data

    def post(self, request: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        seconds, status, data = self.send(request)
        if status != 200:
            raise SystemExit(f"HTTP {status} from {self.host}:{self.port}: {data[:300].decode('utf-8', 'replace')}")
        return seconds, json.loads(data)

    def status(self, request: dict[str, Any]) -> str:
        """What the server answers a request it is expected to refuse: its status and message."""
        _, status, data = self.send(request)
        return "answered" if status == 200 else f"HTTP {status} {data.decode('utf-8', 'replace')[:160]}"


def requests_by_size() -> dict[str, dict[str, Any]]:
    """The demo request (the ticket), and its long states of about 2k, 8k and 32k tokens, as llama-server accepts them."""
    demo = json.loads(DEMO_REQUEST.read_text())
    out = {"ticket": demo}
    for label, paragraphs in (("~2k", 11), ("~8k", 46), ("~32k", 184)):
        request = copy.deepcopy(demo)
        request["state"] = {"ticket": long_state_text(paragraphs), "customer_tier": "gold"}
        out[label] = request
    return {name: as_llama_server_accepts(r) for name, r in out.items()}


def new_state(request: dict[str, Any], round_: int) -> dict[str, Any]:
    """The request about a state of its own (one more key, first in the prompt's sorted JSON), so that every
    round is cold for clef-gguf's state cache too: the same body goes to both servers."""
    return {**request, "state": {"case": round_, **request["state"]}}


def start_clef_gguf(model: Path, url: str, threads: int, log: Path) -> subprocess.Popen:
    """`clef-gguf serve` on `model`, with this interpreter's clef_gguf."""
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(model), "--port", url.rsplit(":", 1)[1]]
    return subprocess.Popen([*command, "--threads", str(threads)], stdout=subprocess.DEVNULL, stderr=log.open("w"))


def start_llama_server(binary_dir: Path, model: Path, url: str, threads: int, slots: int, log: Path) -> subprocess.Popen:
    """llama-server on `model` with `slots` parallel slots (-np), each able to take a prompt of LLAMA_SERVER_MAX_BATCH."""
    ctx = str(LLAMA_SERVER_MAX_BATCH)
    command = [str(binary_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1]]
    command += ["-c", ctx, "-b", ctx, "-ub", ctx, "-t", str(threads), "-np", str(slots), *placement_flags()]
    if slots > 1:
        command.append("--kv-unified")  # every slot may take the whole context, as clef-gguf's sequences may
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))

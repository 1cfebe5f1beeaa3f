"""`clef-gguf serve` as a subprocess on loopback, for tests that need the command itself (its defaults,
its exit codes, its signals) rather than an app in the test process."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(model: Path, port: int, *args: str) -> subprocess.Popen[str]:
    # One llama.cpp thread: on a shared machine, more threads than free cores make every decode wait at barriers.
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(model), "--port", str(port), "--threads", "1", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_healthy(process: subprocess.Popen[str], url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("the server did not answer /health")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@contextmanager
def served(model: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A running `clef-gguf serve MODEL ARGS...` (its own defaults for everything not in ARGS): its URL and process."""
    port = free_port()
    process = serve_process(model, port, *args)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()

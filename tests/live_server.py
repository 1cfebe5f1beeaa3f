"""`clef-gguf serve` as a subprocess on loopback, for tests that need the command itself (its defaults,
its exit codes, its signals) rather than an app in the test process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from clef_gguf.testing import processes
from clef_gguf.testing.processes import free_port

# How long a server may take to answer /health. The device set (tests/conftest.py) raises it: on lavapipe a
# process's first decision (serve's load probe) compiles ggml-vulkan's pipelines, 346 s measured.
HEALTH_TIMEOUT_S = 120.0


def serve_process(
    model: Path, port: int, *args: str, env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.Popen[str]:
    """`clef-gguf serve` as a subprocess; env adds to this process's environment; output piped, or appended to log
    (for a server that writes more than a pipe holds before anyone reads it: Ray's logs)."""
    # One llama.cpp thread: on a shared machine, more threads than free cores make every decode wait at barriers.
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(model), "--port", str(port), "--threads", "1", *args]
    environment = {**os.environ, **env} if env else None
    if log is None:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    with log.open("a") as output:  # the child keeps its own descriptor
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True, env=environment)


def wait_healthy(process: subprocess.Popen[str], url: str, timeout_s: float | None = None) -> None:
    processes.wait_healthy(url, process, HEALTH_TIMEOUT_S if timeout_s is None else timeout_s)


def rss_bytes(pid: int) -> int:
    return round(processes.memory_mib(pid) * 1024) * 1024


@contextmanager
def served(
    model: Path,
    *args: str,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    timeout_s: float | None = None,
    port: int | None = None,
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A running `clef-gguf serve MODEL ARGS...` (its own defaults for everything not in ARGS): its URL and process.
    `port`: a free one unless given (`serve --ray` joining a cluster whose Serve runs: its proxy's, conftest's ray_serve)."""
    port = port or free_port()
    process = serve_process(model, port, *args, env=env, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, timeout_s)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()

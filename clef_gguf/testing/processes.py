"""Servers as child processes, and what benchmarks read of them: for tests and tools alike (stdlib only)."""

from __future__ import annotations

import math
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port free on `host` now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 180.0) -> None:
    """Wait until `url`/health answers 200. RuntimeError if `process` exits first (with its stderr, when piped and
    done), TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            detail = process.stderr.read() if process.stderr is not None else ""
            raise RuntimeError(f"the server exited ({process.returncode}) before {url} was healthy\n{detail or ''}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass  # not up yet, or (Ray's proxy, before the application is deployed) not ours yet
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer /health within {timeout_s:g} s")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 to 100) by nearest rank: a value that was measured, never an interpolation."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def memory_mib(pid: int | str = "self", field: str = "VmRSS") -> float:
    """A process's memory from /proc/PID/status: VmRSS (resident now) or VmHWM (its peak), in MiB.

    VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's RSS at fork, which survives exec."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")

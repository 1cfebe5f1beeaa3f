"""Load on a server over loopback, as tools/bench/load_test.py and bench_ray.py send it: `clef-gguf serve` started
as a child, keep-alive connections that read the Server-Timing header, and a level of concurrent clients."""

from __future__ import annotations

import http.client
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .processes import HOST, free_port, percentile


@dataclass
class Sample:
    latency_s: float
    timing_ms: dict[str, float]  # the server's Server-Timing: read, queue, decide, back
    status: int

    @property
    def decide_s(self) -> float:
        return self.timing_ms.get("decide", 0.0) / 1e3


@dataclass
class Level:
    clients: int
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    throughput_rps: float
    errors: int


class Connection:
    """One keep-alive HTTP/1.1 connection; http.client sends a small body with its headers in one write."""

    def __init__(self, port: int) -> None:
        self.http = http.client.HTTPConnection(HOST, port, timeout=300)

    def post(self, body: bytes) -> Sample:
        started = time.perf_counter()
        self.http.request("POST", "/v1/systemone", body=body, headers={"Content-Type": "application/json"})
        response = self.http.getresponse()
        response.read()
        latency = time.perf_counter() - started
        return Sample(latency, server_timing(response.getheader("server-timing", "")), response.status)

    def close(self) -> None:
        self.http.close()


def server_timing(header: str) -> dict[str, float]:
    """A Server-Timing header's durations by name, in ms."""
    metrics = (metric.strip().partition(";dur=") for metric in header.split(",") if ";dur=" in metric)
    return {name: float(duration.partition(";")[0]) for name, _, duration in metrics}  # (dur, then desc=...)


def start_server(model: Path, ctx: int, max_queue: int, threads: int | None) -> tuple[subprocess.Popen[bytes], int]:
    """`clef-gguf serve` on `model` at a free loopback port, once it answers /health: (process, port)."""
    port = free_port()
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(model), "--host", HOST, "--port", str(port)]
    command += ["--ctx", str(ctx), "--max-queue", str(max_queue), *(["--threads", str(threads)] if threads else [])]
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode}")
        try:
            connection = http.client.HTTPConnection(HOST, port, timeout=2)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return process, port
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("the server did not answer /health in 120 s")


def run_level(port: int, body: bytes, clients: int, count: int, seconds: float) -> Level:
    """`clients` threads share `count` tickets; each thread stops when they run out or time is up."""
    samples: list[Sample] = []
    lock = threading.Lock()
    tickets = iter(range(count))
    connections = [Connection(port) for _ in range(clients)]
    for connection in connections:  # open and warm every connection first
        connection.post(body)
    started = time.perf_counter()
    deadline = started + seconds

    def client(connection: Connection) -> None:
        while time.perf_counter() < deadline:
            with lock:
                if next(tickets, None) is None:
                    return
            sample = connection.post(body)
            with lock:
                samples.append(sample)

    threads = [threading.Thread(target=client, args=(c,)) for c in connections]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    for connection in connections:
        connection.close()
    latencies = [s.latency_s for s in samples]
    return Level(
        clients,
        len(samples),
        wall,
        percentile(latencies, 50) * 1e3,
        percentile(latencies, 99) * 1e3,
        len(samples) / wall,
        sum(s.status != 200 for s in samples),
    )

"""Load test of `clef-gguf serve`, on loopback only, bounded in requests and in time.

    python tools/bench/load_test.py                                  # the demo model and its request
    python tools/bench/load_test.py --model m.gguf --request r.json --clients 1 4 16 --requests 200 --seconds 60
    python tools/bench/load_test.py --soak 10000                     # plus a 10,000-request memory soak

It starts the server as a subprocess (`python -m clef_gguf.cli serve` on 127.0.0.1, a free port),
then for each client count sends the same request from that many threads, each on its own
keep-alive connection, and reports p50/p99 latency and throughput. The server's overhead is
measured at 1 client against direct ClefModel.decide() calls on the same file, interleaved
one by one so both see the same machine load: the difference of the p50s, and the p50 of
(latency - the decide time the server reports in its Server-Timing header).

The soak alternates valid requests with malformed ones (every 10th) and samples the server's
resident memory (VmRSS) every 500 requests after a 200-request warm-up.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST
from clef_gguf.runtime.model import load
from clef_gguf.testing.processes import HOST, free_port, memory_mib, percentile

MALFORMED = {"model": "m", "state": "s", "questions": {"q": {"type": "score", "criteria": {"0": "a map is not a list"}}}}


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


@dataclass
class Report:
    model: str
    request_tokens: int
    direct_p50_ms: float = 0.0
    server_p50_ms_at_1: float = 0.0
    overhead_p50_ms: float = 0.0  # server p50 - direct p50, interleaved
    overhead_timing_p50_ms: float = 0.0  # p50 of (latency - reported decide time)
    server_timing_p50_ms: dict[str, float] = field(default_factory=dict)  # at 1 client
    levels: list[Level] = field(default_factory=list)
    soak: dict[str, Any] = field(default_factory=dict)


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
        return Sample(latency, _server_timing(response.getheader("server-timing", "")), response.status)

    def close(self) -> None:
        self.http.close()


def _server_timing(header: str) -> dict[str, float]:
    metrics = (metric.strip().partition(";dur=") for metric in header.split(",") if ";dur=" in metric)
    return {name: float(duration.partition(";")[0]) for name, _, duration in metrics}  # (dur, then desc=...)


def start_server(model: Path, ctx: int, max_queue: int, threads: int | None) -> tuple[subprocess.Popen[bytes], int]:
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


def one_client_against_direct(
    model_path: Path, ctx: int, threads: int | None, port: int, request: dict[str, Any], count: int, seconds: float
) -> tuple[Level, list[Sample], list[float]]:
    """1 client: a server request, then a direct decide, alternately; the level, server samples, direct times."""
    body = json.dumps(request).encode()
    connection = Connection(port)
    server: list[Sample] = []
    direct: list[float] = []
    with load(model_path, max_prompt_tokens=ctx, n_threads=threads) as model:
        for _ in range(3):  # warm both
            connection.post(body)
            model.decide(request)
        started = time.perf_counter()
        while len(server) < count and time.perf_counter() - started < seconds:
            server.append(connection.post(body))
            t = time.perf_counter()
            model.decide(request)
            direct.append(time.perf_counter() - t)
        wall = time.perf_counter() - started
    connection.close()
    latencies = [s.latency_s for s in server]
    # Throughput at 1 client counts the server's share of the wall time only (the rest was direct calls).
    level = Level(
        1,
        len(server),
        wall,
        percentile(latencies, 50) * 1e3,
        percentile(latencies, 99) * 1e3,
        len(server) / sum(latencies),
        sum(s.status != 200 for s in server),
    )
    return level, server, direct


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


def soak(pid: int, port: int, body: bytes, count: int, seconds: float) -> dict[str, Any]:
    bad = json.dumps(MALFORMED).encode()
    connection = Connection(port)
    statuses: dict[int, int] = {}
    for i in range(200):  # warm-up: allocator pools, llama.cpp buffers, first-call caches
        connection.post(bad if i % 10 == 9 else body)
    rss = [(0, memory_mib(pid))]
    started = time.perf_counter()
    done = 0
    while done < count and time.perf_counter() - started < seconds:
        status = connection.post(bad if done % 10 == 9 else body).status
        statuses[status] = statuses.get(status, 0) + 1
        done += 1
        if done % 500 == 0:
            rss.append((done, memory_mib(pid)))
    connection.close()
    if rss[-1][0] != done:
        rss.append((done, memory_mib(pid)))
    values = [m for _, m in rss]
    return {
        "requests": done,
        "seconds": round(time.perf_counter() - started, 1),
        "statuses": statuses,
        "rss_mib_after_warmup": round(values[0], 1),
        "rss_mib_at_end": round(values[-1], 1),
        "rss_mib_max": round(max(values), 1),
        "rss_growth_mib": round(values[-1] - values[0], 2),
        "samples": [(n, round(m, 1)) for n, m in rss],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL, help="Clef GGUF (default: the bundled demo model)")
    parser.add_argument("--request", type=Path, default=DEMO_REQUEST, help="request JSON (default: the demo request)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=200, help="requests per client count (at most)")
    parser.add_argument("--seconds", type=float, default=60.0, help="time limit per client count")
    parser.add_argument("--soak", type=int, default=0, help="requests of the memory soak (0: none)")
    parser.add_argument("--soak-seconds", type=float, default=1800.0, help="time limit of the soak")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, help="llama.cpp threads, for the server and the direct calls alike")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()

    request = json.loads(args.request.read_text(encoding="utf-8"))
    body = json.dumps(request).encode()
    with load(args.model, max_prompt_tokens=args.ctx) as probe:
        report = Report(model=probe.name, request_tokens=len(probe.encode(request).tokens))
    process, port = start_server(args.model, args.ctx, max(64, max(args.clients)), args.threads)
    try:
        for clients in args.clients:
            if clients == 1:
                measured = one_client_against_direct(
                    args.model, args.ctx, args.threads, port, request, args.requests, args.seconds
                )
                level, server, direct = measured
                report.direct_p50_ms = statistics.median(direct) * 1e3
                report.server_p50_ms_at_1 = level.p50_ms
                report.overhead_p50_ms = level.p50_ms - report.direct_p50_ms
                report.overhead_timing_p50_ms = statistics.median((s.latency_s - s.decide_s) * 1e3 for s in server)
                names = server[0].timing_ms if server else {}
                report.server_timing_p50_ms = {n: round(statistics.median(s.timing_ms[n] for s in server), 3) for n in names}
            else:
                level = run_level(port, body, clients, args.requests, args.seconds)
            report.levels.append(level)
            print(
                f"{clients:>3} clients: {level.requests} requests, p50 {level.p50_ms:.1f} ms, p99 {level.p99_ms:.1f} ms, "
                f"{level.throughput_rps:.1f} req/s, {level.errors} errors",
                flush=True,
            )
        if args.soak:
            report.soak = soak(process.pid, port, body, args.soak, args.soak_seconds)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)
    print(f"model {report.model}, request of {report.request_tokens} tokens")
    print(f"direct decide p50 {report.direct_p50_ms:.2f} ms; server p50 at 1 client {report.server_p50_ms_at_1:.2f} ms")
    print(
        f"server overhead at p50: {report.overhead_p50_ms:.2f} ms (p50 difference), "
        f"{report.overhead_timing_p50_ms:.2f} ms (latency - Server-Timing decide)"
    )
    print(f"Server-Timing p50 at 1 client (ms): {report.server_timing_p50_ms}")
    if report.soak:
        s = report.soak
        print(
            f"soak: {s['requests']} requests in {s['seconds']} s {s['statuses']}; RSS {s['rss_mib_after_warmup']} -> "
            f"{s['rss_mib_at_end']} MiB (max {s['rss_mib_max']}, growth {s['rss_growth_mib']} MiB)"
        )
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")


if __name__ == "__main__":
    main()

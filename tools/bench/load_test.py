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
import json
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST
from clef_gguf.runtime.model import load
from clef_gguf.testing.load import Connection, Level, Sample, run_level, start_server
from clef_gguf.testing.processes import memory_mib, percentile

MALFORMED = {"model": "m", "state": "s", "questions": {"q": {"type": "score", "criteria": {"0": "a map is not a list"}}}}


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

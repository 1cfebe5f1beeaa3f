"""The slow-body attack on `clef-gguf serve`, on loopback only, bounded in connections and in time.

    python tools/attack_slow_bodies.py                       # the demo model, 64 bodies at 1 byte/s for 30 s
    python tools/attack_slow_bodies.py --model m.gguf --connections 64 --rate 1 --seconds 30 --threads 1

It starts the server as a subprocess (`python -m clef_gguf.cli serve MODEL` on 127.0.0.1, a free port, its
defaults but --threads), then sends the demo request one after another over one kept-alive connection,
as a normal client does: first --baseline-seconds unloaded, then --seconds while --connections connections
each declare a body of --declared bytes and trickle it at --rate bytes/s, reconnecting as soon as the server
answers or closes one (its --min-body-rate rule ends each after --body-grace). It prints the normal requests'
errors and p50/p99 with and without the attack, and what the attackers got; it exits 1 when the target is
missed (an error, or a p99 under attack over --max-ratio times the unloaded one).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST
from clef_gguf.testing.processes import HOST, free_port, percentile, wait_healthy


@dataclass
class Normal:
    """What the normal client saw: each request's latency, and the failures (status or exception) by kind."""

    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    def line(self, label: str) -> str:
        ms = [s * 1e3 for s in self.latencies] or [float("nan")]
        errors = sum(self.errors.values())
        kinds = f" ({dict(self.errors)})" if errors else ""
        p50, p99 = percentile(ms, 50), percentile(ms, 99)
        return f"{label}: {len(ms)} requests, {errors} errors{kinds}, p50 {p50:.1f} ms, p99 {p99:.1f} ms"


@dataclass
class Attack:
    connections: int = 0
    answers: Counter[str] = field(default_factory=Counter)  # status of each answer an attacker got, or "closed"


def _normal_requests(port: int, body: bytes, seconds: float, stop: threading.Event | None = None) -> Normal:
    """The demo request, one after another over one kept-alive connection, for `seconds`."""
    seen = Normal()
    headers = {"content-type": "application/json"}
    connection = http.client.HTTPConnection(HOST, port, timeout=60)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and not (stop and stop.is_set()):
        started = time.perf_counter()
        try:
            connection.request("POST", "/v1/systemone", body, headers)
            response = connection.getresponse()
            response.read()
            if response.status != 200:
                seen.errors[str(response.status)] += 1
            else:
                seen.latencies.append(time.perf_counter() - started)
            if response.getheader("connection", "").lower() == "close":
                connection.close()
        except (OSError, http.client.HTTPException) as e:
            seen.errors[type(e).__name__] += 1
            connection.close()
    connection.close()
    return seen


async def _trickle(port: int, declared: int, rate: float, stop: asyncio.Event, attack: Attack) -> None:
    """One attacker: a body of `declared` bytes trickled at `rate` bytes/s (JSON whitespace), reconnecting whenever
    the server answers or closes the connection, until `stop`."""
    head = f"POST /v1/systemone HTTP/1.1\r\nhost: {HOST}\r\ncontent-type: application/json\r\n"
    head += f"content-length: {declared}\r\n\r\n"
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
        except OSError as e:
            attack.answers[f"connect: {type(e).__name__}"] += 1
            await asyncio.sleep(0.1)
            continue
        attack.connections += 1
        try:
            writer.write(head.encode())
            for _ in range(declared):
                writer.write(b" ")
                await writer.drain()
                try:
                    data = await asyncio.wait_for(reader.read(65536), 1 / rate)
                except asyncio.TimeoutError:
                    if stop.is_set():
                        break
                    continue
                attack.answers[data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"] += 1
                break
        except OSError:
            attack.answers["closed"] += 1
        finally:
            writer.close()


def _attack(port: int, connections: int, declared: int, rate: float, stop: threading.Event, attack: Attack) -> None:
    async def main() -> None:
        done = asyncio.Event()
        tasks = [asyncio.create_task(_trickle(port, declared, rate, done, attack)) for _ in range(connections)]
        while not stop.is_set():
            await asyncio.sleep(0.05)
        done.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def _serve(model: Path, port: int, threads: int, extra: list[str], log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(model), "--port", str(port), "--threads", str(threads)]
    with log.open("wb") as output:  # the access log: a line per request, more than a pipe holds
        return subprocess.Popen([*command, *extra], stdout=output, stderr=subprocess.STDOUT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--request", type=Path, default=DEMO_REQUEST, help="the normal request's JSON body")
    parser.add_argument("--connections", type=int, default=64, help="trickling bodies open at once")
    parser.add_argument("--rate", type=float, default=1.0, help="bytes/s each attacker sends")
    parser.add_argument("--declared", type=int, default=1_000_000, help="Content-Length each attacker declares")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the attack")
    parser.add_argument("--baseline-seconds", type=float, default=30.0, help="normal requests alone, before it")
    parser.add_argument("--threads", type=int, default=1, help="the server's llama.cpp threads")
    parser.add_argument("--max-ratio", type=float, default=2.0, help="target: p99 under attack / unloaded p99")
    parser.add_argument("serve_args", nargs="*", help="more `serve` options, after --")
    args = parser.parse_args()
    body = json.dumps(json.loads(args.request.read_text())).encode()
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "serve.log"
        process = _serve(args.model, port, args.threads, args.serve_args, log)
        try:
            try:
                wait_healthy(f"http://{HOST}:{port}", process)
            except (RuntimeError, TimeoutError):
                print(log.read_text()[-4000:], file=sys.stderr)
                raise
            _normal_requests(port, body, 2.0)  # warm-up: the first decisions, the connection
            alone = _normal_requests(port, body, args.baseline_seconds)
            stop, attack = threading.Event(), Attack()
            attacker = threading.Thread(target=_attack, args=(port, args.connections, args.declared, args.rate, stop, attack))
            attacker.start()
            time.sleep(0.5)  # the connections open
            try:
                attacked = _normal_requests(port, body, args.seconds - 0.5)
            finally:
                stop.set()
                attacker.join()
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
    print(alone.line("unloaded"))
    label = f"under attack ({args.connections} bodies at {args.rate:g} byte/s, reconnecting, {args.seconds:g} s)"
    print(attacked.line(label))
    print(f"attackers: {attack.connections} connections; their answers: {dict(attack.answers)}")
    ratio = percentile(attacked.latencies, 99) / percentile(alone.latencies, 99) if attacked.latencies else float("inf")
    met = not attacked.errors and ratio <= args.max_ratio
    verdict = "met" if met else "MISSED"
    print(f"p99 under attack / unloaded: {ratio:.2f} (target <= {args.max_ratio:g}), and 0 errors: {verdict}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())

"""Ray Serve (`clef-gguf serve --ray`'s application) with 1 and 2 model replicas, against the plain server.

    python tools/bench/bench_ray.py                          # the demo model and a larger fixture (hidden 256, 8 layers)
    python tools/bench/bench_ray.py --rounds 3 --requests 300 --cases demo larger --json ray.json

A local Ray cluster on loopback (Ray's single-node mode), started here, serves build_app's application (the
one `clef-gguf serve --ray` and `serve run` deploy) on 127.0.0.1, each replica with one llama.cpp thread
(and one CPU reserved by Ray). For each model, rounds alternate 1 and 2 replicas (a redeploy scales the
same application); each round sends `requests` requests from 16 client threads, each on its own keep-alive
connection (testing/load.py's run_level, as load_test.py), then `requests // 4` from 1 client. Cases: the demo request (397
tokens) on both models, and a 1,450-token request on the larger one (a quarter as many requests), where a
decision outweighs what Ray adds to each request. Reported: medians over the
rounds of throughput and p50/p99 latency, the ratio of 2 replicas' throughput to 1's (of the medians, and
round by round: each pair ran back to back, under the most similar machine load), the 1-minute load
average after each measurement, and the resident memory of each replica process, of the ingress and of
the rest of the Ray cluster. The plain `clef-gguf serve --threads 1` is measured the same way once per
model, as the reference for what Ray costs.

All of it shares the machine's cores with the 16 client threads (and with whatever else runs there):
quote the figures with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from clef_gguf.testing import ray_cluster  # first: the cluster it starts listens on loopback only

# isort: split
from ray import serve

import clef_gguf
from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST
from clef_gguf.server.ray_serve import APP_NAME, RaySettings, build_app
from clef_gguf.settings import LoadOptions, RayScale
from clef_gguf.testing.load import run_level, start_server
from clef_gguf.testing.processes import memory_mib
from clef_gguf.testing.release_builder import LARGER, build_release
from clef_gguf.testing.request_suite import long_state_request

CLIENTS = 16
CTX = 4096  # the requests are a few hundred tokens: a small KV cache keeps replicas small and quick to start


# case -> model, request body, share of --requests (long decisions: fewer requests, a similar duration)
CASES: dict[str, tuple[str, bytes, float]] = {
    "demo": ("demo", DEMO_REQUEST.read_bytes(), 1.0),  # 397 tokens
    "larger": ("larger", DEMO_REQUEST.read_bytes(), 1.0),
    "larger-long": ("larger", json.dumps(long_state_request(paragraphs=6)).encode(), 0.25),  # about 1,450 tokens
}


def larger_fixture(root: Path) -> Path:
    return clef_gguf.convert(build_release(root / "release", LARGER), root / "hidden256-8layers-f32.gguf", "f32")


def measure(port: int, body: bytes, requests: int) -> dict[str, float]:
    many = run_level(port, body, CLIENTS, requests, 120.0)
    one = run_level(port, body, 1, max(20, requests // 4), 60.0)
    assert many.errors == one.errors == 0, (many, one)
    return {
        "throughput_rps": many.throughput_rps,
        "p50_ms": many.p50_ms,
        "p99_ms": many.p99_ms,
        "p50_ms_1_client": one.p50_ms,
    }


def plain_reference(model: Path, body: bytes, requests: int) -> dict[str, float]:
    process, port = start_server(model, CTX, 64, 1)
    try:
        run_level(port, body, CLIENTS, 20, 30.0)  # warm
        figures = measure(port, body, requests)
        figures["rss_mib"] = memory_mib(process.pid)
        return figures
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)


def median_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(r[key] for r in rounds), 1) for key in rounds[0]}


def descendants_rss_mib(exclude: set[int]) -> float:
    """Resident memory of this process's descendants but `exclude`: the Ray cluster it started, less the replicas."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    family, grew = {os.getpid()}, True
    while grew:
        found = {pid for pid, parent in parents.items() if parent in family} - family
        family |= found
        grew = bool(found)
    return sum(memory_mib(pid) for pid in family - exclude - {os.getpid()} if Path(f"/proc/{pid}").exists())


def bench_model(name: str, model: Path, port: int, body: bytes, rounds: int, requests: int) -> dict[str, Any]:
    by_replicas: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    memory: dict[str, list[float]] = {}
    cluster_rss: list[float] = []
    for _ in range(rounds):
        for replicas in (1, 2):
            load, scale = LoadOptions(n_threads=1, max_prompt_tokens=CTX), RayScale(replicas=replicas)
            settings = RaySettings(model=str(model), load=load, scale=scale)
            serve.run(build_app(settings), name=APP_NAME, route_prefix="/")  # returns once every replica is healthy
            run_level(port, body, CLIENTS, 20, 30.0)  # warm: connections, the handle's router, first-call caches
            figures = measure(port, body, requests)
            figures["load_average_1min"] = os.getloadavg()[0]  # what else ran on the machine meanwhile
            by_replicas[replicas].append(figures)
            pids = ray_cluster.replica_pids()
            for deployment, replica in pids.items():
                memory.setdefault(deployment, []).extend(memory_mib(pid) for pid in replica)
            cluster_rss.append(descendants_rss_mib({pid for replica in pids.values() for pid in replica}))
            print(name, replicas, figures, file=sys.stderr, flush=True)
    one, two = median_of(by_replicas[1]), median_of(by_replicas[2])
    # Each round's 2 replicas against the 1 measured just before: the pairs saw the most similar machine load.
    paired = [b["throughput_rps"] / a["throughput_rps"] for a, b in zip(by_replicas[1], by_replicas[2], strict=True)]
    return {
        "model": name,
        "plain_server": {k: round(v, 1) for k, v in plain_reference(model, body, requests).items()},
        "replicas_1": one,
        "replicas_2": two,
        "throughput_ratio_2_to_1": round(two["throughput_rps"] / one["throughput_rps"], 2),
        "throughput_ratio_2_to_1_per_round": [round(r, 2) for r in paired],
        "throughput_ratio_2_to_1_median_of_rounds": round(statistics.median(paired), 2),
        "rss_mib_median": {deployment: round(statistics.median(values), 1) for deployment, values in memory.items()},
        "ray_cluster_rss_mib_median": round(statistics.median(cluster_rss), 1),  # GCS, raylet, controller, proxy, ...
        "rounds": rounds,
        "requests_per_level": requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of 1 and 2 replicas per model")
    parser.add_argument("--requests", type=int, default=300, help="requests per measurement at 16 clients")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"demo": DEMO_MODEL}
        if any(CASES[case][0] == "larger" for case in args.cases):
            models["larger"] = larger_fixture(Path(tmp))
        # Two replicas of one CPU each, and the ingress with none (it reads and tokenizes, on the cores left).
        with ray_cluster.local_cluster(num_cpus=2):
            port = ray_cluster.started_serve()  # (as `serve --ray` starts it: no access log in Ray's proxy)
            try:
                for case in args.cases:
                    model, body, share = CASES[case]
                    started = time.perf_counter()
                    requests = max(40, round(args.requests * share))
                    reports.append(bench_model(case, models[model], port, body, args.rounds, requests))
                    reports[-1]["seconds"] = round(time.perf_counter() - started)
                    serve.delete(APP_NAME)
            finally:
                serve.shutdown()
    report = {"cpus": os.cpu_count(), "load_average_at_end": os.getloadavg(), "clients": CLIENTS, "models": reports}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

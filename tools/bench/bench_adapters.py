"""Many fine-tunes over one base, against one merged model per fine-tune, at the default threads.

    python tools/bench/bench_adapters.py [--requests 160] [--clients 8] [--rank 64] [--type q4_k_m] [--out DIR]

On the benchmark fixture (release_builder.BENCHMARK: hidden 256, 8 layers), four PEFT fine-tunes of rank --rank
(default 4: Clef-flash's r 64 in proportion to its width; random LoRA on every linear clef-finetune targets, and a
head of their own) are converted twice: to adapter files
(f16) over one base file of --type, and to four merged files of --type. Then, in one run:

- throughput and p99 of --clients clients spread over the 4 adapters of one server, against the same clients on one
  merged model's server (distinct states, so that the state cache does not answer);
- the cost of an adapter switch: one request at a time in process, alternating two adapters against one adapter;
- resident memory of one server with the 4 adapters, against 4 servers of the merged files.

The files are built in a child process (torch's threads would stay alive in this one: testing/fixture_files.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from clef_gguf.testing.processes import HOST, free_port, memory_mib, percentile, wait_healthy

NAMES = ("routing", "triage", "moderation", "urgency")
TICKET = "My order #{n} arrived broken and the courier left it in the rain; I want a refund or a replacement today."
QUESTIONS = {
    "complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
    "intent": {"type": "choice", "criteria": {"refund": "Money back", "replacement": None, "information": None}},
    "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
}


def build(out: Path, rank: int, file_type: str) -> None:
    """(in a child) The fixture release, its base file, 4 fine-tunes as adapters and as merged files."""
    import clef_gguf
    from clef_gguf.conversion.adapter import convert_adapter
    from clef_gguf.testing.finetune import peft_checkpoint
    from clef_gguf.testing.release_builder import BENCHMARK, build_release

    release = build_release(out / "release", BENCHMARK)
    clef_gguf.convert(release, out / "base.gguf", file_type, mmproj=False)
    linears = "q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj|gate_proj|up_proj|down_proj"
    targets = rf".*language_model.*\.({linears})"  # every linear clef-finetune targets (discover_lora_targets)
    for i, name in enumerate(NAMES):
        lora = {"r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
        checkpoint = peft_checkpoint(release, out / name, lora, {"prior_logit_scale": 0.1 * (i + 1)}, seed=i)
        convert_adapter(checkpoint, release, out / f"{name}.adapter.gguf", "f16")
        clef_gguf.convert(checkpoint, out / f"{name}-merged.gguf", file_type, base=release, mmproj=False)


def body(n: int, model: str | None) -> bytes:
    request = {"state": {"ticket": TICKET.format(n=n)}, "questions": QUESTIONS} | ({"model": model} if model else {})
    return json.dumps(request).encode()


def clients(port: int, requests: int, n_clients: int, model_of) -> dict[str, float]:
    """n_clients threads, each on a keep-alive connection, sending requests//n_clients distinct requests."""
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        connection = http.client.HTTPConnection(HOST, port, timeout=600)
        for k in range(requests // n_clients):
            n = c * 100_000 + k
            started = time.perf_counter()
            connection.request("POST", "/v1/systemone", body(n, model_of(c)), {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            with lock:
                latencies.append(time.perf_counter() - started)
                errors[0] += response.status != 200
        connection.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    return {
        "rps": len(latencies) / seconds,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "errors": errors[0],
    }


def server(stack: ExitStack, model: Path, *args: str) -> tuple[int, int]:
    """`clef-gguf serve MODEL ARGS` at its default threads: (port, pid)."""
    port = free_port()
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(model), "--port", str(port), "--ctx", "2048", *args]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(process.wait, 60)
    stack.callback(process.terminate)
    wait_healthy(f"http://{HOST}:{port}", process, 300)
    return port, process.pid


def switch_cost(out: Path, rounds: int) -> dict[str, float]:
    """One request at a time in process (state cache off): two requests alternating two adapters, against both to
    one adapter (the median difference is what a switch costs), and both to the base (what the unmerged LoRA's
    products cost)."""
    import clef_gguf

    adapters = {n: out / f"{n}.adapter.gguf" for n in NAMES[:2]}
    with clef_gguf.load(out / "base.gguf", max_prompt_tokens=2048, adapters=adapters, state_cache=0) as model:
        timed: dict[str, list[float]] = {"one": [], "two": [], "base": []}
        for r in range(rounds):
            for kind, names in (("one", NAMES[:1] * 2), ("two", NAMES[:2]), ("base", [None, None])):
                for i, name in enumerate(names):
                    started = time.perf_counter()
                    model.decide(json.loads(body(2 * r + i, name)))
                    timed[kind].append(time.perf_counter() - started)
    one, two, base = (statistics.median(timed[k]) * 1e3 for k in ("one", "two", "base"))
    return {"base_ms": base, "one_adapter_ms": one, "alternating_ms": two, "switch_ms": two - one}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--clients", type=int, default=8)
    # Clef-flash's r 64 is 1/64 of its hidden size 4096; on this fixture's 256 that is r 4. Its r 64 (a quarter of
    # the width) makes the unmerged products a third of the layers' work: a bound, not what Clef-flash pays.
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--type", default="q4_k_m")
    parser.add_argument("--rounds", type=int, default=20, help="switch cost: rounds of two requests each way")
    parser.add_argument("--out", type=Path, help="keep the files here (default: a temporary folder)")
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)  # (the child)
    args = parser.parse_args()
    if args.build:
        build(args.build, args.rank, args.type)
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    if not (out / "base.gguf").exists():
        subprocess.run([sys.executable, __file__, "--build", str(out), "--rank", str(args.rank), "--type", args.type], check=True)
    report: dict[str, object] = {"rank": args.rank, "type": args.type, "clients": args.clients, "requests": args.requests}
    pairs = [arg for n in NAMES for arg in ("--adapter", f"{n}={out / f'{n}.adapter.gguf'}")]
    with ExitStack() as stack:
        port, pid = server(stack, out / "base.gguf", *pairs)
        clients(port, args.clients * 2, args.clients, lambda c: NAMES[c % 4])  # warm: every adapter loaded once
        rss = memory_mib(pid)
        report["adapters_4"] = clients(port, args.requests, args.clients, lambda c: NAMES[c % 4]) | {"rss_mib": rss}
    with ExitStack() as stack:
        port, pid = server(stack, out / f"{NAMES[0]}-merged.gguf")
        clients(port, args.clients * 2, args.clients, lambda c: None)
        report["merged_1"] = clients(port, args.requests, args.clients, lambda c: None)
    with ExitStack() as stack:
        started = [server(stack, out / f"{n}-merged.gguf") for n in NAMES]
        for port, _ in started:
            clients(port, 2, 1, lambda c: None)  # warm, as the adapters' server was
        report["merged_4_servers_rss_mib"] = sum(memory_mib(pid) for _, pid in started)
    report["switch"] = switch_cost(out, args.rounds)
    a, m = report["adapters_4"], report["merged_1"]
    report["ratios"] = {
        "throughput_adapters_over_merged": a["rps"] / m["rps"],  # type: ignore[index]
        "p99_adapters_over_merged": a["p99_ms"] / m["p99_ms"],  # type: ignore[index]
        "rss_one_server_over_four": a["rss_mib"] / report["merged_4_servers_rss_mib"],  # type: ignore[index,operator]
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

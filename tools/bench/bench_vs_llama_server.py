"""clef-gguf serve against llama.cpp's own llama-server: the same file, side by side.

Both servers load the very same Clef GGUF (the format is llama.cpp's), on loopback, with the
same thread count; the requests are interleaved (one to each server in turn, the order
alternating by round) and the medians of the HTTP round trips are reported with the median
of the rounds' ratios. Each server is sent its requests over one kept-alive connection, as the Clef clients
do (typesafe-sdk, clef-rag, clef-evals, clef-compactor and clef-router all hold an httpx
client).
llama-server's Clef graph has no memory, so its physical batch is the whole prompt (-c = -b =
-ub); clef-gguf runs at its defaults (ubatches of 1024). Both place the weights alike: ggml's repacked
CPU layouts, but neither where the CPU has AMX (clef-gguf's placement, llama/cpu_buffers.py; llama-server
with --no-repack there, without which it aborts on a Q4_K_M file).

Requests: the demo request (a ticket with 3 questions) and long states with the 3 questions
at about 2k, 8k and 32k tokens (the 32k one with --long-rounds rounds: a round takes a minute;
llama-server cannot take it: its Clef graph needs the prompt in one physical batch, and it aborts
at start-up with one of 32,768 tokens or more, so it runs at its largest, 28,672, and the row
shows what it answers),
NFC and with instructions (where llama-server departs from the
reference it is not measured here; see tools/interop_llama_server.py for agreement). Then
"~8k, state repeated": the ~8k state with a new 3-question schema each round, which
clef-gguf answers from its state cache (prefilling only the schema) and llama-server, which
has no such cache, cold. In the other rows every round's state is new (new_state), so both
servers prefill all of it.

Before each request (and each round of concurrent requests) the tool waits --gap seconds (0.1):
llama.cpp's OpenMP threads keep spinning after a graph (libgomp's default wait policy: up to
300,000 spins), and a request sent at once after the other server's would share its cores with
them, as it never does when its server has the machine to itself.

Then "clients": the ticket from 1, 4 and 8 concurrent clients (--clients), each over its own kept-alive
connection and every request about a state of its own, against clef-gguf (which batches the requests
that wait) and llama-server at -np 1 and at -np 4 (its slots: up to 4 requests decoded together). The
servers take turns, one round each, --concurrency-rounds rounds of --concurrency-requests requests;
the row gives requests per second (the median round's), and p50 and p99 of the round trips.

    bash tools/build_llama_server.sh         # once
    python tools/bench/bench_vs_llama_server.py [--types f32 q8_0 q4_k_m] [--rounds 7] [--short-rounds 21]
                                          [--long-rounds 3] [--threads N] [--requests ticket ... clients]
                                          [--clients 1 4 8] [--out FILE]

--threads defaults to clef-gguf's default (the physical cores this process may use), for both servers.
Writes docs/benchmarks/vs_llama_server.md (the table), .json (every round's times) and .png (the
ratios by size), and prints the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from clef_gguf.testing.bench import cpu_name
from clef_gguf.testing.llama_server import as_llama_server_accepts
from clef_gguf.testing.processes import free_port, percentile, wait_healthy
from clef_gguf.testing.servers import (
    LLAMA_SERVER_MAX_BATCH,
    Client,
    new_state,
    requests_by_size,
    start_clef_gguf,
    start_llama_server,
)

ROOT = Path(__file__).resolve().parents[2]


def repeated_state(request: dict[str, Any], round_: int) -> dict[str, Any]:
    """The request's state with a schema of its own: new ids and instructions each round."""
    questions = {
        f"{qid}_{round_}": {**q, "instructions": f"{q.get('instructions') or qid} ({round_})"}
        for qid, q in request["questions"].items()
    }
    return as_llama_server_accepts({**request, "questions": questions})


def paired_ratio(times: dict[str, list[float]]) -> float:
    """The median of each round's ratio, clef-gguf's time over llama-server's: the two requests of a round are sent
    back to back, so they share the machine's state, which on a shared machine drifts more than they differ."""
    return statistics.median(a / b for a, b in zip(times["ours"], times["theirs"], strict=True))


def concurrent_round(url: str, request: dict[str, Any], clients: int, total: int, first_state: int) -> tuple[float, list[float]]:
    """`total` requests from `clients` concurrent clients (each its own kept-alive connection), every one about a
    state of its own: seconds for all, and each round trip's seconds."""
    counter = iter(range(first_state, first_state + total))
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[BaseException] = []

    def client() -> None:
        connection = Client(url)
        try:
            while True:
                with lock:
                    state = next(counter, None)
                if state is None:
                    return
                seconds, _ = connection.post(new_state(request, state))
                with lock:
                    latencies.append(seconds)
        except BaseException as e:  # noqa: BLE001 (re-raised in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return elapsed, latencies


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", type=Path, default=Path.home() / ".cache/clef-gguf/llama-build/bin")
    parser.add_argument("--types", nargs="+", default=["f32", "q8_0", "q4_k_m"])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the ~8k requests")
    parser.add_argument("--short-rounds", type=int, default=21, help="rounds of the ticket and ~2k requests")
    parser.add_argument("--long-rounds", type=int, default=3, help="rounds of the ~32k request")
    parser.add_argument("--threads", type=int, default=None, help="both servers' threads (default: clef-gguf's)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8], help="concurrent clients of the clients rows")
    parser.add_argument(
        "--gap",
        type=float,
        default=0.1,
        help="seconds of quiet before each request (or round) to the other server: its threads' spinning dies out first",
    )
    parser.add_argument("--concurrency-rounds", type=int, default=3)
    parser.add_argument("--concurrency-requests", type=int, default=48, help="requests per round of a clients row")
    rows_by_name = ["ticket", "~2k", "~8k", "~32k", "repeated", "clients"]
    parser.add_argument("--requests", nargs="+", choices=rows_by_name, default=rows_by_name, help="the rows to run")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "vs_llama_server.md")
    args = parser.parse_args()
    if not (args.bin / "llama-server").is_file():
        raise SystemExit(f"no llama-server in {args.bin}: run `bash tools/build_llama_server.sh` first")
    if importlib.util.find_spec("matplotlib") is None:  # refused now, not after minutes of measuring
        raise SystemExit("the plot needs matplotlib: pip install -e '.[bench]'")
    return args


Row = tuple[str, str, int, float, float | None, float | None]  # type, request, tokens, ours, theirs, ratio
Concurrency = tuple[str, int, str, float, float, float]  # type, clients, server, req/s, p50, p99


class Run:
    """Every measurement of one run: the table's rows, the clients rows, and every round's seconds (the .json)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows: list[Row] = []
        self.concurrency: list[Concurrency] = []
        self.raw: list[dict[str, Any]] = []

    def one_at_a_time(self, file_type: str, clients: dict[str, Client], name: str, request: dict[str, Any]) -> None:
        """`request` (a new state each round) to both servers in turn; clef-gguf alone where llama-server cannot."""
        args = self.args
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        _, answer = clients["ours"].post(new_state(request, -1))  # warm-up, and the token count
        tokens = answer["usage"]["input_tokens"]
        servers = ["ours", "theirs"]
        if tokens > LLAMA_SERVER_MAX_BATCH:  # a prompt llama-server cannot take: clef-gguf alone
            servers = servers[:1]
            refusal = clients["theirs"].status(new_state(request, -1))
        else:
            clients["theirs"].post(new_state(request, -1))
        short = name in ("ticket", "~2k")
        for r in range(args.short_rounds if short else args.long_rounds if name == "~32k" else args.rounds):
            for who in servers[:: 1 if r % 2 == 0 else -1]:
                time.sleep(args.gap)
                times[who].append(clients[who].post(new_state(request, r))[0])
        a = statistics.median(times["ours"])
        b = statistics.median(times["theirs"]) if times["theirs"] else None
        ratio = paired_ratio(times) if b else None
        self.rows.append((file_type, name, tokens, a, b, ratio))
        self.raw.append({"type": file_type, "request": name, "tokens": tokens, **times})
        theirs_text = f"{b * 1e3:.0f} ms ({ratio:.2f})" if b else f"llama-server: {refusal}"
        print(f"{file_type} {name}: {a * 1e3:.0f} ms vs {theirs_text}", flush=True)

    def with_clients(self, file_type: str, urls: dict[str, str], ticket: dict[str, Any]) -> None:
        """The ticket from each number of concurrent clients, every server in turn, a state per request."""
        args = self.args
        for n_clients in args.clients:
            for url in urls.values():  # warm-up: every server at this concurrency once
                concurrent_round(url, ticket, n_clients, n_clients, 10**6)
            per_server: dict[str, list[tuple[float, list[float]]]] = {name: [] for name in urls}
            for r in range(args.concurrency_rounds):
                for name in list(urls) if r % 2 == 0 else list(urls)[::-1]:
                    first = 10**7 * (r + 1) + 10**5 * n_clients
                    time.sleep(args.gap)
                    per_server[name].append(concurrent_round(urls[name], ticket, n_clients, args.concurrency_requests, first))
            for name, results in per_server.items():
                rate = statistics.median(len(lat) / elapsed for elapsed, lat in results)
                latencies = [x for _, lat in results for x in lat]
                p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
                self.concurrency.append((file_type, n_clients, name, rate, p50, p99))
                self.raw.append({"type": file_type, "clients": n_clients, "server": name, "rounds": results})
                print(
                    f"{file_type} {n_clients} clients, {name}: {rate:.2f} req/s, p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms"
                )

    def repeated(self, file_type: str, clients: dict[str, Client], long: dict[str, Any]) -> None:
        """The ~8k state again, each round with a new schema: clef-gguf has kept it after its first request."""
        clients["ours"].post(long)
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        for r in range(self.args.rounds):
            request = repeated_state(long, r)
            for who in ["ours", "theirs"][:: 1 if r % 2 == 0 else -1]:
                time.sleep(self.args.gap)
                seconds, answer = clients[who].post(request)
                times[who].append(seconds)
                if who == "ours" and not answer["usage"]["input_tokens_details"]["cached_tokens"]:
                    raise SystemExit("clef-gguf did not reuse the repeated state: is its state cache on?")
        a, b, ratio = statistics.median(times["ours"]), statistics.median(times["theirs"]), paired_ratio(times)
        name, tokens = "~8k, state repeated", answer["usage"]["input_tokens"]
        self.rows.append((file_type, name, tokens, a, b, ratio))
        self.raw.append({"type": file_type, "request": name, "tokens": tokens, **times})
        print(f"{file_type} {name}: {a * 1e3:.0f} ms vs {b * 1e3:.0f} ms ({ratio:.2f})", flush=True)

    def file(self, file_type: str, path: Path, root: Path, requests: dict[str, dict[str, Any]]) -> None:
        """Every row asked for, on one file: clef-gguf, llama-server -np 1, and -np 4 for the clients rows."""
        args = self.args
        urls = {name: f"http://127.0.0.1:{free_port()}" for name in ("clef-gguf", "llama-server -np 1", "llama-server -np 4")}
        if "clients" not in args.requests:  # (-np 4: its slots decode up to 4 requests together)
            del urls["llama-server -np 4"]
        processes = [start_clef_gguf(path, urls["clef-gguf"], args.threads, root / f"ours-{file_type}.log")]
        for slots in (1, 4)[: len(urls) - 1]:
            log = root / f"theirs-np{slots}-{file_type}.log"
            processes.append(start_llama_server(args.bin, path, urls[f"llama-server -np {slots}"], args.threads, slots, log))
        try:
            for url, process in zip(urls.values(), processes, strict=True):
                wait_healthy(url, process)
            clients = {"ours": Client(urls["clef-gguf"]), "theirs": Client(urls["llama-server -np 1"])}
            for name, request in requests.items():
                if name in args.requests:
                    self.one_at_a_time(file_type, clients, name, request)
            if "clients" in args.requests:
                self.with_clients(file_type, urls, requests["ticket"])
            if "repeated" in args.requests:
                self.repeated(file_type, clients, requests["~8k"])
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=60)

    def table(self) -> list[str]:
        args = self.args
        lines = [
            "# clef-gguf serve vs llama-server (same file, same threads)",
            "",
            f"`python tools/bench/bench_vs_llama_server.py --types {' '.join(args.types)} --requests {' '.join(args.requests)} "
            f"--rounds {args.rounds} --short-rounds {args.short_rounds} --long-rounds {args.long_rounds} "
            f"--threads {args.threads} --gap {args.gap}"
            + (f" --clients {' '.join(map(str, args.clients))}" if self.concurrency else "")
            + "`: fixture hidden 256,",
            "8 layers, head 128 wide (6 + 3 layers); HTTP round trips on loopback over one kept-alive connection",
            "to each server, interleaved, medians; ratio: the median of the rounds' ratios.",
            f"Machine: {cpu_name() or 'unknown CPU'}, {os.cpu_count()} logical CPUs; {time.strftime('%Y-%m-%d')}.",
            "",
            "| type | request | tokens | clef-gguf | llama-server | ratio |",
            "|---|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {t} | {n} | {k} | {a * 1e3:.0f} ms | " + (f"{b * 1e3:.0f} ms | {r:.2f} |" if b else "cannot (over 28,672) | - |")
            for t, n, k, a, b, r in self.rows
        ]
        if not self.concurrency:
            return lines
        lines += [
            "",
            f"Concurrent clients, the ticket, each request about a state of its own: {args.concurrency_rounds} rounds of "
            f"{args.concurrency_requests} requests per server, the servers taking turns; the median round's requests/s, and the",
            "round trips' p50 and p99 over all rounds. Ratio: clef-gguf's throughput over the better llama-server's.",
            "",
            "| type | clients | clef-gguf req/s | p50 / p99 | llama-server -np 1 | p50 / p99 | -np 4 | p50 / p99 | ratio |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for t, n in dict.fromkeys((t, n) for t, n, *_ in self.concurrency):
            by = {server: (rate, p50, p99) for tt, nn, server, rate, p50, p99 in self.concurrency if (tt, nn) == (t, n)}
            cells = [f"{r:.2f} | {a * 1e3:.0f} / {b * 1e3:.0f} ms" for r, a, b in by.values()]
            best = max(by["llama-server -np 1"][0], by["llama-server -np 4"][0])
            lines.append(f"| {t} | {n} | " + " | ".join(cells) + f" | {by['clef-gguf'][0] / best:.2f} |")
        return lines


def main() -> None:
    args = parse_args()
    from clef_gguf.llama.threads import default_threads
    from clef_gguf.testing.fixture_files import benchmark_files

    args.threads = args.threads or default_threads()
    run = Run(args)
    with tempfile.TemporaryDirectory() as tmp:
        for file_type, path in benchmark_files(Path(tmp), args.types).items():  # built in a child: no torch threads here
            run.file(file_type, path, Path(tmp), requests_by_size())
    lines = run.table()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(run.raw, indent=1) + "\n")
    plot(run.rows, run.concurrency, args.out.with_suffix(".png"), args.threads)
    print("\n".join(lines))


def plot(rows: list[Row], concurrency: list[Concurrency], out: Path, threads: int) -> None:
    """Left: clef-gguf / llama-server by prompt size, one line per type, the repeated state as a marker. Right (with
    clients rows): requests per second by concurrent clients, one line per server and type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if concurrency else 1, figsize=(12 if concurrency else 7, 4.2), squeeze=False)
    ax = axes[0][0]
    for file_type in dict.fromkeys(t for t, *_ in rows):  # (rows: type, request, tokens, ours, theirs, ratio)
        cold = [(k, r) for t, n, k, a, b, r in rows if t == file_type and "repeated" not in n and b]
        line = ax.plot([k for k, _ in cold], [r for _, r in cold], marker="o", label=f"{file_type}, cold")[0]
        warm = [(k, r) for t, n, k, a, b, r in rows if t == file_type and "repeated" in n]
        ax.plot(
            [k for k, _ in warm],
            [r for _, r in warm],
            marker="*",
            markersize=12,
            ls="",
            color=line.get_color(),
            label=f"{file_type}, ~8k state repeated",
        )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("clef-gguf / llama-server (median of rounds' ratios)")
    ax.set_title(f"one request at a time, {threads} thread(s)")
    ax.legend(fontsize=8)
    if concurrency:
        ax = axes[0][1]
        for file_type, server in dict.fromkeys((t, s) for t, _, s, *_ in concurrency):
            points = [(n, rate) for t, n, s, rate, *_ in concurrency if (t, s) == (file_type, server)]
            style = "-" if server == "clef-gguf" else "--" if "-np 1" in server else ":"
            ax.plot([n for n, _ in points], [r for _, r in points], style, marker="o", label=f"{server}, {file_type}")
        ax.set_xlabel("concurrent clients (the ticket, a state each)")
        ax.set_ylabel("requests / s (median round)")
        ax.set_title(f"throughput, {threads} thread(s)")
        ax.legend(fontsize=7)
    fig.suptitle("clef-gguf serve vs llama-server, the same file")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()

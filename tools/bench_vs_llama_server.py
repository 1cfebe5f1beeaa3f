"""clef-gguf serve against llama.cpp's own llama-server: the same file, side by side.

Both servers load the very same Clef GGUF (the format is llama.cpp's), on loopback, with the
same thread count; the requests are interleaved (one to each server in turn, the order
alternating by round) and the medians of the HTTP round trips are reported with their
ratio. Each server is sent its requests over one kept-alive connection, as the Clef clients
do (typesafe-sdk, clef-rag, clef-evals, clef-compactor and clef-router all hold an httpx
client).
llama-server's Clef graph has no memory, so its physical batch is the whole prompt (-c = -b =
-ub); clef-gguf runs at its defaults (ubatches of 1024).

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

    bash tools/build_llama_server.sh         # once
    python tools/bench_vs_llama_server.py [--types f32 q8_0 q4_k_m] [--rounds 7] [--short-rounds 21]
                                          [--long-rounds 3] [--threads 1] [--requests ticket ...] [--out FILE]

Writes docs/benchmarks/vs_llama_server.md (the table), .json (every round's times) and .png (the
ratios by size), and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from http.client import HTTPConnection, RemoteDisconnected
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LLAMA_SERVER_MAX_BATCH = 28672  # the largest -c = -b = -ub llama-server starts with for qwen35 (32768 aborts)

from interop_llama_server import as_llama_server_accepts  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"a server exited ({process.returncode}) before it was healthy: {url}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url} did not come up")


class Client:
    """A kept-alive HTTP connection to one server (reopened should the server close it)."""

    def __init__(self, url: str) -> None:
        self.host, _, port = url.removeprefix("http://").partition(":")
        self.port = int(port)
        self.connection = HTTPConnection(self.host, self.port, timeout=900)

    def send(self, request: dict[str, Any]) -> tuple[float, int, bytes]:
        body = json.dumps(request).encode()
        for attempt in (1, 2):
            started = time.perf_counter()
            try:
                self.connection.request("POST", "/v1/systemone", body, {"Content-Type": "application/json"})
                response = self.connection.getresponse()
                data = response.read()
                break
            except (ConnectionError, RemoteDisconnected):  # closed by the server since the last request
                self.connection.close()
                if attempt == 2:
                    raise
        seconds = time.perf_counter() - started
        if response.getheader("connection", "").lower() == "close":
            self.connection.close()
        return seconds, response.status, data

    def post(self, request: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        seconds, status, data = self.send(request)
        if status != 200:
            raise SystemExit(f"HTTP {status} from {self.host}:{self.port}: {data[:300].decode('utf-8', 'replace')}")
        return seconds, json.loads(data)

    def status(self, request: dict[str, Any]) -> str:
        """What the server answers a request it is expected to refuse: its status and message."""
        _, status, data = self.send(request)
        return "answered" if status == 200 else f"HTTP {status} {data.decode('utf-8', 'replace')[:160]}"


def requests_by_size() -> dict[str, dict[str, Any]]:
    from clef_gguf.testing.request_suite import long_state_text

    demo = json.loads((ROOT / "clef_gguf" / "data" / "demo_request.json").read_text())
    out = {"ticket": demo}
    for label, paragraphs in (("~2k", 11), ("~8k", 46), ("~32k", 184)):
        request = copy.deepcopy(demo)
        request["state"] = {"ticket": long_state_text(paragraphs), "customer_tier": "gold"}
        out[label] = request
    return {name: as_llama_server_accepts(r) for name, r in out.items()}


def new_state(request: dict[str, Any], round_: int) -> dict[str, Any]:
    """The request about a state of its own (one more key, first in the prompt's sorted JSON), so that every
    round is cold for clef-gguf's state cache too: the same body goes to both servers."""
    return {**request, "state": {"case": round_, **request["state"]}}


def repeated_state(request: dict[str, Any], round_: int) -> dict[str, Any]:
    """The request's state with a schema of its own: new ids and instructions each round."""
    questions = {
        f"{qid}_{round_}": {**q, "instructions": f"{q.get('instructions') or qid} ({round_})"}
        for qid, q in request["questions"].items()
    }
    return as_llama_server_accepts({**request, "questions": questions})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", type=Path, default=Path.home() / ".cache/clef-gguf/llama-build/bin")
    parser.add_argument("--types", nargs="+", default=["f32", "q8_0", "q4_k_m"])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the ~8k requests")
    parser.add_argument("--short-rounds", type=int, default=21, help="rounds of the ticket and ~2k requests")
    parser.add_argument("--long-rounds", type=int, default=3, help="rounds of the ~32k request")
    parser.add_argument("--threads", type=int, default=1)
    rows_by_name = ["ticket", "~2k", "~8k", "~32k", "repeated"]
    parser.add_argument("--requests", nargs="+", choices=rows_by_name, default=rows_by_name, help="the rows to run")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "vs_llama_server.md")
    args = parser.parse_args()
    if not (args.bin / "llama-server").is_file():
        raise SystemExit(f"no llama-server in {args.bin}: run `bash tools/build_llama_server.sh` first")

    import clef_gguf
    from clef_gguf.testing.release_builder import BENCHMARK, build_release

    requests = requests_by_size()
    rows = []
    raw: list[dict[str, Any]] = []  # every round's seconds, for the .json
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        release = build_release(root / "release", BENCHMARK)
        for file_type in args.types:
            path = clef_gguf.convert(release, root / f"bench-{file_type}.gguf", file_type)
            ours_url, theirs_url = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
            ours = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "clef_gguf.cli",
                    "serve",
                    str(path),
                    "--port",
                    ours_url.rsplit(":", 1)[1],
                    "--threads",
                    str(args.threads),
                ],
                stdout=subprocess.DEVNULL,
                stderr=(root / f"ours-{file_type}.log").open("w"),
            )
            # llama-server's Clef graph has no memory: a prompt is one physical batch, and above 28,672 tokens
            # it aborts at start-up (GGML_ASSERT(ctx->mem_buffer != NULL), ggml.c:1644; measured at 32,768).
            ctx = str(LLAMA_SERVER_MAX_BATCH)
            theirs = subprocess.Popen(
                [
                    str(args.bin / "llama-server"),
                    "-m",
                    str(path),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    theirs_url.rsplit(":", 1)[1],
                    "-c",
                    ctx,
                    "-b",
                    ctx,
                    "-ub",
                    ctx,
                    "-t",
                    str(args.threads),
                    "--no-repack",
                ],
                stdout=subprocess.DEVNULL,
                stderr=(root / f"theirs-{file_type}.log").open("w"),
            )
            try:
                wait_healthy(ours_url, ours)
                wait_healthy(theirs_url, theirs)
                clients = {"ours": Client(ours_url), "theirs": Client(theirs_url)}
                for name, request in ((n, r) for n, r in requests.items() if n in args.requests):
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
                            times[who].append(clients[who].post(new_state(request, r))[0])
                    a = statistics.median(times["ours"])
                    b = statistics.median(times["theirs"]) if times["theirs"] else None
                    rows.append((file_type, name, tokens, a, b))
                    raw.append({"type": file_type, "request": name, "tokens": tokens, **times})
                    theirs_text = f"{b * 1e3:.0f} ms ({a / b:.2f})" if b else f"llama-server: {refusal}"
                    print(f"{file_type} {name}: {a * 1e3:.0f} ms vs {theirs_text}", flush=True)
                if "repeated" not in args.requests:
                    continue
                # The ~8k state again, each round with a new schema: clef-gguf has kept it after its first request.
                clients["ours"].post(requests["~8k"])
                times = {"ours": [], "theirs": []}
                for r in range(args.rounds):
                    request = repeated_state(requests["~8k"], r)
                    for who in ["ours", "theirs"][:: 1 if r % 2 == 0 else -1]:
                        seconds, answer = clients[who].post(request)
                        times[who].append(seconds)
                        if who == "ours" and not answer["usage"]["input_tokens_details"]["cached_tokens"]:
                            raise SystemExit("clef-gguf did not reuse the repeated state: is its state cache on?")
                a, b = statistics.median(times["ours"]), statistics.median(times["theirs"])
                name = "~8k, state repeated"
                rows.append((file_type, name, answer["usage"]["input_tokens"], a, b))
                raw.append({"type": file_type, "request": name, "tokens": answer["usage"]["input_tokens"], **times})
                print(f"{file_type} {name}: {a * 1e3:.0f} ms vs {b * 1e3:.0f} ms ({a / b:.2f})", flush=True)
            finally:
                for process in (ours, theirs):
                    process.terminate()
                    process.wait(timeout=60)
    lines = [
        "# clef-gguf serve vs llama-server (same file, same threads)",
        "",
        f"`python tools/bench_vs_llama_server.py --types {' '.join(args.types)} --requests {' '.join(args.requests)} "
        f"--rounds {args.rounds} --short-rounds {args.short_rounds} --long-rounds {args.long_rounds} "
        f"--threads {args.threads}`: fixture hidden 256,",
        "8 layers, head 128 wide (6 + 3 layers); HTTP round trips on loopback over one kept-alive connection",
        "to each server, interleaved, medians.",
        f"Machine: {cpu_name()}, {os.cpu_count()} logical CPUs; {time.strftime('%Y-%m-%d')}.",
        "",
        "| type | request | tokens | clef-gguf | llama-server | ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {t} | {n} | {k} | {a * 1e3:.0f} ms | " + (f"{b * 1e3:.0f} ms | {a / b:.2f} |" if b else "cannot (over 28,672) | - |")
        for t, n, k, a, b in rows
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print("\n".join(lines))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def plot(rows: list[tuple[str, str, int, float, float | None]], out: Path) -> None:
    """clef-gguf / llama-server by prompt size, one line per type; the repeated state as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for file_type in dict.fromkeys(t for t, *_ in rows):
        cold = [(k, a / b) for t, n, k, a, b in rows if t == file_type and "repeated" not in n and b]
        line = ax.plot([k for k, _ in cold], [r for _, r in cold], marker="o", label=f"{file_type}, cold")[0]
        warm = [(k, a / b) for t, n, k, a, b in rows if t == file_type and "repeated" in n]
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
    ax.set_ylabel("clef-gguf / llama-server (median round trip)")
    ax.set_title("clef-gguf serve vs llama-server, same file, 1 thread")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()

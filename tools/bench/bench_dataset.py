"""Records per second of `clef-gguf decide` on a JSON Lines dataset against the same records sent one at a time
over HTTP to `clef-gguf serve`, as clef-evals sends them (Workers AI's route, one kept-alive connection), by
clef-evals itself (its ClefJudge, one judge_choice a record), and to llama-server's /v1/systemone on the same
file (when built: tools/build_llama_server.sh), in one run. Each HTTP method gets a fresh serve.

The dataset is in clef-evals' shape (clef_evals.models.build_payload: a state and one choice question), --count
records of which half are about 20 states (each about 350 tokens: past the state cache's 256-token minimum) and
half about a state of their own, shuffled (seeded). Each side runs --rounds times, taking turns; the row gives the
median records/s of each and the median of the rounds' ratios. decide runs twice: in input order and with
--sort-by-state.

    python tools/bench/bench_dataset.py [MODEL.gguf] [--count 1000] [--rounds 3] [--out docs/benchmarks/dataset.json]
                                  [--bin ~/.cache/clef-gguf/llama-build/bin]

Without MODEL: the bundled demo model (tiny, random weights: the ratios are the point, not the rates).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from http.client import HTTPConnection
from pathlib import Path

from clef_evals import Choice, ClefJudge
from clef_evals.models import build_payload

from clef_gguf.data import DEMO_MODEL
from clef_gguf.llama.threads import default_threads
from clef_gguf.testing.llama_server import as_llama_server_accepts
from clef_gguf.testing.processes import free_port, wait_healthy

CRITERIA = {"billing": "Payments and refunds.", "technical": "Bugs and outages.", "sales": "Pricing and plans."}
ACCOUNT = "0123456789abcdef0123456789abcdef"
ROUTE = f"/client/v4/accounts/{ACCOUNT}/ai/run/@cf/cloudflare/clef"
JUDGE = "_judge"  # a record's state and question as clef-evals' ClefJudge takes them; not in the JSONL


def body_of(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("id", JUDGE)}


def _state(rng: random.Random, n: int) -> str:
    words = ["order", "refund", "outage", "invoice", "price", "login", "broken", "charged", "plan", "support"]
    return f"Ticket {n}: " + " ".join(rng.choice(words) for _ in range(90))


def dataset(count: int, seed: int = 26) -> list[dict]:
    rng = random.Random(seed)
    shared = [_state(rng, n) for n in range(20)]
    records = []
    for i in range(count):
        state = shared[i % 20] if i % 2 == 0 else _state(rng, 100 + i)
        question = rng.choice(["Which team should handle this?", "Where does this ticket go?", "Who answers this?"])
        payload = build_payload("clef", state, {"decision": Choice(question, CRITERIA)})
        records.append({"id": f"r{i}", **payload, JUDGE: [state, question]})
    rng.shuffle(records)
    return records


def run_decide(model: Path, source: Path, out: Path, sort: bool) -> float:
    args = [sys.executable, "-m", "clef_gguf.cli", "decide", "--ctx", "4096", str(model), str(source), "-o", str(out), "--force"]
    run = subprocess.run([*args, "--json", *(["--sort-by-state"] if sort else [])], capture_output=True, text=True, check=False)
    if run.returncode not in (0, 8):
        raise SystemExit(run.stderr)
    return json.loads(run.stdout)["records_per_s"]  # (decisions alone: the load is not counted)


def run_http(port: int, records: list[dict], route: str = ROUTE, prepare: Callable[[dict], dict] = lambda r: r) -> float:
    bodies = [json.dumps(prepare(body_of(r))).encode() for r in records]
    connection = HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    for body in bodies:
        connection.request("POST", route, body, {"Content-Type": "application/json", "Authorization": "Bearer local"})
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            raise SystemExit(f"HTTP {response.status}")
    connection.close()
    return len(records) / (time.perf_counter() - started)


def run_serve(model: Path, records: list[dict], client: Callable[[int, list[dict]], float]) -> float:
    """The records over HTTP to a `clef-gguf serve` of their own: its state cache starts empty, as decide's does
    (a server kept across rounds would answer every later round from its cache)."""
    port = free_port()
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(model), "--port", str(port), "--ctx", "4096"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        return client(port, records)
    finally:
        server.terminate()
        server.wait()


def run_clef_evals(port: int, records: list[dict]) -> float:
    """clef-evals itself: its ClefJudge, configured as its README says, judging each record's choice."""
    os.environ.update(CLEF_BASE_URL=f"http://127.0.0.1:{port}/client/v4", CLEF_ACCOUNT_ID=ACCOUNT, CLEF_API_TOKEN="local")
    with ClefJudge() as judge:
        started = time.perf_counter()
        for record in records:
            state, question = record[JUDGE]
            judge.judge_choice(state, question, CRITERIA)
        return len(records) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", type=Path, default=DEMO_MODEL)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/dataset.json"))
    parser.add_argument("--bin", type=Path, default=Path.home() / ".cache/clef-gguf/llama-build/bin", help="llama-server's")
    args = parser.parse_args()
    records = dataset(args.count)
    folder = Path(tempfile.mkdtemp(prefix="bench-dataset-"))
    source = folder / "requests.jsonl"
    source.write_text("".join(json.dumps({**body_of(r), "id": r["id"]}) + "\n" for r in records))
    theirs, llama = None, None
    if (args.bin / "llama-server").is_file():  # the same context and threads; --no-repack: it aborts on AMX otherwise
        theirs = free_port()
        command = [str(args.bin / "llama-server"), "-m", str(args.model), "--host", "127.0.0.1", "--port", str(theirs)]
        command += ["-c", "4096", "-b", "4096", "-ub", "4096", "-t", str(default_threads()), "--no-repack"]
        llama = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if llama is not None:
            wait_healthy(f"http://127.0.0.1:{theirs}", llama)
        rounds = []
        for r in range(args.rounds):
            row = {"http": run_serve(args.model, records, run_http), "clef_evals": run_serve(args.model, records, run_clef_evals)}
            row["decide"] = run_decide(args.model, source, folder / "a.jsonl", False)
            row["decide_sorted"] = run_decide(args.model, source, folder / "b.jsonl", True)
            if theirs is not None:
                row["llama_server"] = run_http(theirs, records, "/v1/systemone", as_llama_server_accepts)
            rounds.append(row)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f} records/s" for k, v in row.items()), flush=True)
    finally:
        if llama is not None:
            llama.terminate()
            llama.wait()
    result = {key: statistics.median(row[key] for row in rounds) for key in rounds[0]}
    ratios = {
        f"{key}/{base}": statistics.median(row[key] / row[base] for row in rounds)
        for base in ("http", "llama_server")
        if base in rounds[0]
        for key in ("decide", "decide_sorted", "http", "clef_evals")
        if key != base
    }
    summary = {"model": str(args.model), "count": args.count, "rounds": rounds, "median_records_per_s": result, "ratios": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"median_records_per_s": result, "ratios": ratios}))


if __name__ == "__main__":
    main()

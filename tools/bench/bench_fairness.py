"""Small requests behind a heavy one: their latency with and without a heavy one running.

    python tools/bench/bench_fairness.py [--heavy-questions 12] [--smalls 40] [--heavies 2] [--model FILE]

A `clef-gguf serve` at its default threads, ubatch and --ctx on loopback, over the demo model (or --model; --benchmark
builds release_builder.BENCHMARK in a child first, as bench_adapters.py does). The heavy request is --heavy-questions
choice questions of 255 options (12: the issue's 42 KB, tens of thousands of tokens). Per server:

- unloaded: one client sends --smalls small requests (distinct states, 3 questions), one after the other;
- loaded: one client sends --heavies heavy requests back to back while the small client sends them continuously
  until the last heavy one is answered.

Then, in process, the heavy request's steps (ClefModel.begin): how many, the longest but the last, and the last
(its head's compute is in it: the longest a small request can wait behind it).

--switch instead measures what an adapter switch between two steps costs: release_builder.BENCHMARK and a rank-4 f16
adapter on every linear are built in a child; in process, a small request of the adapter is decided between each
two steps of a base's heavy request (two LoRA switches, each making llama.cpp reserve its graphs again), against the
same small requests alone (no switch) and base small requests between the steps.

Two servers: --parallel 4 (the default: the heavy prompt decided a ubatch at a time, small batches decided between
its steps) and --parallel 1 (no sequence to spare: the heavy prompt prefilled whole, as every prompt was before).
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
from typing import Any

from clef_gguf.data import DEMO_MODEL
from clef_gguf.testing.processes import HOST, free_port, percentile, wait_healthy

QUESTIONS = {
    "complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
    "intent": {"type": "choice", "criteria": {"refund": "Money back", "replacement": None, "information": None}},
    "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
}


def small(n: int) -> bytes:
    return json.dumps({"state": {"ticket": f"Order #{n} arrived broken; I want a refund."}, "questions": QUESTIONS}).encode()


def heavy(n: int, questions: int) -> bytes:
    criteria = {f"option_{i}": f"kind {i % 17}" if i % 8 == 0 else None for i in range(255)}
    question = {"type": "choice", "instructions": "Which label fits the ticket?", "criteria": criteria}
    state = f"Ticket {n}: the printer on floor 3 prints blank pages."
    return json.dumps({"state": state, "questions": {f"q{i}": question for i in range(questions)}}).encode()


def post(connection: http.client.HTTPConnection, body: bytes) -> float:
    started = time.perf_counter()
    connection.request("POST", "/v1/systemone", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}")
    return time.perf_counter() - started


def summary(latencies: list[float]) -> dict[str, float]:
    return {"n": len(latencies), "p50_ms": percentile(latencies, 50) * 1e3, "p99_ms": percentile(latencies, 99) * 1e3}


def measure(port: int, smalls: int, heavies: int, questions: int) -> dict[str, Any]:
    """The small requests' latencies alone, then beside heavy ones sent back to back; the heavy ones' latencies."""
    connection = http.client.HTTPConnection(HOST, port, timeout=900)
    post(connection, small(-1))  # warm
    unloaded = [post(connection, small(n)) for n in range(smalls)]
    heavy_s: list[float] = []

    def send_heavies() -> None:
        with_heavy = http.client.HTTPConnection(HOST, port, timeout=900)
        heavy_s.extend(post(with_heavy, heavy(n, questions)) for n in range(heavies))

    thread = threading.Thread(target=send_heavies)
    thread.start()
    time.sleep(0.5)  # the first heavy one in progress
    loaded, n = [], smalls
    while thread.is_alive():
        loaded.append(post(connection, small(n)))
        n += 1
    thread.join()
    return {"unloaded": summary(unloaded), "beside_heavy": summary(loaded), "heavy_s": [round(s, 2) for s in heavy_s]}


def steps_in_process(model: Path, questions: int) -> dict[str, Any]:
    """The heavy request decided alone in steps: each step's seconds."""
    import clef_gguf

    with clef_gguf.load(model) as loaded:
        prompt = loaded.encode(json.loads(heavy(0, questions)))

        def run() -> list[float]:
            steps, times = loaded.begin(prompt), []
            while True:
                started = time.perf_counter()
                answer = steps.step()
                times.append(time.perf_counter() - started)
                if answer is not None:
                    return times

        times = loaded.compute(run)
    return {"tokens": len(prompt.tokens), "steps": len(times), "total_s": sum(times), "longest_but_last_s": max(times[:-1]),
            "last_s": times[-1]}


def serve(stack: ExitStack, model: Path, parallel: int) -> int:
    port = free_port()
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(model), "--port", str(port), "--parallel", str(parallel)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(process.wait, 60)
    stack.callback(process.terminate)
    wait_healthy(f"http://{HOST}:{port}", process, 300)
    return port


def build(out: Path) -> None:
    """(in a child: torch's threads would stay alive in this process) The benchmark fixture, converted to f32, and an
    adapter of it."""
    import clef_gguf
    from clef_gguf.conversion.adapter import convert_adapter
    from clef_gguf.testing import finetune
    from clef_gguf.testing.release_builder import BENCHMARK, build_release

    release = build_release(out / "release", BENCHMARK)
    clef_gguf.convert(release, out / "benchmark.gguf", "f32", mmproj=False)
    linears = "q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj|gate_proj|up_proj|down_proj"
    lora = {"r": 4, "lora_alpha": 8, "target_modules": rf".*language_model.*\.({linears})"}
    checkpoint = finetune.peft_checkpoint(release, out / "tune", lora, {"prior_logit_scale": 0.2}, seed=0)
    convert_adapter(checkpoint, release, out / "tune.adapter.gguf", "f16")


def switch_cost(out: Path, rounds: int = 2) -> dict[str, float]:
    """Median ms of a small request between two steps of a base's heavy one (3 questions), of the base or the adapter,
    and of the same small requests alone; and the heavy one's steps after each."""
    import clef_gguf

    adapters = {"tune": out / "tune.adapter.gguf"}
    timed: dict[str, list[float]] = {}
    with clef_gguf.load(out / "benchmark.gguf", max_prompt_tokens=16384, adapters=adapters, state_cache=0) as model:
        prompt = model.encode(json.loads(heavy(0, 3)))

        def between(name: str | None) -> None:
            steps, k, answer = model.begin(prompt), 0, None
            while answer is None:
                timed_decide(name, f"beside_{name or 'base'}", k)
                started, k = time.perf_counter(), k + 1
                answer = steps.step()
                timed.setdefault(f"steps_after_{name or 'base'}", []).append(time.perf_counter() - started)

        def timed_decide(name: str | None, key: str, k: int) -> None:
            request = json.loads(small(k)) | ({"model": name} if name else {})
            started = time.perf_counter()
            model.decide(request)
            timed.setdefault(key, []).append(time.perf_counter() - started)

        for _ in range(rounds):
            for name in (None, "tune"):
                model.compute(between, name)
                model.compute(lambda name=name: [timed_decide(name, f"alone_{name or 'base'}", 1000 + k) for k in range(15)])
    return {key: statistics.median(values) * 1e3 for key, values in timed.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heavy-questions", type=int, default=12)
    parser.add_argument("--smalls", type=int, default=40, help="small requests sent alone")
    parser.add_argument("--heavies", type=int, default=2, help="heavy requests sent back to back, beside the small ones")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--benchmark", action="store_true", help="build and use release_builder.BENCHMARK")
    parser.add_argument("--switch", action="store_true", help="measure an adapter switch between steps instead")
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)  # (the child)
    args = parser.parse_args()
    if args.build:
        build(args.build)
        return
    model = args.model
    if args.benchmark or args.switch:
        out = Path(tempfile.mkdtemp(prefix="bench-fairness-"))
        subprocess.run([sys.executable, __file__, "--build", str(out)], check=True)
        model = out / "benchmark.gguf"
        if args.switch:
            print(json.dumps(switch_cost(out), indent=2))
            return
    report: dict[str, Any] = {"model": model.name, "heavy_questions": args.heavy_questions}
    report["heavy_bytes"] = len(heavy(0, args.heavy_questions))
    for parallel in (4, 1):
        with ExitStack() as stack:
            port = serve(stack, model, parallel)
            report[f"parallel_{parallel}"] = measure(port, args.smalls, args.heavies, args.heavy_questions)
    report["steps_in_process"] = steps_in_process(model, args.heavy_questions)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""`clef-gguf eval` beside a busy neighbour process: the default thread count against --threads 1, and against
the physical cores (the default before it counted the busy ones).

A neighbour is one process spinning on one CPU (`while True: pass`, pinned to CPU 0), as another user's job would
be. Each configuration (quiet or beside the neighbour; the default threads or --threads 1) runs `clef-gguf eval
MODEL DATA --json` in a fresh process; the configurations are interleaved, and the figure is the median of eval's
own `seconds` (the decisions, not the load). What docs/benchmarks.md ("Threads beside a busy neighbour") reports.

    python tools/bench/bench_neighbour.py [--model clef_gguf/data/demo.gguf] [--data examples/labelled.jsonl] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def neighbour(busy: bool) -> Iterator[None]:
    """A process spinning on CPU 0 while the block runs (nothing when not `busy`)."""
    if not busy:
        yield
        return
    spin = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    )
    try:
        time.sleep(0.5)  # (running before eval starts)
        yield
    finally:
        spin.kill()
        spin.wait()


def eval_seconds(model: str, data: str, threads: int | None, timeout: float) -> float:
    command = [sys.executable, "-m", "clef_gguf.cli", "eval", model, data, "--json"]
    command += ["--threads", str(threads)] if threads else []
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if done.returncode not in (0, 8):
        raise SystemExit(f"eval failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return float(json.loads(done.stdout)["seconds"])


def default_now() -> int:
    """The default a process started now gets (clef_gguf.llama.threads.default_threads)."""
    code = "from clef_gguf.llama.threads import default_threads; print(default_threads())"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "clef_gguf" / "data" / "demo.gguf"))
    parser.add_argument("--data", default=str(ROOT / "examples" / "labelled.jsonl"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0, help="Seconds one eval may take.")
    args = parser.parse_args()

    from clef_gguf.llama.threads import physical_threads

    cores = physical_threads()
    print(f"{cores} physical cores, {len(os.sched_getaffinity(0))} CPUs; load average {os.getloadavg()[0]:.1f}")
    configs = [(busy, threads) for busy in (False, True) for threads in sorted({0, cores, 1})]
    times: dict[tuple[bool, int], list[float]] = {c: [] for c in configs}
    chosen: dict[bool, list[int]] = {False: [], True: []}
    for _ in range(args.rounds):
        for busy, threads in configs:
            with neighbour(busy):
                if not threads:
                    chosen[busy].append(default_now())
                times[(busy, threads)].append(eval_seconds(args.model, args.data, threads or None, args.timeout))
    print("| neighbour | threads | eval seconds, median | runs |")
    print("|---|---|---:|---|")
    for (busy, threads), values in times.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        name = f"default (chose {'/'.join(map(str, chosen[busy]))})" if not threads else str(threads)
        print(f"| {'busy' if busy else 'none'} | {name} | {statistics.median(values):.2f} | {runs} |")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()

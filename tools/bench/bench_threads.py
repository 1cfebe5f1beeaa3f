"""The default thread count against 1 thread and against every logical CPU.

The default (clef_gguf.llama.threads.default_threads: the physical cores this process may
use) should never be slower than one thread on a machine it has to itself, and not be the
oversubscription of llama.cpp's own default (all logical CPUs) when SMT siblings or an
affinity mask make those differ. One process per thread count, loaded on the benchmark
fixture (hidden 256, 8 layers), a ~2k-token request decided in rounds, the counts
interleaved; medians, with the cache off (every decision prefills the whole prompt).

    python tools/bench/bench_threads.py [--rounds 7] [--paragraphs 11]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--paragraphs", type=int, default=11)
    args = parser.parse_args()

    import clef_gguf
    from clef_gguf.llama.threads import default_threads
    from clef_gguf.testing.fixture_files import benchmark_files
    from clef_gguf.testing.request_suite import long_state_request

    counts = sorted({1, default_threads(), os.cpu_count() or 1})
    print(
        f"default {default_threads()} thread(s): {len(os.sched_getaffinity(0))} CPUs allowed, {os.cpu_count()} logical; "
        f"load average {os.getloadavg()[0]:.1f} at start"
    )
    request = long_state_request(args.paragraphs)
    with tempfile.TemporaryDirectory() as tmp:
        path = benchmark_files(Path(tmp), ["f32"])["f32"]  # built in a child: no torch threads here
        models = {n: clef_gguf.load(path, max_prompt_tokens=4096, n_threads=n, state_cache=0) for n in counts}
        try:
            tokens = models[1].decide(request)["usage"]["input_tokens"]  # and a warm-up of each
            for model in models.values():
                model.decide(request)
            times: dict[int, list[float]] = {n: [] for n in counts}
            for r in range(args.rounds):
                for n in counts[:: 1 if r % 2 == 0 else -1]:
                    started = time.perf_counter()
                    models[n].decide(request)
                    times[n].append(time.perf_counter() - started)
        finally:
            for model in models.values():
                model.close()
    one = statistics.median(times[1])
    for n in counts:
        median = statistics.median(times[n])
        tag = " (default)" if n == default_threads() else ""
        print(f"{n} thread(s){tag}: {median * 1e3:.0f} ms for {tokens} tokens, {median / one:.2f} x 1 thread")


if __name__ == "__main__":
    main()

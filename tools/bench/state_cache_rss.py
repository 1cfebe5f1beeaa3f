"""Resident memory over many distinct states: the state cache must not grow without bound.

Loads the bundled demo model with a state cache small enough to fill during the warm-up,
then decides REQUESTS requests, each about a state never seen before (long enough to be
cached: every request stores an entry and, once the budget is full, evicts the oldest).
Prints the process's resident memory (VmRSS) after the warm-up and every tenth of the run,
and the cache's own count of bytes; flat after the warm-up is the pass.

    python tools/bench/state_cache_rss.py [--requests 10000] [--warmup 1000] [--state-cache 64MiB] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

from clef_gguf.testing.processes import memory_mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000, help="requests decided, each about a new state")
    parser.add_argument("--warmup", type=int, default=1_000, help="requests before the first RSS reading")
    parser.add_argument("--state-cache", default="64MiB", help="the cache's budget: small enough to fill in the warm-up")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    args = parser.parse_args()

    import clef_gguf
    from clef_gguf.data import DEMO_MODEL
    from clef_gguf.table_checks import parse_size
    from clef_gguf.testing.request_suite import long_state_text

    text = long_state_text(2)
    questions = {
        "complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
        "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
    }
    budget = parse_size(args.state_cache)
    started = time.perf_counter()
    with clef_gguf.load(DEMO_MODEL, max_prompt_tokens=4096, n_threads=args.threads, state_cache=budget) as model:
        cache = model.state_cache
        warm = None
        # The template's preamble before the state is the same for every request (kept once); a state is never a hit.
        preamble = model.encode({"state": "", "questions": questions}).preamble
        for i in range(args.requests):
            response = model.decide({"state": f"State number {i}. {text}", "questions": questions})
            assert response["usage"]["input_tokens_details"]["cached_tokens"] <= preamble  # distinct states
            done = i + 1
            if done == args.warmup:
                warm = memory_mib()
                held = f"cache {len(cache)} entries, {cache.nbytes / 2**20:.1f} MiB"
                print(f"after {done} requests (warm-up): RSS {warm:.1f} MiB; {held}", flush=True)
            elif done > args.warmup and (done % (args.requests // 10) == 0 or done == args.requests):
                print(
                    f"after {done} requests: RSS {memory_mib():.1f} MiB; cache {len(cache)} entries, "
                    f"{cache.nbytes / 2**20:.1f} MiB "
                    f"(budget {budget / 2**20:.0f} MiB), {(time.perf_counter() - started) / done * 1e3:.1f} ms per request",
                    flush=True,
                )
            assert cache.nbytes <= budget
        end = memory_mib()
    if warm is not None:
        print(f"growth after the warm-up: {end - warm:+.1f} MiB over {args.requests - args.warmup} requests")


if __name__ == "__main__":
    main()

"""The state cache's gain: a repeated state with a new schema, against the same request cold.

The target: a repeated 8k-token state with a new 3-question schema answers in at most
0.15 x the cold latency, with the same answers. On the benchmark fixture (hidden 256, 8
layers, head 128 wide: the one tools/bench/bench_vs_llama_server.py uses), in one process, two
models loaded from the same file: one with the state cache (default budget), one without.
Each round asks a fresh 3-question schema (new ids and instructions) and times, in an order
that alternates by round:
  * hit:  the cached model, about the state it has seen (only the schema is prefilled);
  * off:  the model without a cache, the very same request (the cold latency), whose answers
          the hit's must equal;
  * miss: the cached model, the same schema about a state it has never seen (cold, plus
          keeping the state: what a first request costs with the cache on).
Medians of each, and their ratios.

    python tools/bench/bench_state_cache.py [--types f32 q8_0] [--rounds 11] [--threads 1] [--paragraphs 42]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def schema(round_: int) -> dict[str, Any]:
    """A new 3-question schema each round: the ids and instructions are part of the prompt."""
    return {
        f"complaint_{round_}": {"type": "noul", "instructions": f"Is the customer complaining? (check {round_})"},
        f"intent_{round_}": {
            "type": "choice",
            "instructions": f"What does the customer want, as of review {round_}?",
            "criteria": {"refund": "Money back", "replacement": None, "information": ["a question", round_]},
        },
        f"urgency_{round_}": {"type": "score", "criteria": ["low", "medium", "high", f"critical ({round_})"]},
    }


def request(state: Any, round_: int) -> dict[str, Any]:
    return {"model": "jev-latest", "state": state, "questions": schema(round_)}


def timed(model: Any, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    response = model.decide(body)
    return time.perf_counter() - started, response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["f32", "q8_0"])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--paragraphs", type=int, default=42, help="of the suite's long state: 42 is about 8k tokens")
    args = parser.parse_args()

    import clef_gguf
    from clef_gguf.testing.fixture_files import benchmark_files
    from clef_gguf.testing.request_suite import long_state_text

    print(f"{os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f}, {args.threads} thread(s)")
    state = {"ticket": long_state_text(args.paragraphs), "customer_tier": "gold"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for file_type, path in benchmark_files(root, args.types).items():  # built in a child: no torch threads here
            kwargs = {"max_prompt_tokens": 16384, "n_threads": args.threads}
            with clef_gguf.load(path, **kwargs) as cached, clef_gguf.load(path, state_cache=0, **kwargs) as off:
                warm = request(state, -1)
                prompt = cached.encode(warm)
                cached.decide(warm)  # the state, seen once
                off.decide(warm)
                times: dict[str, list[float]] = {"hit": [], "off": [], "miss": []}
                same = True
                for r in range(args.rounds):
                    fresh = {"ticket": f"Case {r}. " + state["ticket"], "customer_tier": "gold"}  # a state never seen
                    runs = [
                        ("hit", cached, request(state, r)),
                        ("off", off, request(state, r)),
                        ("miss", cached, request(fresh, r)),
                    ]
                    answers = {}
                    for name, model, body in runs[:: 1 if r % 2 == 0 else -1]:
                        seconds, response = timed(model, body)
                        times[name].append(seconds)
                        answers[name] = response
                    reused = answers["hit"]["usage"]["input_tokens_details"]["cached_tokens"]
                    assert reused == prompt.state_prefix, "the hit did not hit"
                    same &= answers["hit"]["answers"] == answers["off"]["answers"]
                hit, cold, miss = (statistics.median(times[k]) for k in ("hit", "off", "miss"))
                print(
                    f"{file_type}: {len(prompt.tokens)} tokens, state prefix {prompt.state_prefix}; medians of {args.rounds}: "
                    f"hit {hit * 1e3:.1f} ms, cold (cache off) {cold * 1e3:.1f} ms, miss (cache on) {miss * 1e3:.1f} ms; "
                    f"hit / cold {hit / cold:.3f}, miss / cold {miss / cold:.3f}; same answers: {same}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

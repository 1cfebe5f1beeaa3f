"""What deciding tickets together saves: four tickets, each about a state of its own, alone, in two batches of two,
and in one batch of four.

A batch is what `clef-gguf serve` decides when requests wait (ClefModel.batchable: at most `parallel` prompts
whose tokens fit one ubatch). Two tickets fit the default ubatch of 1,024; four need 2,048, so a second model is
loaded from the same file with that ubatch. In one process, on the benchmark fixture (the one
tools/bench/bench_vs_llama_server.py uses), the state cache on as in serve, four new states each round (no hits); the
ways interleaved round by round; medians of the time for all four, and their ratio to one at a time.

On a GPU (--n-gpu-layers -1), where one ticket leaves most of the device idle, batching is meant to be most of
the throughput; on this project's 2-CPU machine the cost grows with the tokens and it gains little.

    python tools/bench/bench_batch.py [--types f32 q4_k_m] [--rounds 15] [--threads N] [--n-gpu-layers -1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from clef_gguf.testing.servers import new_state, requests_by_size

# Each way by its batch size; four tickets need the second model's ubatch of 2,048.
WAYS = {"one at a time": 1, "two batches of two": 2, "one batch of four (ubatch 2048)": 4}


def four_tickets(model: Any, size: int, prompts: list[Any]) -> float:
    """Seconds to decide the four prompts in batches of `size`."""
    start = time.perf_counter()
    for i in range(0, len(prompts), size):
        model.decide_batch(prompts[i : i + size])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["f32", "q4_k_m"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="default: llama.cpp's (the physical cores)")
    parser.add_argument("--n-gpu-layers", type=int, default=0, help="-1: every layer and the head on the device")
    args = parser.parse_args()

    import clef_gguf
    from clef_gguf.testing.fixture_files import benchmark_files

    ticket = requests_by_size()["ticket"]
    states = iter(range(10**6, 10**9))
    with tempfile.TemporaryDirectory() as tmp:
        files = benchmark_files(Path(tmp), args.types)  # in a child: no torch threads in this process
        for file_type, path in files.items():
            models = {
                ubatch: clef_gguf.load(path, ubatch=ubatch, parallel=4, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers)
                for ubatch in (1024, 2048)
            }
            seconds: dict[str, list[float]] = {way: [] for way in WAYS}
            tokens = 0
            ways = list(WAYS)
            for round_ in range(args.rounds):
                turn = round_ % len(ways)
                for way in ways[turn:] + ways[:turn]:  # each way first in turn
                    size = WAYS[way]
                    model = models[2048 if size == 4 else 1024]
                    prompts = [model.encode(new_state(ticket, next(states))) for _ in range(4)]
                    tokens = len(prompts[0].tokens)
                    if not model.batchable(prompts[:size]):
                        raise SystemExit(f"{size} tickets of {tokens} tokens do not fit one ubatch of {model.ubatch}")
                    seconds[way].append(four_tickets(model, size, prompts))
            device = models[1024].head.device
            for model in models.values():
                model.close()
            alone = statistics.median(seconds[ways[0]])
            print(f"{file_type}, four tickets of {tokens} tokens, the head on {device}, medians of {args.rounds}:")
            for way in WAYS:
                median = statistics.median(seconds[way])
                print(f"  {way}: {median * 1000:.1f} ms ({median / alone:.2f})")


if __name__ == "__main__":
    main()

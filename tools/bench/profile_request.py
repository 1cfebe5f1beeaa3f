"""Where one decision's time goes, at each thread count: encode, embeddings, llama_decode, head, response.

In process, on the benchmark fixture (hidden 256, 8 layers), the ticket (the demo request) and a ~2k
state, cache off, each stage timed by wall clock and by the process's CPU clock (all its threads) over
many rounds, the thread counts interleaved; medians. A stage whose wall time more threads do not shrink
is a fixed part of a request; one whose CPU time is well under threads x wall waits instead of computing.
The stages run on the model's compute thread (ClefModel.compute), as a server's decisions do.

--second-team also runs one decode on another thread that stays alive: a second OpenMP team in the
process, as a decision thread beside the thread that loaded the model made before ClefModel.compute.

    python tools/bench/profile_request.py [--type f32] [--rounds 41] [--threads 1 2] [--second-team]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("encode", "embeddings", "llama_decode", "head", "response")


def one_round(model: Any, request: dict[str, Any]) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of each stage of one decision, computed as decide_batch does, unsplit."""
    from clef_gguf.llama.backbone import prompt_positions
    from clef_gguf.runtime.answers import response

    marks = [(time.perf_counter(), time.process_time())]
    prompt = model.encode(request)
    marks.append((time.perf_counter(), time.process_time()))
    model.backbone.clear()
    embeddings = model._embeddings(prompt, 0, len(prompt.tokens))
    positions = prompt_positions(len(prompt.tokens))
    marks.append((time.perf_counter(), time.process_time()))
    hidden = model.backbone.decode_embeddings(embeddings, positions)
    marks.append((time.perf_counter(), time.process_time()))
    logits = model.head(hidden, prompt)
    marks.append((time.perf_counter(), time.process_time()))
    response(prompt, model.name, logits)
    marks.append((time.perf_counter(), time.process_time()))
    return [(w1 - w0, c1 - c0) for (w0, c0), (w1, c1) in zip(marks, marks[1:], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--type", default="f32")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--threads", type=int, nargs="+", default=None)
    parser.add_argument("--second-team", action="store_true", help="a decode on another, live thread first")
    args = parser.parse_args()

    import clef_gguf
    from clef_gguf.llama.threads import default_threads
    from clef_gguf.testing.fixture_files import benchmark_files
    from clef_gguf.testing.request_suite import long_state_text

    counts = args.threads or sorted({1, default_threads()})
    demo = json.loads((ROOT / "clef_gguf" / "data" / "demo_request.json").read_text())
    long = copy.deepcopy(demo)
    long["state"] = {"ticket": long_state_text(11), "customer_tier": "gold"}
    requests = {"ticket": demo, "~2k": long}
    release = threading.Event()
    with tempfile.TemporaryDirectory() as tmp:
        path = benchmark_files(Path(tmp), [args.type])[args.type]  # built in a child: no torch threads here
        models = {n: clef_gguf.load(path, max_prompt_tokens=4096, n_threads=n, state_cache=0) for n in counts}
        try:
            if args.second_team:
                for model in models.values():
                    ready = threading.Event()

                    def other(model: Any = model, ready: threading.Event = ready) -> None:
                        model.backbone.clear()
                        model.backbone.decode(model.encode(demo).tokens)  # off the compute thread, on purpose
                        ready.set()
                        release.wait()

                    threading.Thread(target=other, daemon=True).start()
                    ready.wait()
            for label, request in requests.items():
                stages: dict[int, list[list[tuple[float, float]]]] = {n: [] for n in counts}
                for r in range(args.rounds + 1):
                    for n in counts[:: 1 if r % 2 == 0 else -1]:
                        times = models[n].compute(one_round, models[n], request)
                        if r:  # round 0 warms up
                            stages[n].append(times)
                tokens = len(models[counts[0]].encode(request).tokens)
                print(f"\n{args.type} {label} ({tokens} tokens): median ms, wall / process CPU (all threads)")
                print(f"{'stage':<14}" + "".join(f"{f'{n} thread(s)':>22}" for n in counts))
                for i, name in enumerate([*STAGES, "total"]):
                    cells = []
                    for n in counts:
                        picked = [rnd[i] if name != "total" else tuple(map(sum, zip(*rnd, strict=True))) for rnd in stages[n]]
                        wall = statistics.median(w for w, _ in picked)
                        cpu = statistics.median(c for _, c in picked)
                        cells.append(f"{wall * 1e3:9.2f} / {cpu * 1e3:7.2f}")
                    print(f"{name:<14}" + "".join(f"{c:>22}" for c in cells))
        finally:
            release.set()
            for model in models.values():
                model.close()


if __name__ == "__main__":
    main()

"""Where one decision's time goes, at each thread count: encode, embeddings, llama_decode, head, response.

In process, on the benchmark fixture (hidden 256, 8 layers), the ticket (the demo request) and a ~2k
state, cache off, each stage timed by wall clock and by this thread's CPU clock over many rounds, the
thread counts interleaved; medians. What a stage costs that more threads do not shrink is the fixed
part of a request.

    python tools/profile_request.py [--type f32] [--rounds 41] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--type", default="f32")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--threads", type=int, nargs="+", default=None)
    args = parser.parse_args()

    import clef_gguf
    from clef_gguf.llama.backbone import prompt_positions
    from clef_gguf.llama.threads import default_threads
    from clef_gguf.runtime.answers import response
    from clef_gguf.testing.release_builder import BENCHMARK, build_release
    from clef_gguf.testing.request_suite import long_state_text

    counts = args.threads or sorted({1, default_threads()})
    demo = json.loads((ROOT / "clef_gguf" / "data" / "demo_request.json").read_text())
    long = copy.deepcopy(demo)
    long["state"] = {"ticket": long_state_text(11), "customer_tier": "gold"}
    requests = {"ticket": demo, "~2k": long}
    with tempfile.TemporaryDirectory() as tmp:
        path = clef_gguf.convert(build_release(Path(tmp) / "release", BENCHMARK), Path(tmp) / "bench.gguf", args.type)
        models = {n: clef_gguf.load(path, n_ctx=4096, n_threads=n, state_cache=0) for n in counts}
        try:
            for label, request in requests.items():
                stages: dict[int, dict[str, list[tuple[float, float]]]] = {n: {} for n in counts}
                for r in range(args.rounds + 1):
                    for n in counts[:: 1 if r % 2 == 0 else -1]:
                        m = models[n]
                        marks = [(time.perf_counter(), time.thread_time())]

                        def mark(
                            name: str, marks: list[tuple[float, float]] = marks, n: int = n, r: int = r, stages: dict = stages
                        ) -> None:
                            marks.append((time.perf_counter(), time.thread_time()))
                            if r:  # round 0 warms up
                                (w0, c0), (w1, c1) = marks[-2], marks[-1]
                                stages[n].setdefault(name, []).append((w1 - w0, c1 - c0))

                        prompt = m.encode(request)
                        mark("encode")
                        m.backbone.clear()
                        embeddings = m._embeddings(prompt, 0, len(prompt.tokens))
                        positions = prompt_positions(len(prompt.tokens))
                        mark("embeddings")
                        hidden = m.backbone.decode_embeddings(embeddings, positions)
                        mark("llama_decode")
                        logits = m.head(hidden, prompt)
                        mark("head")
                        response(prompt, m.name, logits)
                        mark("response")
                tokens = len(m.encode(request).tokens)
                print(f"\n{args.type} {label} ({tokens} tokens): median ms, wall / this thread's CPU")
                names = list(stages[counts[0]])
                print(f"{'stage':<14}" + "".join(f"{f'{n} thread(s)':>22}" for n in counts))
                for name in [*names, "total"]:
                    cells = []
                    for n in counts:
                        if name == "total":
                            rounds = list(zip(*(stages[n][s] for s in names), strict=True))
                            wall = statistics.median(sum(w for w, _ in rnd) for rnd in rounds)
                            cpu = statistics.median(sum(c for _, c in rnd) for rnd in rounds)
                        else:
                            wall = statistics.median(w for w, _ in stages[n][name])
                            cpu = statistics.median(c for _, c in stages[n][name])
                        cells.append(f"{wall * 1e3:9.2f} / {cpu * 1e3:7.2f}")
                    print(f"{name:<14}" + "".join(f"{c:>22}" for c in cells))
        finally:
            for model in models.values():
                model.close()


if __name__ == "__main__":
    main()

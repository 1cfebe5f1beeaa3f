"""Measure the runtime against bare llama.cpp and against the reference, in one run.

  * load: clef_gguf.load (backbone through the qwen35 view, FILE*, no mmap) against
    llama.cpp loading the same backbone as a plain qwen35 GGUF by path (mmap), each in
    a fresh process: wall time and peak RSS (VmHWM), medians over --repeats;
  * decide: median latency of ClefModel.decide against the reference (transformers +
    torch, float32, CPU) on the same release and request.

Needs the test dependencies (bash tools/test.sh installs them).

    python tools/bench/bench_runtime.py [--hidden 256 --layers 8 --repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, time

from clef_gguf.testing.processes import memory_mib  # VmHWM: this process image's peak (ru_maxrss has the parent's)


mode, path, n_ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
t = time.perf_counter()
if mode == "clef":
    import clef_gguf
    model = clef_gguf.load(path, max_prompt_tokens=n_ctx, ubatch=n_ctx)  # one batch, as llama.cpp's side
else:
    from clef_gguf.testing.bare_llama import bare_context
    model, ctx = bare_context(path, n_ctx)
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "peak_rss_mib": memory_mib(field="VmHWM")}))
"""


def measure_load(mode: str, path: Path, n_ctx: int, repeats: int) -> dict[str, float]:
    runs = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(path), str(n_ctx)], capture_output=True, text=True, check=True
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def median_seconds(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        action()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--type", default="f32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n-ctx", type=int, default=4096)
    args = parser.parse_args()

    import clef_gguf
    from clef_gguf.testing.oracle import Oracle
    from clef_gguf.testing.release_builder import ReleaseSpec, clef_and_backbone
    from clef_gguf.testing.request_suite import mixed_request

    spec = ReleaseSpec(hidden=args.hidden, intermediate=2 * args.hidden, layers=args.layers, head_width=args.hidden // 2)
    with tempfile.TemporaryDirectory() as tmp:
        release, clef, plain = clef_and_backbone(Path(tmp), spec, args.type)
        print(
            f"release: hidden {args.hidden}, {args.layers} layers, {args.type}; clef.gguf {clef.stat().st_size / 2**20:.1f} MiB"
        )
        ours = measure_load("clef", clef, args.n_ctx, args.repeats)
        bare = measure_load("plain", plain, args.n_ctx, args.repeats)
        print(f"load   clef_gguf.load {ours['seconds'] * 1000:8.1f} ms  peak RSS {ours['peak_rss_mib']:7.1f} MiB")
        print(f"load   llama.cpp path {bare['seconds'] * 1000:8.1f} ms  peak RSS {bare['peak_rss_mib']:7.1f} MiB")
        print(f"ratio  time {ours['seconds'] / bare['seconds']:.2f}  peak RSS {ours['peak_rss_mib'] / bare['peak_rss_mib']:.2f}")

        request = mixed_request()
        model = clef_gguf.load(clef, max_prompt_tokens=args.n_ctx, ubatch=args.n_ctx)
        oracle = Oracle(release)
        n_tokens = model.decide(request)["usage"]["input_tokens"]
        ours_s = median_seconds(lambda: model.decide(request), args.repeats)
        oracle_s = median_seconds(lambda: oracle.answer(request), args.repeats)
        print(f"decide {n_tokens} tokens: clef-gguf {ours_s * 1000:.1f} ms, reference {oracle_s * 1000:.1f} ms")
        print(f"ratio  decide {ours_s / oracle_s:.3f}")
        model.close()


if __name__ == "__main__":
    main()

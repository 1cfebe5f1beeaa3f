"""Load time and peak RSS of the two routes llama.cpp reads a Clef file by (llama/loader.py), and where CPU_REPACK applies.

    python tools/bench/bench_loader.py [--types f32 q8_0 q4_k_m] [--shaped DIR] [--rounds 3] [--repack default on]
                                       [--tokens 512] [--shaped-tokens 32]

Each figure is a fresh child process that loads the backbone (llama/backbone.py's Backbone: the vocabulary and the
lean model that runs) by one route, CLEF_GGUF_LOADER=cookie (glibc's fopencookie) or portable
(llama_model_init_from_user), on the benchmark fixture (clef_gguf/testing/fixture_files.py, built here) and, with
--shaped DIR, on the Clef-flash-shaped Q4_K_M file that tools/shaped_model.py writes in DIR (built there first if absent: about a
minute, 5.6 GB). The routes alternate round by round; medians are reported. RSS: the child's peak (ru_maxrss)
less its peak before the load (imports, the file's header), beside the weights llama.cpp allocated (its own log's
"model buffer size" lines, by buffer type: CPU_REPACK there means repacked weights), then the best of two prefills
of --tokens (--shaped-tokens) tokens: the portable route adds an elementwise op after each product (user_model.py).
--repack on forces CPU_REPACK (llama/cpu_buffers.py's repack=True); default is clef-gguf's placement on this CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SHAPED = "clef-flash-shaped-Q4_K_M.gguf"
CHILD = r"""
import functools, json, re, resource, sys, time
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama import cpu_buffers, loader, log
from clef_gguf.llama.backbone import Backbone
path, repack, n_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
if repack == "on":
    cpu_buffers.placement = functools.partial(cpu_buffers.placement, repack=True)
log.init_backend()
f = GGUFFile.open(path)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
lines = []
with log.capture_info(lines.append):
    start = time.perf_counter()
    model = Backbone(f, max_prompt_tokens=n_tokens)
    seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
buffers = {}
for name, mib in re.findall(r"(\S+) model buffer size = +([\d.]+) MiB", "".join(lines)):
    buffers[name] = buffers.get(name, 0.0) + float(mib)
tokens = (model.tokenize("a decision over weights " * n_tokens) * 2)[:n_tokens]
prefill = []
for _ in range(2):
    start = time.perf_counter()
    model.hidden_states(tokens)
    prefill.append(time.perf_counter() - start)
print(json.dumps({"route": loader.route(), "seconds": seconds, "peak_mib": (peak - before) / 1024, "buffers": buffers,
                  "prefill": min(prefill)}))
"""


def measure(path: Path, route: str, repack: str, tokens: int) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), repack, str(tokens)],
        capture_output=True,
        text=True,
        env={**os.environ, "CLEF_GGUF_LOADER": route},
    )
    if run.returncode != 0:
        raise SystemExit(f"{route} on {path.name} failed ({run.returncode}):\n{run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def compare(path: Path, rounds: int, repack: str, tokens: int) -> list[dict]:
    """One row per route: medians over `rounds` (after one discarded round each: the page cache)."""
    runs: dict[str, list[dict]] = {"cookie": [], "portable": []}
    for i in range(rounds + 1):
        for route in runs:
            result = measure(path, route, repack, tokens)
            if i > 0:
                runs[route].append(result)
    return [
        {
            "file": path.name,
            "repack": repack,
            "route": route,
            "load_s": statistics.median(r["seconds"] for r in results),
            "peak_rss_mib": statistics.median(r["peak_mib"] for r in results),
            "tokens": tokens,
            "prefill_s": statistics.median(r["prefill"] for r in results),
            "buffers_mib": results[0]["buffers"],
        }
        for route, results in runs.items()
    ]


def shaped_file(folder: Path) -> Path:
    path = folder / SHAPED
    if not path.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "shaped_model.py"), str(folder)], check=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="*", default=["f32", "q8_0", "q4_k_m"], help="the fixture's (none: --shaped only)")
    parser.add_argument("--shaped", type=Path, help="a folder holding (or to hold) tools/shaped_model.py's file")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repack", nargs="+", default=["default", "on"], choices=["default", "on"])
    parser.add_argument("--tokens", type=int, default=512, help="the prefill timed after each load, on the fixture")
    parser.add_argument("--shaped-tokens", type=int, default=32, help="the same on the shaped file (9B on the CPU)")
    args = parser.parse_args()

    from clef_gguf.testing.fixture_files import benchmark_files

    with tempfile.TemporaryDirectory() as tmp:
        built = benchmark_files(Path(tmp), args.types) if args.types else {}  # (in a child: no torch threads here)
        files = [(path, args.tokens) for path in built.values()]
        if args.shaped:
            files.append((shaped_file(args.shaped), args.shaped_tokens))
        rows = [row for path, n in files for repack in args.repack for row in compare(path, args.rounds, repack, n)]
    print("| file | CPU_REPACK | route | load (s) | peak RSS of the load (MiB) | llama.cpp's weights (MiB) | prefill (s) |")
    print("|---|---|---|---:|---:|---|---:|")
    for r in rows:
        buffers = ", ".join(f"{name} {mib:.1f}" for name, mib in sorted(r["buffers_mib"].items()))
        cells = [r["file"], r["repack"], r["route"], f"{r['load_s']:.3f}", f"{r['peak_rss_mib']:.0f}", buffers]
        print("| " + " | ".join([*cells, f"{r['prefill_s']:.3f} ({r['tokens']} tokens)"]) + " |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

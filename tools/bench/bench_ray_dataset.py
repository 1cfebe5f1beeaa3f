"""`clef-gguf decide --ray` (the dataset mode on Ray Data) against the local mode, on 1,000 records.

    python tools/bench/bench_ray_dataset.py                      # the demo model and a larger fixture (hidden 256, 8 layers)
    python tools/bench/bench_ray_dataset.py --records 1000 --cases demo --json ray-dataset.json

For each model: the local mode (runtime/dataset_file.decide_file) with 1 llama.cpp thread and with the default
threads; then, on a local Ray cluster on loopback started once here (this process its driver), runtime/dataset_ray's
decide_file_on_ray with 1 worker and with 2 workers of 1 thread each. Reported per run: the decide time (the local
mode's, after its load; on Ray, from the call to the last line written: the actors' start and model loads included)
and records/s; for Ray at 1 worker, its time per record without its start (the run's time less that of a run of a
quarter of the records, over the records between them) against the local mode's at 1 thread: Ray's per-record
overhead.
Every run writes the same answers (checked, but `cached_tokens`). Then the driver's peak RSS over a million-line
input's pre-pass (its reading, --resume's checks and its parts: what the driver holds besides the parts in flight),
in a child process (its VmHWM: ru_maxrss would count the parent's pages at the fork).

The machine's cores are shared by the driver, the actors and whatever else runs: 2 workers on a 2-core machine
cannot give 2x, since the driver writes the lines on the same cores. Quote the figures with the command and machine.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from clef_gguf.testing import ray_cluster  # first: the cluster it starts listens on loopback only

# isort: split
import clef_gguf
from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST
from clef_gguf.runtime.dataset_file import decide_file
from clef_gguf.runtime.dataset_ray import RayData, decide_file_on_ray
from clef_gguf.settings import FileOptions, ModelSpec
from clef_gguf.testing.release_builder import LARGER, build_release

CTX = 4096
CACHED = re.compile(rb'"cached_tokens":\d+')
RSS_CHILD = """
import sys
from clef_gguf.runtime.dataset_file import answers_file
from clef_gguf.runtime.dataset_ray import _model_identity, parts
from clef_gguf.data import DEMO_MODEL
from clef_gguf.settings import ModelSpec
model = _model_identity(ModelSpec(DEMO_MODEL))
with answers_file(model, sys.argv[1], sys.argv[2], resume=False, force=True) as run:
    cut = parts(run.input, run.records, run.next_line, 256)
peak = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
print(len(cut), int(peak) // 1024)
"""


def _requests(path: Path, n: int) -> Path:
    demo = json.loads(DEMO_REQUEST.read_text())
    ticket = demo["state"]["ticket"]
    lines = [json.dumps({**demo, "id": f"r{i}", "state": {"ticket": f"ticket {i % 50}: {ticket}"}}) for i in range(n)]
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def _local(model: Path, source: Path, out: Path, threads: int | None) -> dict[str, Any]:
    with clef_gguf.load(model, max_prompt_tokens=CTX, n_threads=threads) as loaded:
        summary = decide_file(loaded, str(source), str(out), FileOptions(force=True))
    return {"seconds": round(summary.seconds, 3), "records_per_s": summary.as_dict()["records_per_s"]}


def _on_ray(model: Path, source: Path, out: Path, workers: int) -> dict[str, Any]:
    spec = ModelSpec.of(model, max_prompt_tokens=CTX, n_threads=1)
    started = time.perf_counter()
    summary = decide_file_on_ray(spec, str(source), str(out), RayData(None, workers), FileOptions(force=True))
    seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 3), "records_per_s": round(summary.records / seconds, 2)}


def _same(a: Path, b: Path) -> bool:
    return CACHED.sub(b"", a.read_bytes()) == CACHED.sub(b"", b.read_bytes())


def bench_model(name: str, model: Path, folder: Path, records: int) -> dict[str, Any]:
    source = _requests(folder / f"{name}.jsonl", records)
    result: dict[str, Any] = {}
    result["local_1_thread"] = _local(model, source, folder / "local1.jsonl", 1)
    result["local_default_threads"] = _local(model, source, folder / "local.jsonl", None)
    for workers in (1, 2):
        out = folder / f"ray{workers}.jsonl"
        result[f"ray_{workers}_worker"] = _on_ray(model, source, out, workers)
        assert _same(out, folder / "local1.jsonl"), f"{name}: the answers on Ray differ from the local mode's"
    # Ray's time per record at 1 worker, its start and loads taken out: the difference between this run and one of
    # a quarter of the records (one part), over the records between them.
    quarter = records // 4
    result["ray_1_worker_quarter"] = _on_ray(model, _requests(folder / "quarter.jsonl", quarter), folder / "q.jsonl", 1)
    ray_ms = 1000 * (result["ray_1_worker"]["seconds"] - result["ray_1_worker_quarter"]["seconds"]) / (records - quarter)
    local_ms = 1000 * result["local_1_thread"]["seconds"] / records
    result["ms_per_record"] = {"local_1_thread": round(local_ms, 3), "ray_1_worker": round(ray_ms, 3)}
    result["ray_overhead_1_worker"] = round(ray_ms / local_ms, 3)
    result["ray_2_vs_1_worker"] = round(result["ray_1_worker"]["seconds"] / result["ray_2_worker"]["seconds"], 3)
    return result


def driver_rss(folder: Path, lines: int) -> dict[str, Any]:
    """The driver's pre-pass over a million-line input (short request lines): peak RSS, and its parts."""
    source = folder / "million.jsonl"
    with open(source, "w") as file:
        for i in range(lines):
            file.write(f'{{"id":{i},"state":"s","questions":{{"q":{{"type":"noul"}}}}}}\n')
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, str(source), str(folder / "million-answers.jsonl")],
        capture_output=True,
        text=True,
        check=True,
    )
    parts, rss = run.stdout.split()
    return {"lines": lines, "parts": int(parts), "peak_rss_mib": int(rss), "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--cases", nargs="*", default=["demo", "larger"], choices=["demo", "larger"])
    parser.add_argument("--million", type=int, default=1_000_000, help="lines of the driver's RSS input (0: none)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        models = {"demo": Path(DEMO_MODEL)}
        if "larger" in args.cases:
            models["larger"] = clef_gguf.convert(build_release(folder / "release", LARGER), folder / "larger.gguf", "f32")
        started = time.perf_counter()
        with ray_cluster.local_cluster(num_cpus=2) if args.cases else nullcontext():
            results["cluster_start_s"] = round(time.perf_counter() - started, 1)
            for case in args.cases:
                results[case] = bench_model(case, models[case], folder, args.records)
                print(case, json.dumps(results[case]), flush=True)
        if args.million:
            results["driver"] = driver_rss(folder, args.million)
            print("driver", json.dumps(results["driver"]), flush=True)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

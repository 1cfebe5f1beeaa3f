"""The driver's memory on a million-line input: `decide --ray` over N lines, its resident memory sampled.

    python tools/bench/ray_dataset_memory.py [--lines 1000000] [--workers 2] [--dir DIR]

Each line is `{"id": N, "state": "ticket N"}`: a request without questions, answered by an error line, so that
the run measures the pipeline (the driver's reading, parts, ordering and writing), not the model. The driver's
peak resident memory (VmHWM) is read from /proc every 0.5 s; prints the run's seconds, the answer lines and the peak.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clef_gguf.data import DEMO_MODEL
from clef_gguf.testing.processes import memory_mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dir", type=Path, help="where the input and the answers go (default: a temporary folder)")
    args = parser.parse_args()
    folder = args.dir or Path(tempfile.mkdtemp(prefix="ray-dataset-memory-"))
    data, out = folder / "requests.jsonl", folder / "answers.jsonl"
    with data.open("w") as file:
        for i in range(args.lines):
            file.write(json.dumps({"id": i, "state": f"ticket {i}"}) + "\n")
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "clef_gguf.cli", "decide", str(DEMO_MODEL), str(data), "-o", str(out), "--ray"]
    command += ["--workers", str(args.workers)]
    started, peak = time.perf_counter(), 0.0
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while process.poll() is None:
        with contextlib.suppress(OSError, RuntimeError):  # (between its exit and the poll)
            peak = max(peak, memory_mib(process.pid, "VmHWM"))  # its peak so far
        time.sleep(0.5)
    with out.open("rb") as answers:
        lines = sum(1 for _ in answers)
    seconds = round(time.perf_counter() - started, 1)
    print(json.dumps({"exit": process.returncode, "seconds": seconds, "answer_lines": lines, "driver_peak_rss_mib": peak}))


if __name__ == "__main__":
    main()

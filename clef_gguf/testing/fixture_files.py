"""The benchmark fixture's GGUF files, built in a child process, for tools that time llama.cpp after.

Building a release runs torch, and torch's OpenMP threads stay alive in the process afterwards,
contending with llama.cpp's for the CPUs: a head timed in the process that had built the file took
ten times as long as in a fresh one (docs/benchmarks.md, "Measurements behind the code"). A timing tool
therefore builds here and never imports torch itself. This module imports neither torch nor transformers.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def benchmark_files(out_dir: Path, file_types: Sequence[str]) -> dict[str, Path]:
    """release_builder.BENCHMARK converted to each of ``file_types`` in ``out_dir``: type -> path."""
    out_dir = Path(out_dir)
    subprocess.run(
        [sys.executable, "-m", "clef_gguf.testing.release_builder", str(out_dir), *file_types],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return {file_type: benchmark_path(out_dir, file_type) for file_type in file_types}


def benchmark_path(out_dir: Path, file_type: str) -> Path:
    return Path(out_dir) / f"bench-{file_type}.gguf"

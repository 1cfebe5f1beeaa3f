"""What several benchmark scripts under tools/bench/ share: timing actions in turn, and the machine's name for the
report (stdlib only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def interleaved(actions: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best seconds of each action, run in turn `repeats` times after one warm-up each.

    The best of N, not the median: on a shared machine other processes only ever add time.
    """
    times: dict[str, list[float]] = {name: [] for name in actions}
    for action in actions.values():
        action()
    for _ in range(repeats):
        for name, action in actions.items():
            start = time.perf_counter()
            action()
            times[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in times.items()}


def cpu_name() -> str | None:
    """The CPU's model name from /proc/cpuinfo; None where it names none (some ARM kernels, no Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return None
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
    return names[0] if names else None

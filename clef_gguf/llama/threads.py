"""The default number of compute threads: the physical cores this process may run on, less those other
processes keep busy.

llama.cpp's kernels keep every thread busy until a graph is done, so a thread that shares
a core with another (an SMT sibling, or a core the process may not use) slows all of them:
on an oversubscribed machine llama.cpp's default was measured about 6 times slower than one
thread. Hence: the CPUs of the process's affinity mask, counted once per
physical core (the (package, core) pair sysfs gives each logical CPU), and no more than a
cgroup v2 CPU quota allows (physical_threads). A core another process keeps busy is the same
oversubscription: beside one spinning neighbour, eval on 2 threads of a 2-CPU machine took 10 times as
long as on 1 (docs/benchmarks.md, "Threads beside a busy neighbour"). So the default also takes off
the cores the other processes kept busy over SAMPLE_SECONDS of /proc/stat, measured once a load
(reused for REUSE_SECONDS, so that the backbone and the head of one load get the same count).
Where there is no affinity mask (macOS, Windows) the default is the CPUs Python counts (available_cpus), and
nothing under /proc is read; where /proc cannot be read, there is no quota and no busy core to take off.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

_SYS_CPU = Path("/sys/devices/system/cpu")
SAMPLE_SECONDS = 0.1  # ten clock ticks of /proc/stat per CPU
REUSE_SECONDS = 60.0


def _core(cpu: int) -> tuple[str, str] | None:
    topology = _SYS_CPU / f"cpu{cpu}" / "topology"
    try:
        return (topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()
    except OSError:
        return None


def quota_cpus(cpu_max: str) -> int | None:
    """CPUs a cgroup v2 `cpu.max` line ("QUOTA PERIOD", or "max PERIOD") allows, rounded up; None if unlimited."""
    fields = cpu_max.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def cgroup_quota() -> int | None:
    """The quota of this process's own cgroup (v2; a container sees its own as "/"), if any."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        path = next(line[3:] for line in lines if line.startswith("0::"))
        return quota_cpus((Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.max").read_text())
    except (OSError, StopIteration):
        return None


def available_cpus() -> int:
    """The CPUs this process may use where there is no affinity mask to read (macOS, Windows): Python 3.13's
    os.process_cpu_count (which honours what the platform restricts, and PYTHON_CPU_COUNT), else os.cpu_count()."""
    count = getattr(os, "process_cpu_count", os.cpu_count)()
    return max(1, count or 1)


def physical_threads() -> int:
    """Physical cores available to this process (at least 1).

    Without an affinity mask (not Linux) available_cpus(); without sysfs topology, the CPUs
    of the mask (never more than the process may use). /proc (the cgroup's quota) is read only
    where the mask is, and a /proc that cannot be read means no quota.
    """
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return available_cpus()
    cores = {_core(cpu) for cpu in allowed}
    count = len(allowed) if None in cores else len(cores)
    quota = cgroup_quota()
    return max(1, min(count, quota) if quota else count)


def _cpu_times(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """(all, idle) clock ticks of each of `cpus` from /proc/stat; {} where it cannot be read."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    times = {}
    for line in lines:
        name, *fields = line.split()
        if name[3:].isdigit() and name.startswith("cpu") and int(name[3:]) in cpus:
            ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            times[int(name[3:])] = (sum(ticks), ticks[3] + ticks[4])
    return times


def busy_cpus(cpus: set[int], seconds: float = SAMPLE_SECONDS) -> float:
    """How many of `cpus` were busy over the next `seconds`, in CPUs (0.0 where /proc/stat cannot be read).

    Measured while this process sleeps: the time is the other processes' (or this one's other threads')."""
    before = _cpu_times(cpus)
    time.sleep(seconds)
    after = _cpu_times(cpus)
    busy = 0.0
    for cpu in before.keys() & after.keys():
        total, idle = after[cpu][0] - before[cpu][0], after[cpu][1] - before[cpu][1]
        busy += 1 - idle / total if total > 0 else 0.0
    return busy


_measured: tuple[float, int] | None = None  # (when, the default then)


def default_threads() -> int:
    """physical_threads, less the CPUs other processes keep busy (rounded), at least 1."""
    global _measured
    now = time.monotonic()
    if _measured is not None and now - _measured[0] < REUSE_SECONDS:
        return _measured[1]
    cores = physical_threads()
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = set()
    threads = max(1, cores - int(busy_cpus(allowed) + 0.5)) if cores > 1 and allowed else cores
    _measured = (now, threads)
    return threads

"""The default number of compute threads: the physical cores this process may run on.

llama.cpp's kernels keep every thread busy until a graph is done, so a thread that shares
a core with another (an SMT sibling, or a core the process may not use) slows all of them:
on an oversubscribed machine llama.cpp's default was measured about 6 times slower than one
thread (issue 12). Hence: the CPUs of the process's affinity mask, counted once per
physical core (the (package, core) pair sysfs gives each logical CPU), and no more than a
cgroup v2 CPU quota allows.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_SYS_CPU = Path("/sys/devices/system/cpu")


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


def default_threads() -> int:
    """Physical cores available to this process (at least 1).

    Without an affinity mask (not Linux) os.cpu_count(); without sysfs topology, the CPUs
    of the mask (never more than the process may use).
    """
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores = {_core(cpu) for cpu in allowed}
    count = len(allowed) if None in cores else len(cores)
    quota = cgroup_quota()
    return max(1, min(count, quota) if quota else count)

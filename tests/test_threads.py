"""The default thread count: physical cores of the process's affinity mask."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from clef_gguf.llama.threads import cgroup_quota, default_threads, physical_threads, quota_cpus


def test_the_default_is_at_least_one_and_at_most_the_cpus_allowed():
    assert 1 <= default_threads() <= len(os.sched_getaffinity(0))


@pytest.mark.skipif(shutil.which("lscpu") is None, reason="lscpu is not installed")
def test_the_default_counts_each_physical_core_once():
    # lscpu reads the same topology another way: one line per logical CPU, "CPU,CORE,SOCKET".
    listing = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True, check=True).stdout
    allowed = os.sched_getaffinity(0)
    rows = [line.split(",") for line in listing.splitlines() if line and not line.startswith("#")]
    cores = {(socket, core) for cpu, core, socket in rows if int(cpu) in allowed}
    quota = cgroup_quota()  # a cgroup quota can only lower it
    assert physical_threads() == (min(len(cores), quota) if quota else len(cores))


def test_a_process_pinned_to_one_cpu_defaults_to_one_thread():
    cpu = min(os.sched_getaffinity(0))
    code = (
        f"import os; os.sched_setaffinity(0, {{{cpu}}}); "
        "from clef_gguf.llama.threads import default_threads; print(default_threads())"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "1"


@pytest.mark.parametrize(
    ("cpu_max", "cpus"),
    [("max 100000", None), ("200000 100000", 2), ("150000 100000", 2), ("50000 100000", 1), ("", None), ("x y", None)],
)
def test_a_cgroup_quota_rounds_up_to_whole_cpus(cpu_max, cpus):
    assert quota_cpus(cpu_max) == cpus

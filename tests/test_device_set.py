"""The quick device set (conftest.DEVICE_QUICK) names tests that exist: a renamed test or parameter would drop out
of it silently, and the quick set would pass with a path it no longer covers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import DEVICE_QUICK

ROOT = Path(__file__).resolve().parent.parent


def test_every_quick_device_case_is_a_device_test_that_exists():
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "device_quick and device"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    collected = [line for line in listed.stdout.splitlines() if line.startswith("tests/")]
    missing = [case for case in DEVICE_QUICK if not any(node.startswith(case) for node in collected)]
    assert not missing, (missing, listed.stdout[-2000:], listed.stderr[-2000:])
    assert len(collected) == len(DEVICE_QUICK) + 1  # the plan's test has two cases, every other entry one

"""The quick device set (conftest.DEVICE_QUICK) and the tests the device set leaves out (conftest.NOT_ON_DEVICE)
name tests that exist: a renamed test or parameter would drop out of the one silently, and the quick set would
pass with a path it no longer covers; or come back into the other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEVICE_QUICK, NOT_ON_DEVICE

ROOT = Path(__file__).resolve().parent.parent


# The modules the two lists name: where their tests must be (collecting every module imports Ray and the rest, twice).
MODULES = sorted({case.split("::")[0] for case in DEVICE_QUICK + NOT_ON_DEVICE})


def _collected(marks: str) -> list[str]:
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marks, *MODULES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert listed.returncode == 0, (listed.stdout[-2000:], listed.stderr[-2000:])
    return [line for line in listed.stdout.splitlines() if line.startswith("tests/")]


@pytest.mark.slow
def test_every_quick_device_case_is_a_device_test_that_exists():
    collected = _collected("device_quick and device")
    missing = [case for case in DEVICE_QUICK if not any(node.startswith(case) for node in collected)]
    assert not missing, missing
    assert len(collected) == len(DEVICE_QUICK) + 1  # the plan's test has two cases, every other entry one
    assert not [node for node in collected if node.startswith(NOT_ON_DEVICE)]


@pytest.mark.slow
def test_every_test_the_device_set_leaves_out_is_in_a_device_module():
    collected = _collected("device")  # (without --on-device, which leaves them out)
    missing = [case for case in NOT_ON_DEVICE if not any(node.startswith(case) for node in collected)]
    assert not missing, missing

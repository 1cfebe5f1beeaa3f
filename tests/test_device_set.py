"""The quick device set (conftest.DEVICE_QUICK) and the tests the device set leaves out (conftest.NOT_ON_DEVICE)
name tests that exist: a renamed test or parameter would drop out of the one silently, and the quick set would
pass with a path it no longer covers; or come back into the other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEVICE_QUICK, NOT_ON_DEVICE

ROOT = Path(__file__).resolve().parent.parent


# The modules the two lists name: where their tests must be (collecting every module imports Ray and the rest).
MODULES = sorted({case.split("::")[0] for case in DEVICE_QUICK + NOT_ON_DEVICE})

# pytest in a fresh interpreter, with a plugin that writes each selected test's markers (argv[1]: the file). One
# collection of `-m device` serves both tests: the `device_quick and device` tests are those among it marked device_quick.
COLLECT = """
import json, sys
import pytest

class Markers:
    def pytest_collection_finish(self, session):
        markers = {item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in session.items}
        with open(sys.argv[1], "w") as out:
            json.dump(markers, out)

sys.exit(pytest.main(sys.argv[2:], plugins=[Markers()]))
"""


@pytest.fixture(scope="module")
def device_tests(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Each test `-m device` selects in MODULES (without --on-device, which leaves some out): its markers."""
    out = tmp_path_factory.mktemp("device_set") / "markers.json"
    arguments = ["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "device", *MODULES]
    listed = subprocess.run(
        [sys.executable, "-c", COLLECT, str(out), *arguments], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert listed.returncode == 0, (listed.stdout[-2000:], listed.stderr[-2000:])
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_quick_device_case_is_a_device_test_that_exists(device_tests):
    collected = [node for node, markers in device_tests.items() if "device_quick" in markers]
    missing = [case for case in DEVICE_QUICK if not any(node.startswith(case) for node in collected)]
    assert not missing, missing
    assert len(collected) == len(DEVICE_QUICK) + 1  # the plan's test has two cases, every other entry one
    assert not [node for node in collected if node.startswith(NOT_ON_DEVICE)]


@pytest.mark.slow
def test_every_test_the_device_set_leaves_out_is_in_a_device_module(device_tests):
    missing = [case for case in NOT_ON_DEVICE if not any(node.startswith(case) for node in device_tests)]
    assert not missing, missing

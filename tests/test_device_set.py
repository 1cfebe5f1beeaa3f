"""The quick device set (conftest.DEVICE_QUICK) and the tests the device set leaves out (conftest.NOT_ON_DEVICE)
name tests that exist: a renamed test or parameter would drop out of the one silently, and the quick set would
pass with a path it no longer covers; or come back into the other. And the scripts that run the device set
(tools/device_check.sh, tools/gpu_check.sh) run here, rehearsed on the CPU, up to where a device would be used."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEVICE_QUICK, NOT_ON_DEVICE

from clef_gguf.settings import N_GPU_LAYERS_ENV

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


# The device set's configuration rehearsed on this CPU build, through the scripts that run it on a device: offload is
# asked for (--on-device) and ignored by the CPU build, and the tests run, where on a device build they would run there.
# A break in the configuration (a conftest hook, a setting the device set changes) or in the scripts shows here.
REHEARSED = (
    "tests/test_native_head.py::test_decide_uses_the_native_head",
    "tests/test_parity.py::test_probabilities_match_the_reference[untied_f32-f32-auto-0.005-mixed]",
    "tests/test_batching.py::test_batched_hidden_states_and_answers_are_those_alone[f32]",
)
# A plugin of the rehearsed run: what a load that omits n_gpu_layers gets there, once the session is configured.
PROBE = """
import json, os
from clef_gguf.settings import LoadOptions

def pytest_sessionfinish(session):
    with open(os.environ["PROBE_OUT"], "w") as out:
        json.dump({"n_gpu_layers": LoadOptions().n_gpu_layers, "failed": session.testsfailed}, out)
"""


def _rehearsal_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "offload_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in (N_GPU_LAYERS_ENV, "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the scripts' python3: this one
    return {**env, "PYTHONPATH": str(tmp_path), "PROBE_OUT": str(tmp_path / "probe.json"), "OUT": str(tmp_path / "out")}


@pytest.mark.slow
def test_the_device_check_rehearsed_on_the_cpu_runs_device_tests_with_offload_asked(tmp_path):
    inner = ["-p", "offload_probe", "--basetemp", str(tmp_path / "pytest"), *REHEARSED]
    command = ["bash", "tools/device_check.sh", sys.prefix, "--quick", "--rehearse", *inner]
    run = subprocess.run(command, cwd=ROOT, env=_rehearsal_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert f"{len(REHEARSED)} passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-3000:]
    assert "the device set runs on the CPU" in run.stdout
    assert json.loads((tmp_path / "probe.json").read_text()) == {"n_gpu_layers": -1, "failed": 0}


@pytest.mark.slow
def test_the_gpu_check_rehearsed_on_the_cpu_starts_every_step(tmp_path):
    """gpu_check.sh run's steps once installed, without a GPU: each program's arguments parsed, the device set
    collected with its configuration (the GPU machine's minutes are too few to find such a break there)."""
    command = ["bash", "tools/gpu_check.sh", "rehearse", "--collect-only", "-m", "device_quick", "-p", "offload_probe"]
    run = subprocess.run(command, cwd=ROOT, env=_rehearsal_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "demo model's head runs on CPU" in log and "0 steps failed" in log, log[-3000:]
    assert re.search(rf"\n{len(DEVICE_QUICK) + 1}/\d+ tests collected", log), log[-3000:]  # (the plan's test has two cases)
    assert json.loads((tmp_path / "probe.json").read_text())["n_gpu_layers"] == -1


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_device_check_prints_its_usage(flag):
    """--help prints the script's header comment, its usage, wherever the Vulkan venv is (none here), and exits 0."""
    run = subprocess.run(["bash", str(ROOT / "tools" / "device_check.sh"), flag], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout.startswith("The device set on Vulkan") and "bash tools/device_check.sh [VENV] [--quick]" in run.stdout
    assert run.stdout.rstrip().endswith("not how fast it is.") and "#" not in run.stdout.split("\n")[0]

"""`clef-gguf serve --ray` after a non-editable install, started with the working directory at a checkout's root.

Ray puts the driver's working directory on its workers' sys.path: replicas used to import the checkout's clef_gguf,
which has no built libclef_head, and died at start-up (server/ray_local.py, imported_from_here). Here pip builds a
real wheel of the checkout's files and installs it into a virtual environment of its own, which sees this one's
dependencies through a .pth line (a line of a .pth is put on sys.path as it is: the .pth files in that folder, this
environment's editable install of clef_gguf among them, are not run). The server then runs from a copy of the
checkout, which has no built library. tools/check_ray_installed.sh does the same with a full `pip install '.[ray]'`
into a bare environment (minutes: every dependency).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra: pip install 'clef-gguf[ray]' (tools/test.sh does)")

from live_server import free_port, wait_healthy  # noqa: E402

from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEPLOY_TIMEOUT_S = 300.0


def _checkout_copy(dst: Path) -> Path:
    """The files git knows (as they are in the work tree), without anything built."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)
    return dst


def _run(*command: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


def test_serve_ray_from_the_checkout_root_runs_the_installed_package(tmp_path):
    checkout = _checkout_copy(tmp_path / "checkout")
    started = time.perf_counter()
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", checkout)
    built = time.perf_counter() - started
    [wheel] = (tmp_path / "dist").glob("clef_gguf-*.whl")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel)
    installed = _run(python, "-c", "import clef_gguf; print(clef_gguf.__file__)", cwd=Path("/")).strip()
    assert installed.startswith(str(site)), installed  # the wheel's, not this environment's editable checkout
    assert not (checkout / "clef_gguf" / "_native").exists()  # the case at issue: nothing built in the checkout

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local cluster of its own
    command = [venv / "bin" / "clef-gguf", "serve", DEMO_MODEL, "--ray", "--replicas", "1", "--port", str(port)]
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(
            [str(c) for c in command], cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(server, url, DEPLOY_TIMEOUT_S)
        except AssertionError:
            pytest.fail("serve --ray did not start:\n" + (tmp_path / "serve.log").read_text()[-4000:])
        decided = httpx.post(
            f"{url}/v1/systemone", content=DEMO_REQUEST.read_bytes(), headers={"content-type": "application/json"}, timeout=120
        )
        assert decided.status_code == 200 and decided.json()["answers"], decided.text
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
    finally:
        server.terminate()
        server.wait(timeout=120)
    print(f"\nwheel built in {built:.0f} s; served from {checkout}")

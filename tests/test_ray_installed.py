"""`clef-gguf serve --ray` on a local Ray cluster it starts itself, after a non-editable install, started with the
working directory at a checkout's root, then stopped with SIGTERM: the one test of a `serve --ray` that starts and
stops its own cluster (the other Ray tests join the session's, conftest.py's ray_address).

Ray puts the driver's working directory on its workers' sys.path: replicas used to import the checkout's clef_gguf,
which has no built libclef_head, and died at start-up (runtime/ray_local.py, imported_from_here). Here pip builds a
real wheel of the checkout's files and installs it into a virtual environment of its own, which sees this one's
dependencies through a .pth line (a line of a .pth is put on sys.path as it is: the .pth files in that folder, this
environment's editable install of clef_gguf among them, are not run). The server then runs from a copy of the
checkout, which has no built library. tools/check_ray_installed.sh does the same with a full `pip install '.[ray]'`
into a bare environment (minutes: every dependency).

Stopped with SIGTERM while a client keeps posting: a request admitted before (its body still being sent) gets its
200, every other answer is a 200 or our JSON 503 with Retry-After (never Ray's 404 text/plain, which it answered from
its application's deletion to its proxy's stop), then connections fail; Ray's processes and this run's session
folder are gone, and Ray reported no failed task.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra: pip install 'clef-gguf[ray]' (tools/test.sh does)")

from live_server import free_port, wait_healthy  # noqa: E402

from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST  # noqa: E402
from clef_gguf.testing.ray_cluster import wait_deployed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEPLOY_TIMEOUT_S = 300.0
TIMEOUT = 300.0
HEADERS = {"content-type": "application/json"}
Answer = tuple[int, str | None, str | None, bytes] | str  # status, content type, Retry-After, body; or the error's name


def _checkout_copy(dst: Path) -> Path:
    """The work tree's files, those git knows and those it would add (new files not yet committed), without what it
    ignores (anything built)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dst / name)
    return dst


def _run(*command: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


def _installed(tmp_path: Path, checkout: Path) -> Path:
    """The checkout's wheel installed into a virtual environment of its own: its `clef-gguf` command."""
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", checkout)
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
    return venv / "bin" / "clef-gguf"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone but for its parent


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """Ray's temporary folder (RAY_TMPDIR) for one run alone, so that its session folders can be counted; short: a
    session's socket paths must fit in AF_UNIX's 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _stopped_while_posting(url: str, server: subprocess.Popen[str], log: Path) -> tuple[list[Answer], list[object]]:
    """SIGTERM once a slow request is inside the ingress, a client posting until the process exits: every answer it
    got, and the slow request's own (its body finished once the doors closed: a 503 came)."""
    body = DEMO_REQUEST.read_bytes()
    release = threading.Event()
    slow: list[object] = []
    answers: list[Answer] = []

    def slow_body() -> Iterator[bytes]:
        yield body[:100]
        release.wait(TIMEOUT)
        yield body[100:]

    def send_slowly() -> None:
        try:
            slow.append(httpx.post(f"{url}/v1/systemone", content=slow_body(), headers=HEADERS, timeout=TIMEOUT))
        except httpx.TransportError as e:
            slow.append(e)

    admitted = threading.Thread(target=send_slowly)
    try:
        wait_deployed(log, server, DEPLOY_TIMEOUT_S)
        deadline = time.monotonic() + DEPLOY_TIMEOUT_S
        admitted.start()
        while httpx.get(f"{url}/health", timeout=TIMEOUT).json()["reading"] != 1:  # its body is being read: it is inside
            assert time.monotonic() < deadline, "the slow request never reached the ingress"
            time.sleep(0.05)
        server.send_signal(signal.SIGTERM)
        with httpx.Client(base_url=url, timeout=30) as http:  # a request left unanswered would be a ReadTimeout
            while server.poll() is None:
                try:
                    r = http.post("/v1/systemone", content=body, headers=HEADERS)
                except httpx.TransportError as e:
                    answers.append(type(e).__name__)
                else:
                    answers.append((r.status_code, r.headers.get("content-type"), r.headers.get("retry-after"), r.content))
                    if r.status_code == 503:
                        release.set()  # the doors are closed, the drain waits for the slow request: let it finish
                time.sleep(0.02)  # (a client's pace, not a wait: a tight loop of 503s would take a core from the drain)
        release.set()  # (if no 503 came, the assertions say so)
        server.wait(TIMEOUT)
        admitted.join(TIMEOUT)
    finally:
        release.set()  # on any failure too: the slow request's thread is not left waiting
    return answers, slow


def _drained(answers: list[Answer], slow: list[object]) -> None:
    refused = [a for a in answers if isinstance(a, tuple) and a[0] != 200]
    for status, content_type, retry_after, content in refused:
        assert (status, content_type, retry_after) == (503, "application/json", "1"), content
        assert json.loads(content)["detail"]["error_type"] == "overloaded_error"
    assert refused, answers  # the slow request was released on a 503
    errors = {a for a in answers if isinstance(a, str)}
    assert errors <= {"ConnectError", "ReadError", "RemoteProtocolError"}, errors  # no request left hanging
    assert isinstance(answers[-1], str), answers[-3:]  # the port closed before the process exited
    [answered] = slow
    assert isinstance(answered, httpx.Response) and answered.status_code == 200, answered
    assert "answers" in answered.json()


@pytest.mark.ray
@pytest.mark.slow
def test_serve_ray_of_the_installed_package_serves_then_drains_at_sigterm_and_leaves_no_session_folder(ray_tmp, tmp_path):
    checkout = _checkout_copy(tmp_path / "checkout")
    command = _installed(tmp_path, checkout)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(ray_tmp)}  # a cluster of its own
    args = ("serve", DEMO_MODEL, "--ray", "--replicas", "1", "--port", str(port), "--drain-timeout", "60")
    log = tmp_path / "serve.log"
    with open(log, "w") as output:
        server = subprocess.Popen(
            [str(c) for c in (command, *args)], cwd=checkout, env=env, stdout=output, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(server, url, DEPLOY_TIMEOUT_S)
        except AssertionError:
            pytest.fail("serve --ray did not start:\n" + log.read_text()[-4000:])
        [session] = (ray_tmp / "ray").glob("session_2*")  # this run's, while it serves
        decided = httpx.post(f"{url}/v1/systemone", content=DEMO_REQUEST.read_bytes(), headers=HEADERS, timeout=120)
        assert decided.status_code == 200 and decided.json()["answers"], decided.text
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
        _drained(*_stopped_while_posting(url, server, log))
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=120)
    output = log.read_text()
    assert server.returncode == 128 + signal.SIGTERM, output[-3000:]
    # No task failed by ray.kill (serve.shutdown's graceful_shutdown was one, at every stop).
    assert "killed by `ray.kill`" not in output and "Traceback" not in output, output[-3000:]
    pids = {int(pid) for pid in re.findall(r"pid=(\d+)", output)}  # Ray's prefixes: controller, proxy, replicas
    assert pids
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, [pid for pid in pids if _alive(pid)]
        time.sleep(0.2)
    assert not session.exists() and not list((ray_tmp / "ray").glob("session_*")), list((ray_tmp / "ray").iterdir())

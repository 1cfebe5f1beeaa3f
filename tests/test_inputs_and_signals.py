"""Inputs and signals, through the CLI (the demo model): what a command reads by path is refused at once when it
is not a regular file (a FIFO hung every command that opened one), a model given as an adapter is exit 6 everywhere
(both in this process: cli_helpers), and every command stops within seconds of SIGINT or SIGTERM, whatever it waits
on (a decision loop, a FIFO with no writer, Ray's connect in C++), with its partial output removed, exit 128+N (real
processes: `python -m clef_gguf.cli`).

Each command runs under a timeout: a hang fails the test, it never holds the suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cli_helpers import run_cli

from clef_gguf.cli.errors import STOP_S
from clef_gguf.data import DEMO_CONTEXT, DEMO_MODEL, DEMO_REQUEST
from clef_gguf.testing.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "labelled.jsonl"
CLI = [sys.executable, "-m", "clef_gguf.cli"]
CTX = ["--ctx", str(DEMO_CONTEXT)]
QUICK = 60  # s: a refusal takes a model's header at most; a FIFO opened blocking never ends
STOPPED_WITHIN = STOP_S + 1.0  # s from the signal to the exit: the cleanups, or the watchdog's end
UNDER_WAY_S = 120.0  # s: the most a run may take to get under way (Python's start-up, the demo's load: 2 to 4 s here)
ENV = {**os.environ, "COLUMNS": "300", "RAY_ADDRESS": ""}


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env={"RAY_ADDRESS": ""}, timeout=QUICK)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A FIFO no one writes to, labelled data long enough to be stopped mid-run, and an empty folder for outputs."""
    root = tmp_path_factory.mktemp("inputs")
    fifo = root / "fifo.gguf"
    os.mkfifo(fifo)
    long = root / "long.jsonl"
    long.write_bytes(DATA.read_bytes() * 100)  # (2,400 records: a minute and more of decisions)
    return {"fifo": fifo, "long": long, "root": root}


# --- item 3: a FIFO anywhere a model, an adapter, an mmproj or a release file is read ------------------------------
FIFO_CASES = {
    # name: (arguments: {fifo} the FIFO, {out} a fresh output path, {port} a free port; exit code)
    "decide model": (["decide", "{fifo}", DEMO_REQUEST], 5),
    "decide --adapter": (["decide", DEMO_MODEL, DEMO_REQUEST, "--adapter", "{fifo}"], 5),
    "decide --mmproj": (["decide", DEMO_MODEL, DEMO_REQUEST, "--mmproj", "{fifo}"], 5),
    "decide jsonl --adapter": (["decide", DEMO_MODEL, DATA, *CTX, "-o", "{out}", "--adapter", "{fifo}"], 5),
    "eval model": (["eval", "{fifo}", DATA, *CTX], 5),
    "eval --adapter": (["eval", DEMO_MODEL, DATA, *CTX, "--adapter", "{fifo}"], 5),
    "calibrate --adapter": (["calibrate", DEMO_MODEL, DATA, *CTX, "-o", "{out}", "--adapter", "{fifo}"], 5),
    "compare --adapter-a": (["compare", DEMO_MODEL, DEMO_MODEL, DATA, *CTX, "--adapter-a", "{fifo}"], 5),
    "compare data": (["compare", DEMO_MODEL, DEMO_MODEL, "{fifo}", *CTX], 2),  # (DATA is read once per model)
    "plan --adapter": (["plan", DEMO_MODEL, "--adapter", "{fifo}"], 5),
    "serve --adapter": (["serve", DEMO_MODEL, "--port", "{port}", "--adapter", "a={fifo}"], 5),
    "convert release": (["convert", "{release}", "-o", "{out}"], 3),  # (its config.json a FIFO)
}


@pytest.mark.parametrize("case", list(FIFO_CASES))
def test_a_fifo_is_refused_at_once_naming_it(files, tmp_path, case):
    args, code = FIFO_CASES[case]
    release = tmp_path / "release"
    release.mkdir()
    os.mkfifo(release / "config.json")
    where = {"fifo": files["fifo"], "out": tmp_path / "out.gguf", "port": free_port(), "release": release}
    started = time.monotonic()
    run = cli(*(str(a).format(**where) for a in args))
    assert run.returncode == code, (run.returncode, run.stderr[-2000:])
    assert "a FIFO" in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert len(run.stderr.strip().splitlines()) == 1 and run.stdout == "", run.stderr[-2000:]
    assert time.monotonic() - started < QUICK / 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release"]  # nothing written


@pytest.mark.parametrize("flag", ["", "--adapter", "--mmproj"])
def test_validate_reports_a_fifo_as_what_it_is(files, flag):
    """`validate` (the model, --adapter or --mmproj a FIFO): exit 5, "a FIFO", not "no such file" (exit 2)."""
    args = [files["fifo"]] if not flag else [DEMO_MODEL, flag, files["fifo"]]
    run = cli("validate", *args)
    assert run.returncode == 5, (run.stdout, run.stderr)
    assert "a FIFO" in run.stdout and "no such file" not in run.stdout + run.stderr, run.stdout


MODEL_AS_ADAPTER = {
    "validate": ["validate", DEMO_MODEL, "--adapter", DEMO_MODEL],
    "decide": ["decide", DEMO_MODEL, DEMO_REQUEST, "--adapter", DEMO_MODEL],
    "eval": ["eval", DEMO_MODEL, DATA, *CTX, "--adapter", DEMO_MODEL],
    "plan": ["plan", DEMO_MODEL, "--adapter", DEMO_MODEL],
    "serve": ["serve", DEMO_MODEL, "--port", "{port}", "--adapter", f"a={DEMO_MODEL}"],
}


@pytest.mark.parametrize("command", list(MODEL_AS_ADAPTER))
def test_a_model_given_as_the_adapter_is_exit_6_everywhere(command):
    """A file in the wrong place is exit 6 (docs/validation.md: a model given as the mmproj, or the other way round);
    decide said 2 and validate 6."""
    run = cli(*(str(a).format(port=free_port()) for a in MODEL_AS_ADAPTER[command]))
    assert run.returncode == 6, (run.returncode, run.stdout[-1000:], run.stderr[-2000:])
    assert "Traceback" not in run.stderr
    assert "not an adapter file" in run.stdout + run.stderr


# --- item 4: SIGINT and SIGTERM ------------------------------------------------------------------------------------
def _stop(process: subprocess.Popen[bytes], signum: int) -> tuple[float, str]:
    """Send `signum`; the seconds the process took to end, and its stderr."""
    assert process.poll() is None, "the command ended before the signal: make its work longer"
    sent = time.monotonic()
    process.send_signal(signum)
    try:
        _, stderr = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"still running 30 s after {signal.Signals(signum).name}")
    return time.monotonic() - sent, stderr.decode(errors="replace")


def _under_way(process: subprocess.Popen[bytes], ready: Callable[[], bool], what: str) -> None:
    """Wait until `ready()` (polled), failing if the process ends first: the signal then comes mid-run, not at a
    guessed time (the runs stopped last a minute and more)."""
    deadline = time.monotonic() + UNDER_WAY_S
    while not ready():
        assert process.poll() is None, f"the command ended before {what}"
        assert time.monotonic() < deadline, f"not {what} after {UNDER_WAY_S} s"
        time.sleep(0.05)


def _reading(process: subprocess.Popen[bytes], path: Path) -> Callable[[], bool]:
    """Whether the process has `path` open (its model loaded: each command loads before it reads DATA)."""

    def reading() -> bool:
        with contextlib.suppress(OSError):  # (a descriptor closed while listed)
            return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{process.pid}/fd").iterdir())
        return False

    return reading


RUNS = {
    # name: arguments ({long} the long data, {out} an empty folder, left empty by eval, compare and calibrate)
    "eval": ["eval", DEMO_MODEL, "{long}", *CTX, "-o", "{out}"],
    "calibrate": ["calibrate", DEMO_MODEL, "{long}", *CTX, "-o", "{out}/calibrated.gguf"],
    "compare": ["compare", DEMO_MODEL, DEMO_MODEL, "{long}", *CTX, "-o", "{out}"],
    "decide": ["decide", DEMO_MODEL, "{long}", *CTX, "-o", "{out}/answers.jsonl"],
}


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
@pytest.mark.parametrize("command", list(RUNS))
def test_a_signal_mid_run_stops_it_at_once_with_whole_outputs_only(files, tmp_path, command, signum):
    """eval, calibrate and compare (which the issue found ignoring SIGTERM) and decide's JSON Lines mode, stopped
    while deciding: exit 128+N within seconds, one line, no partial report or model (decide: whole answer lines)."""
    out = tmp_path / "out"
    out.mkdir()
    argv = [*CLI, *(str(a).format(long=files["long"], out=out) for a in RUNS[command])]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    try:
        answers = out / "answers.jsonl"  # (decide: its first answer written; the others write at their end)
        deciding = _reading(process, files["long"])
        if command == "decide":
            deciding = lambda: answers.exists() and answers.stat().st_size > 0  # noqa: E731
        _under_way(process, deciding, "deciding")
        took, stderr = _stop(process, signum)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signum, stderr[-2000:]
    assert took < STOPPED_WITHIN, (took, stderr[-2000:])
    assert f"stopped by {signum.name}" in stderr and "Traceback" not in stderr, stderr[-2000:]
    left = sorted(p.name for p in out.iterdir())
    if command != "decide":
        assert left == [], left
    else:  # (its answers are kept, whole lines: --resume continues them)
        assert left == ["answers.jsonl"], left
        for line in (out / "answers.jsonl").read_bytes().splitlines(keepends=True):
            assert line.endswith(b"\n") and "line" in json.loads(line), line[:200]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_stops_a_read_of_a_fifo_no_one_writes(files, tmp_path, signum):
    """eval's DATA may be a pipe or a FIFO, read as stdin is (docs/dataset.md): one with no writer waits, as `cat`
    would, and a signal ends that wait at once."""
    fifo = tmp_path / "requests.jsonl"
    os.mkfifo(fifo)
    process = subprocess.Popen([*CLI, "eval", str(DEMO_MODEL), str(fifo), *CTX], stderr=subprocess.PIPE, env=ENV)
    try:
        # The model loaded, DATA's open waiting for a writer (the kernel's wait for a FIFO's other end).
        _under_way(process, lambda: Path(f"/proc/{process.pid}/wchan").read_text() == "wait_for_partner", "waiting on the FIFO")
        took, stderr = _stop(process, signum)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signum and took < STOPPED_WITHIN, (took, stderr[-2000:])


# --- decide --ray --address where no cluster answers --------------------------------------------------------------
@pytest.fixture
def silent_listener() -> Iterator[tuple[int, list[socket.socket]]]:
    """A port on every interface (Ray resolves 127.0.0.1 to the node's IP) that accepts connections and never
    answers: Ray's connect to it waits in C++, where no Python signal handler runs. The port, and the connections
    it holds."""
    server = socket.create_server(("0.0.0.0", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], held
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_decide_on_ray_at_an_address_with_no_cluster_is_refused_in_seconds(tmp_path):
    """It retried for minutes: now a port that takes no connection is refused at once, exit 2, in one line."""
    pytest.importorskip("ray")
    started = time.monotonic()
    address = f"127.0.0.1:{free_port()}"
    argv = [*CLI, "decide", str(DEMO_MODEL), str(DATA), *CTX, "-o", str(tmp_path / "answers.jsonl"), "--ray"]
    run = subprocess.run([*argv, "--address", address], capture_output=True, text=True, timeout=QUICK, env=ENV)  # (Ray: apart)
    assert time.monotonic() - started < 30
    assert run.returncode == 2, run.stderr[-2000:]
    assert "no Ray cluster answers at 127.0.0.1:" in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr[-2000:]
    assert not (tmp_path / "answers.jsonl").exists()  # refused before OUT was created: no empty answers file left


@pytest.mark.slow
def test_sigterm_stops_ray_s_connect_while_it_waits_in_c(silent_listener, tmp_path):
    """Inside ray.init's connect (C++, minutes by default) SIGTERM used to wait: the watchdog ends the command."""
    pytest.importorskip("ray")
    port, held = silent_listener
    argv = [*CLI, "decide", str(DEMO_MODEL), str(DATA), *CTX, "-o", str(tmp_path / "a.jsonl"), "--ray", "--address"]
    process = subprocess.Popen([*argv, f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    try:
        # Ray imported, the address probed (one connection, closed), ray.init connecting to a GCS that never answers.
        _under_way(process, lambda: len(held) >= 2, "connecting")
        took, stderr = _stop(process, signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGTERM and took < STOPPED_WITHIN, (took, stderr[-2000:])
    assert "stopped by SIGTERM" in stderr, stderr[-2000:]

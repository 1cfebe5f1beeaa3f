"""`clef-gguf ARGS` in this test process: Typer's CliRunner on clef_gguf.cli.app, for a command's refusals, argument
errors and outputs. A subprocess would import llama.cpp and Typer again each time (seconds on 2 busy cores); the
command's own code, its one-line errors and exit codes (cli/errors.py) are the same here.

What only a process has is tested with real subprocesses elsewhere: a signal's stop and the watchdog that ends a
stuck process (test_inputs_and_signals, test_convert_files, test_dataset), the console script and `python -m`
(test_cli, test_readme), a library that cannot load (test_no_driver), `serve` itself (live_server)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from types import FrameType
from typing import Any

from typer.testing import CliRunner

from clef_gguf.cli.app import app

# Wide enough that Rich (typer's usage errors) never wraps a message across lines, as COLUMNS does for a subprocess.
WIDE = {"COLUMNS": "300"}


def run_cli(
    *args: str | Path,
    stdin: bytes | str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    text: bool = True,
) -> subprocess.CompletedProcess[Any]:
    """`clef-gguf ARGS` with `stdin`, the environment changed by `env`: exit code, stdout and stderr as a subprocess
    gives them (str, or bytes if not `text`). An exception the CLI did not turn into its one line is raised here (the
    test fails with it); a command still running after `timeout` seconds (a FIFO nobody writes) raises TimeoutError
    (SIGALRM interrupts the wait)."""
    argv = [str(a) for a in args]

    def expired(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"clef-gguf {' '.join(argv)}: still running after {timeout} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        runner = CliRunner()
        result = runner.invoke(app, argv, input=stdin, env={**WIDE, **(env or {})}, catch_exceptions=False, prog_name="clef-gguf")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if not text:
        return subprocess.CompletedProcess(["clef-gguf", *argv], result.exit_code, result.stdout_bytes, result.stderr_bytes)
    return subprocess.CompletedProcess(["clef-gguf", *argv], result.exit_code, result.stdout, result.stderr)

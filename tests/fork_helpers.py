"""A zygote for tests that start many short Python processes for their exit status, stdout and stderr: one process
imports what the cases need once, then forks a child per case, instead of a new interpreter per case (each importing
llama.cpp, the runtime and Typer again: most of a second on 2 busy cores, for ~0.05 s of work).

Each case is still a process of its own, which is what these tests check: its own pid, its stdout and stderr files,
its own exit status. A crash (GGML_ASSERT's SIGABRT, a division's SIGFPE) kills that child, not the zygote nor pytest,
and `Zygote.run` gives what subprocess.run(capture_output=True, text=True) gives: the wait status as a returncode
(negative for a signal), stdout and stderr. The child runs `python -m MODULE ARGS` as the interpreter does (runpy:
sys.argv, __main__, sys.path[0] the working directory) or `python -c CODE ARGS` in a new __main__ module, and ends as
an interpreter ends: SystemExit's code, or an uncaught exception's traceback and 1, after the atexit handlers and the
flush of stdout and stderr.

What a forked child shares with the zygote, unlike a new `python`:
- The modules the zygote imported, with their import-time state, including the environment variables read at import:
  the child sees its job's environment (os.environ and C's getenv) only where it is read later. So the zygote starts
  with the environment its jobs run in by default, and a job may change only variables read after import. Read at
  import here: the interpreter's PYTHON* variables, LLAMA_CPP_LIB_PATH (llama_cpp loads its library), numpy's
  OPENBLAS_NUM_THREADS, and COLUMNS, NO_COLOR, FORCE_COLOR and TERM (Rich's console in cli/errors.py). Read later, in
  the child: GGML_NO_BACKTRACE (by ggml when it aborts), CLEF_GGUF_LOADER and CLEF_GGUF_LLAMA_LOG (at a model's load),
  CLEF_GGUF_NATIVE_LIB (the native head, loaded at first use).
- No threads: the zygote starts none and initialises no llama.cpp backend (llama_backend_init runs at a model's load,
  in the child; the zygote here runs one thread); numpy's OpenBLAS, where it starts a pool at import, stops it around
  fork (its own pthread_atfork handler).
- A traceback of an exception the job does not catch has the zygote's frames at its top.

What is about the interpreter's own start (the console script, imports blocked, a library that cannot load), a
signal sent to a running command, or a terminal, stays a plain subprocess.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

OUTPUTS = {"stdout": 1, "stderr": 2}  # the files a child writes, and their fds


@dataclass
class Zygote:
    """The test's end of a zygote (`zygote()`): `run` sends it a job and waits for its child's end."""

    process: subprocess.Popen[bytes]
    folder: Path  # the jobs' stdout and stderr files, and the zygote's own stderr
    env: dict[str, str]
    jobs: int = 0
    _unread: bytes = field(default=b"", repr=False)

    def run(
        self,
        *args: str | Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """`python ARGS` ("-m", MODULE, ... or "-c", CODE, ...) in a child of the zygote, with `env` (default: the
        zygote's), stdin empty; as subprocess.run gives it, TimeoutExpired (the child killed) after `timeout` s."""
        argv = [str(a) for a in args]
        if argv[0] not in ("-m", "-c"):
            raise ValueError(f"a zygote runs `python -m` or `python -c`, not {argv[0]!r}")
        self.jobs += 1
        files = {name: self.folder / f"{self.jobs}.{name}" for name in OUTPUTS}
        job = {"argv": argv, "env": dict(self.env if env is None else env), "cwd": str(cwd or Path.cwd())}
        self.process.stdin.write(json.dumps({**job, **{name: str(files[name]) for name in OUTPUTS}}).encode() + b"\n")
        self.process.stdin.flush()
        deadline = time.monotonic() + timeout
        pid = self._receive(deadline)["pid"]
        try:
            returncode = self._receive(deadline)["returncode"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)  # as subprocess.run does; the zygote reaps it and says so
            self._receive(time.monotonic() + 60)
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, *_read(files)) from None
        return subprocess.CompletedProcess([sys.executable, *argv], returncode, *_read(files))

    def _receive(self, deadline: float) -> dict[str, Any]:
        """The zygote's next line; TimeoutError past `deadline`, RuntimeError with its stderr if it ended."""
        fd = self.process.stdout.fileno()
        while b"\n" not in self._unread:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError
            chunk = os.read(fd, 4096)
            if not chunk:
                said = (self.folder / "zygote.stderr").read_text(errors="replace")
                raise RuntimeError(f"the zygote ended (status {self.process.wait()}): {said[-2000:]}")
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        return json.loads(line)


def _read(files: dict[str, Path]) -> list[str]:
    return [files[name].read_text() for name in OUTPUTS]


@contextmanager
def zygote(folder: Path, *modules: str, env: Mapping[str, str]) -> Iterator[Zygote]:
    """A zygote that imported `modules`, in the environment `env`, its files in `folder`; ended on leaving."""
    with open(folder / "zygote.stderr", "wb") as said:
        process = subprocess.Popen(
            [sys.executable, __file__, *modules], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=said, env=dict(env)
        )
    try:
        yield Zygote(process, folder, dict(env))
    finally:
        process.stdin.close()  # its end of file: the zygote returns
        process.wait(timeout=60)
        process.stdout.close()


# --- The zygote's side ----------------------------------------------------------------------------------------


def serve(modules: list[str]) -> None:
    """Import `modules`, then for each job on stdin fork a child that runs it, and say its pid, then its returncode.
    The jobs are read through their own file object and the answers written to fd 1 directly, so that a child's
    sys.stdin and sys.stdout hold nothing of them."""
    for module in modules:
        importlib.import_module(module)
    jobs = open(0, "rb", closefd=False)  # noqa: SIM115 - fd 0, for the zygote's life
    for line in jobs:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(job)
        _say({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _say({"returncode": os.waitstatus_to_exitcode(status)})


def _say(answer: dict[str, int]) -> None:
    os.write(1, json.dumps(answer).encode() + b"\n")  # one small write: the test reads whole lines


def _child(job: dict[str, Any]) -> NoReturn:
    """Become the job's process: /dev/null and its files on fds 0, 1 and 2, its directory and environment, then its
    code. What ends the code (SystemExit, an exception) leaves through serve() and ends this process as the
    interpreter ends."""
    streams = [(os.devnull, 0, os.O_RDONLY)] + [
        (job[name], fd, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) for name, fd in OUTPUTS.items()
    ]
    for path, fd, flags in streams:
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    flag, target, *args = job["argv"]
    if flag == "-m":
        sys.path[0], sys.argv = os.getcwd(), [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0], sys.argv = "", ["-c", *args]
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        exec(compile(target, "<string>", "exec"), main.__dict__)
    raise SystemExit(0)


if __name__ == "__main__":
    serve(sys.argv[1:])

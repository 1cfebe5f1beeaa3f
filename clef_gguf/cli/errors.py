"""Where the command's outcomes become exit codes (errors.ExitCode, the one table of them): a library error
(clef_gguf/errors.py) one line on stderr and its class's exit code, a signal 128+N, never a traceback.

SIGTERM and SIGHUP (Windows: SIGBREAK, Ctrl+Break) unwind like SIGINT, so that the library's finally blocks remove
partial files; a signal that arrives inside llama.cpp's log callback (its quantizer logs through Python) waits for
the next progress update, since ctypes drops an exception raised there.

A Python signal handler runs only when the main thread runs Python again: stuck in C code (Ray's connect, which
retries for minutes; a read of a hung file system; a long llama.cpp computation), or in a cleanup that waits for a
thread that is, the command would not stop. So in the command's process (main: end_on_signals) a watchdog thread
wakes at each signal (signal.set_wakeup_fd: written by the C-level handler, whatever the main thread is doing) and,
if the process is still there STOP_S later, removes the partial files this process made (outputs.temporary's), says
the one line, and ends it: exit 128+N, within STOP_S of the signal whatever it was waiting on.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console

from ..errors import ClefError, ExitCode, printable, signalled
from ..outputs import remove_temporaries

err = Console(stderr=True)
T = TypeVar("T")


def line(text: object) -> str:
    """One printable line: messages quote paths, names and values from files, which may hold escapes or newlines."""
    return printable(str(text), limit=2000)


def say(text: object) -> None:
    """A line on stderr, as it is (markup=False: a path holding `[/b]` is text, not Rich markup)."""
    err.print(line(text), markup=False, highlight=False, soft_wrap=True)


def error(message: object) -> None:
    err.print(f"error: {line(message)}", markup=False, highlight=False, soft_wrap=True, style="bold red")


def fail(message: str) -> NoReturn:
    """Options that exclude each other, or that cannot work together: one line and exit 2, as for click's own."""
    error(message)
    raise typer.Exit(ExitCode.BAD_INPUT)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is, so that cleanups run as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _in_llama_log(frame: FrameType | None) -> bool:
    """Whether `frame` runs inside llama.cpp's log callback (llama/log.inside_callback). Only a process that loaded
    llama/log.py can be there: the CLI imports no llama.cpp for this (--help loads none)."""
    log = sys.modules.get("clef_gguf.llama.log")
    return log is not None and log.inside_callback(frame)


_pending: list[int] = []  # a signal that arrived where raising would have been lost
# Windows has no SIGHUP, and its consoles stop a program with Ctrl+C (SIGINT) or Ctrl+Break (SIGBREAK); SIGTERM
# there comes only from the program itself (TerminateProcess, taskkill /F, cannot be caught anywhere).
STOPPING = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGBREAK") if hasattr(signal, name))
# After a signal, the most a command takes to end: its cleanups (partial files removed, a model's compute in
# progress awaited) take milliseconds to a second, a local Ray cluster's stop about 2 s (measured: decide --ray);
# past this the command is stuck, and ends at once (the watchdog).
STOP_S = 3.0
PARTIAL_REMOVED = "partial output removed"


@dataclass
class _Stopping:
    """What the watchdog reads: whether a command runs under signals_clean_up (or ends after a signal there), and
    what its stop says of the output."""

    active: bool = False  # a signals_clean_up block is open
    ending: bool = False  # one ended by a signal: the process ends (a thread stuck in C may hold its exit)
    stopped: str = PARTIAL_REMOVED
    said: bool = False  # run() said the "stopped by" line: the watchdog does not say it again


_state = _Stopping()
_wakeup_pair: list[socket.socket] = []  # the watchdog's write end, alive as long as the process


def _end_now(signum: int) -> None:
    """The watchdog's end of a command stuck STOP_S after a signal: its partial files removed, the line, exit 128+N.
    Written with os.write: the main thread may hold the console's lock, and stdout's buffer (a partial answer)
    is dropped, not flushed."""
    remove_temporaries()
    if not _state.said:
        text = f"error: stopped by {signal.Signals(signum).name}; {_state.stopped}\n"
        with suppress(OSError):
            os.write(2, text.encode(errors="replace"))
    os._exit(signalled(signum))


def _watch(wakeup: socket.socket) -> None:
    """The watchdog thread: each byte on `wakeup` is a signal that arrived (signal.set_wakeup_fd)."""
    while True:
        try:
            got = wakeup.recv(64)
        except OSError:
            return
        if not got:  # (the write end closed: no signal can come any more)
            return
        for signum in got:
            if signum in STOPPING and (_state.active or _state.ending):
                time.sleep(STOP_S)  # (the process normally ends meanwhile: this daemon thread with it)
                _end_now(signum)


def end_on_signals() -> None:
    """In the command's own process (cli.main): start the watchdog. Not in a process that merely calls the CLI's
    functions (a test): a watchdog ends the whole process."""
    if threading.current_thread() is not threading.main_thread():
        return
    # A socket pair, not a pipe: Windows' set_wakeup_fd takes a socket (and a pipe cannot be made non-blocking there).
    wakeup, tripped = socket.socketpair()
    tripped.setblocking(False)  # (set_wakeup_fd requires it: a full buffer must not block a signal handler)
    signal.set_wakeup_fd(tripped.fileno(), warn_on_full_buffer=False)
    _wakeup_pair.append(tripped)  # (kept open: set_wakeup_fd holds its descriptor, not the socket object)
    threading.Thread(target=_watch, args=(wakeup,), name="clef-signal-watchdog", daemon=True).start()


def raise_pending() -> None:
    """Raise a signal deferred by the handler, once Python runs outside llama.cpp again (progress calls this)."""
    if _pending and not _in_llama_log(sys._getframe()):
        raise Terminated(_pending[0])


@contextmanager
def signals_clean_up(stopped: str = PARTIAL_REMOVED) -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like SIGINT (finally blocks remove partial files); later signals wait for that.
    Within one such block another does nothing (run() opens one around every command but serve).

    Inside llama.cpp's log callback the signal is kept and raised at the next progress update out of it
    (raise_pending): an exception cannot unwind C frames. In the command's process the watchdog (end_on_signals)
    ends it STOP_S after a signal whatever it is stuck in, saying `stopped`.
    """
    if _state.active:
        yield
        return
    signals = STOPPING

    def unwind(signum: int, frame: FrameType | None) -> None:
        for s in signals:  # a second signal must not interrupt the cleanup the first one started
            signal.signal(s, signal.SIG_IGN)
        _pending.append(signum)
        if not _in_llama_log(frame):
            raise Terminated(signum)

    previous = {s: signal.signal(s, unwind) for s in signals}
    _state.active, _state.stopped = True, stopped
    stopping = False
    try:
        yield
    except Exception as e:
        # C code between the handler and here can swallow its exception and fail another way (numpy's
        # tofile made it a TypeError, pathlib a SystemError): once a signal came, what unwinds is that signal.
        if _pending:
            raise Terminated(_pending[0]) from e
        raise
    except KeyboardInterrupt:
        stopping = True
        raise
    finally:
        _state.ending = stopping or bool(_pending)
        _pending.clear()  # a later error, outside this block, is not the signal's
        for s, handler in previous.items():
            signal.signal(s, handler)
        _state.active = False


def run(action: Callable[[], T], *, stopped: str = PARTIAL_REMOVED, signals: bool = True) -> T:
    """Run a library call; a ClefError becomes one line on stderr and its exit code, a signal (SIGINT, SIGTERM,
    SIGHUP) 128+N and one line saying so and what became of the output (`stopped`). With `signals` (every command
    but serve, whose server drains at SIGTERM), inside signals_clean_up."""

    def guarded() -> T:
        if not signals:
            return action()
        with signals_clean_up(stopped):
            return action()

    try:
        return guarded()
    except ClefError as e:
        error(e)
        _exit(e.exit_code)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        error(f"stopped by {signal.Signals(signum).name}; {stopped}")
        _state.said = True
        _exit(signalled(signum))


def one_line(command: Callable[..., None]) -> Callable[..., None]:
    """A command whose own settings (a table of settings.py refusing what llama.cpp would abort on) raise a ClefError
    before it reaches `run`: the same one line and exit code."""

    @functools.wraps(command)  # (typer reads the flags from the wrapped signature)
    def mapped(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except ClefError as e:
            error(e)
            raise typer.Exit(e.exit_code) from None

    return mapped


def _ray_driver_abandoned() -> bool:
    """runtime/ray_local.driver_abandoned, where this process loaded it (the CLI imports no Ray for this)."""
    ray_local = sys.modules.get("clef_gguf.runtime.ray_local")
    return ray_local is not None and ray_local.driver_abandoned()


def _exit(code: int) -> NoReturn:
    """Exit `code`; at once (os._exit, the cleanups done) where Ray's driver was left connected to a local cluster
    that stopped with this process: the interpreter's own exit would wait for that cluster."""
    if _ray_driver_abandoned():
        sys.stdout.flush()
        os._exit(code)
    raise typer.Exit(code) from None


DRAINED = "drained: the requests admitted before it were answered"
CLUSTER_GONE = "the local Ray cluster stopped with it (the signal reached its processes too): nothing was left to drain"


def serve_until_stopped(action: Callable[[], int | None]) -> None:
    """Run a server (`serve`, `serve --ray`), which drains at SIGTERM, SIGINT or SIGHUP and then returns the signal:
    the one line, and exit 128+N, as every command stopped by a signal. Not inside signals_clean_up: its watchdog would
    end the process during a drain longer than STOP_S."""
    signum = run(action, signals=False)
    if signum is not None:
        say(f"stopped by {signal.Signals(signum).name}; {CLUSTER_GONE if _ray_driver_abandoned() else DRAINED}")
        _exit(signalled(signum))

"""Where the command's outcomes become exit codes: a library error (clef_gguf/errors.py) one line on stderr
and its exit code, a signal 128+N, never a traceback.

SIGTERM and SIGHUP unwind like SIGINT, so that the library's finally blocks remove partial files; a signal
that arrives inside llama.cpp's log callback (its quantizer logs through Python) waits for the next progress
update, since ctypes drops an exception raised there.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import NoReturn, TypeVar

import typer
from rich.console import Console

from ..check.report import printable
from ..errors import ClefError
from ..llama.log import inside_callback

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


def fail(message: str, code: int = 2) -> NoReturn:
    """Options that exclude each other, or that cannot work together: one line and exit 2, as for click's own."""
    error(message)
    raise typer.Exit(code)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is, so that cleanups run as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_pending: list[int] = []  # a signal that arrived where raising would have been lost


def raise_pending() -> None:
    """Raise a signal deferred by the handler, once Python runs outside llama.cpp again (progress calls this)."""
    if _pending and not inside_callback():
        raise Terminated(_pending[0])


@contextmanager
def signals_clean_up() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like SIGINT (finally blocks remove partial files); later signals wait for that.

    Inside llama.cpp's log callback the signal is kept and raised at the next progress update out of it
    (raise_pending): an exception cannot unwind C frames.
    """
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def unwind(signum: int, frame: FrameType | None) -> None:
        for s in signals:  # a second signal must not interrupt the cleanup the first one started
            signal.signal(s, signal.SIG_IGN)
        _pending.append(signum)
        if not inside_callback(frame):
            raise Terminated(signum)

    previous = {s: signal.signal(s, unwind) for s in signals}
    try:
        yield
    except Exception as e:
        # C code between the handler and here can swallow its exception and fail another way (numpy's
        # tofile made it a TypeError, pathlib a SystemError): once a signal came, what unwinds is that signal.
        if _pending:
            raise Terminated(_pending[0]) from e
        raise
    finally:
        _pending.clear()  # a later error, outside this block, is not the signal's
        for s, handler in previous.items():
            signal.signal(s, handler)


PARTIAL_REMOVED = "partial output removed"


def run(action: Callable[[], T], *, stopped: str = PARTIAL_REMOVED) -> T:
    """Run a library call; a ClefError becomes one line on stderr and its exit code, a signal (SIGINT, SIGTERM,
    SIGHUP) 128+N and one line saying so and what became of the output (`stopped`)."""
    try:
        return action()
    except ClefError as e:
        error(e)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        error(f"stopped by {signal.Signals(signum).name}; {stopped}")
        raise typer.Exit(128 + signum) from None

"""The `clef-gguf` command: each command parses its arguments and calls the Python API, nothing else.

Library errors are typed (clef_gguf/errors.py); cli/errors.py turns them, and signals, into one line on
stderr and an exit code, never a traceback. A command imports the library when it runs (--help and --version load
no llama.cpp): a llama-cpp-python whose libraries cannot load here is that one line too, wherever it is first
imported.
"""

from __future__ import annotations

import signal
import sys

from ..errors import BackendUnavailableError, signalled


def main() -> None:
    try:
        from .app import app
        from .errors import end_on_signals
    except KeyboardInterrupt:  # (Ctrl-C while the modules load: the line, not an import's traceback)
        print("error: stopped by SIGINT", file=sys.stderr)
        raise SystemExit(signalled(signal.SIGINT)) from None
    end_on_signals()  # this process is the command: a signal ends it within seconds, whatever it waits on
    try:
        app()
    except BackendUnavailableError as e:  # (imported outside cli/errors.run: by a command before its run)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None

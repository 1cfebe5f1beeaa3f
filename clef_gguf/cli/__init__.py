"""The `clef-gguf` command: each command parses its arguments and calls the Python API, nothing else.

Library errors are typed (clef_gguf/errors.py); cli/errors.py turns them, and signals, into one line on
stderr and an exit code, never a traceback. The commands (cli/app.py) are imported by main(): a llama-cpp-python
whose libraries cannot load here is that one line too.
"""

from __future__ import annotations

import sys

from ..errors import BackendUnavailableError


def main() -> None:
    try:
        from .app import app
        from .errors import end_on_signals
    except BackendUnavailableError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except KeyboardInterrupt:  # (Ctrl-C while the libraries load: the line, not an import's traceback)
        print("error: stopped by SIGINT", file=sys.stderr)
        raise SystemExit(128 + 2) from None
    end_on_signals()  # this process is the command: a signal ends it within seconds, whatever it waits on
    app()

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
    except BackendUnavailableError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    app()

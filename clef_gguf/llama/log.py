"""llama.cpp's backend initialisation and its log, routed.

llama.cpp is chatty on stderr. Its errors are kept (to explain a failed load in one
line); info lines are dropped, unless a caller captures them for a while (the
quantizer's per-tensor lines drive a progress bar). CLEF_GGUF_LLAMA_LOG=1 leaves
llama.cpp's own logging on stderr.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import llama_cpp as L

_LEVEL_ERROR = 4  # GGML_LOG_LEVEL_ERROR
_lock = threading.Lock()
_ready = False
_mtmd_routed = False
_errors: list[str] = []
_capture: list[Callable[[str], None]] = []


def _on_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    if not text:
        return
    line = text.decode("utf-8", "replace")
    if level >= _LEVEL_ERROR:
        _errors.append(line.strip())
        del _errors[:-20]
    for callback in _capture:
        callback(line)


_log = L.llama_log_callback(_on_log)  # the C function pointer: kept alive here for as long as llama.cpp may call it


def inside_callback(frame: FrameType | None = None) -> bool:
    """Whether Python runs inside llama.cpp's log callback, in `frame` (default: the caller's).

    ctypes prints and drops an exception raised in a callback, and the C code goes on: a caller that must
    raise (a signal handler) waits until it is out. The stack is read, not a flag set in the callback's
    body: a signal that arrives during C code (llama.cpp's quantizer) has its handler run at the next
    Python instruction, the callback's first one, before any statement of its body.
    """
    frame = sys._getframe(1) if frame is None else frame
    while frame is not None:
        if frame.f_code is _on_log.__code__:
            return True
        frame = frame.f_back
    return False


def init_backend() -> None:
    global _ready
    with _lock:
        if not _ready:
            if not os.environ.get("CLEF_GGUF_LLAMA_LOG"):
                L.llama_log_set(_log, ctypes.c_void_p())
            L.llama_backend_init()
            _ready = True


def route_mtmd(mtmd: Any) -> None:
    """libmtmd (llama_cpp.mtmd_cpp, loaded only for images) logs through its own callback: route it here too."""
    global _mtmd_routed
    with _lock:
        if not _mtmd_routed and not os.environ.get("CLEF_GGUF_LLAMA_LOG"):
            mtmd.mtmd_log_set(_log, ctypes.c_void_p())
        _mtmd_routed = True


def clear_errors() -> None:
    _errors.clear()


def last_error(default: str) -> str:
    """The last few error lines llama.cpp logged, in one line."""
    return "; ".join(_errors[-3:]) or default


@contextmanager
def capture_info(callback: Callable[[str], None]) -> Iterator[None]:
    init_backend()
    _capture.append(callback)
    try:
        yield
    finally:
        _capture.remove(callback)

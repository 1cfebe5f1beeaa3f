"""A view (llama/qwen35_view.py) as a read-only FILE*, by glibc's fopencookie: the cookie route of llama/loader.py.

llama.cpp's FILE* loaders (llama_model_load_from_file_ptr, llama_adapter_lora_init_from_file_ptr) read it through
read/seek callbacks. glibc only: `libc.so.6` is loaded the first time this route is asked for, never at import, so
that macOS, Windows and a forced portable route never touch it (there, and on Windows in any case, llama.cpp's FILE*
loader wants a real file handle: `_get_osfhandle(_fileno(fp))`).
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import cache

from ..errors import ModelFileError
from .qwen35_view import View

_READ = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_WRITE = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_SEEK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int)
_CLOSE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_IOFBF = 0
_BUFFER = 1 << 20  # fewer, larger callbacks while llama.cpp parses the header


class _CookieIO(ctypes.Structure):
    _fields_ = [("read", _READ), ("write", _WRITE), ("seek", _SEEK), ("close", _CLOSE)]


@cache
def _glibc() -> ctypes.CDLL | None:
    """glibc with fopencookie's prototypes, or None where this process has none (macOS, Windows, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    if not hasattr(libc, "fopencookie"):
        return None
    libc.fopencookie.restype = ctypes.c_void_p
    libc.fopencookie.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CookieIO]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.setvbuf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t]
    return libc


def available() -> bool:
    """Whether glibc's fopencookie is there (loads libc.so.6 on Linux to find out)."""
    return _glibc() is not None


class CookieFile:
    """`view` as a FILE* (`fp`) until close(), which closes the FILE* (the view stays the caller's)."""

    def __init__(self, view: View) -> None:
        libc = _glibc()
        if libc is None:
            raise ModelFileError("glibc's fopencookie is not available on this system")
        self._libc, self._view, self._pos = libc, view, 0
        # Keep the callbacks referenced for as long as the FILE* lives.
        self._io = _CookieIO(_READ(self._read), _WRITE(lambda *_: -1), _SEEK(self._seek), _CLOSE(lambda _: 0))
        self.fp = libc.fopencookie(None, b"rb", self._io)
        if not self.fp:
            raise ModelFileError(f"fopencookie failed (errno {ctypes.get_errno()})")
        libc.setvbuf(self.fp, None, _IOFBF, _BUFFER)

    def _read(self, _cookie: int, buf: int, size: int) -> int:
        try:
            done = self._view.readinto(memoryview((ctypes.c_char * size).from_address(buf)).cast("B"), self._pos)
            self._pos += done
            return done
        except Exception:  # an exception must not cross into C: report an I/O error instead
            return -1

    def _seek(self, _cookie: int, offset: ctypes._Pointer, whence: int) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._view.size}.get(whence)
        if base is None or base + offset[0] < 0:
            return -1
        self._pos = base + offset[0]
        offset[0] = self._pos
        return 0

    def close(self) -> None:
        if self.fp:
            self._libc.fclose(self.fp)
            self.fp = None

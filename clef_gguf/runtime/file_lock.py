"""An exclusive lock on an open file, taken without waiting and held until the file is closed (or the process
ends, however it ends): fcntl.flock where Python has fcntl (Linux, macOS), msvcrt.locking on Windows.

Windows' locks are mandatory: a locked byte can be neither read nor written through another handle, and the
answers file is read again through one (dataset_file.answered_lines). So the byte locked there lies far past
any answers file's end (LockFile allows that): the lock keeps a second writer out and nothing else.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

WINDOWS_LOCK_OFFSET = 1 << 40  # 1 TiB: past the end of any answers file


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:  # fcntl on Windows, msvcrt elsewhere
        return None


def flock(fd: int, fcntl: ModuleType) -> bool:
    """fcntl.flock's exclusive lock on `fd`: False when another open file holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a file system without locks (some network ones): nothing to hold
        pass
    return True


def windows_lock(fd: int, locking: Callable[[int, int, int], None], mode: int) -> bool:
    """msvcrt.locking(fd, mode, 1) on the byte at WINDOWS_LOCK_OFFSET (it locks from the file's position, which is
    put back): False when another handle holds it (EACCES)."""
    here = os.lseek(fd, 0, os.SEEK_CUR)
    os.lseek(fd, WINDOWS_LOCK_OFFSET, os.SEEK_SET)
    try:
        locking(fd, mode, 1)
    except PermissionError:
        return False
    except OSError:  # a file system without locks: nothing to hold
        pass
    finally:
        os.lseek(fd, here, os.SEEK_SET)
    return True


def lock_exclusive(fd: int) -> bool:
    """Lock the file open as `fd` for this process alone; False when another process (or open file) holds it.
    With neither fcntl nor msvcrt (no such Python is known) there is nothing to hold: True."""
    fcntl = _module("fcntl")
    if fcntl is not None:
        return flock(fd, fcntl)
    msvcrt = _module("msvcrt")
    if msvcrt is not None:
        return windows_lock(fd, msvcrt.locking, msvcrt.LK_NBLCK)
    return True

"""The one rule for opening what a command or the server reads by path (models, adapters, data files, images).

A path may name a FIFO, a device or a socket: a plain open(2) of a FIFO waits for a writer forever (no Ctrl-C gets
through a blocked open), and reading /dev/zero never ends. So every input is opened with O_NONBLOCK (opening a FIFO
returns at once), checked with fstat on that same descriptor (no race with a rename between a stat and the open),
and refused unless it is a regular file; the descriptor is then switched back to blocking reads.

The refusal is an OSError whose strerror says what the path is, so each caller maps it, as any other OSError it
meets, to its own typed error (a model's CorruptModelError, a data file's SettingsError, ...).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

# What a stat mode names, for a message.
_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (a named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device (a disk)"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a stat mode names, for a message: "a folder", "a FIFO (a named pipe)", ..."""
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """`path` opened for binary reading if it is a regular file (symlinks followed); else OSError naming its kind.

    Never blocks on a FIFO. The returned file's fstat is the file read: compare it (st_ino, st_size, st_mtime_ns) to
    tell whether the file changed since."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):  # (Linux opens a folder read-only): the system's own words for it
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"{file_kind(mode)}, not a regular file", os.fspath(path))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise

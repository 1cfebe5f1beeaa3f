"""The one rule for what a command writes: convert, graft and calibrate (a .gguf file), eval and compare (`-o DIR`,
a folder of reports) and decide (its answers file, runtime/dataset_file.py).

- An output that is not a regular file (a folder, a FIFO, a device, a socket) is never replaced, --force or not:
  `os.replace` would put a regular file in its place (/dev/full, as root /dev/null, for the whole machine). Only
  decide writes into a stream (`-o -`, a pipe or FIFO, a character device such as /dev/null), in order, in place.
- An output that is one of the command's inputs (the same inode: hard links and symlinks included) is refused,
  before any work.
- An output that exists is overwritten only with --force; a report folder's files count one by one.
- The final name is created atomically: without --force by `os.link(tmp, out)`, which fails if OUT appeared
  meanwhile, so that of two runs started together exactly one wins and the other says so.
- The output's folder must exist and be writable before the work starts, not when its result is ready.

Every refusal is an OutputError (exit 9), one line.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import OutputError
from .inputs import file_kind

# link(2) is not supported on every file system (FAT, exFAT, some FUSE and network ones answer these).
NO_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK})


# Every temporary path this process made, until its block removes it: what a command stopped by a signal, and stuck
# past its cleanups, removes before it ends (cli/errors.py's watchdog: remove_temporaries).
_temporaries: set[Path] = set()


def temporary(out: Path, kind: str) -> Path:
    """`.OUT.PID.kind` beside OUT (same file system: renamed or linked into place); the PID tells a dead run's
    leftovers from a running one's (conversion/writer.remove_stale)."""
    path = out.with_name(f".{out.name}.{os.getpid()}.{kind}")
    _temporaries.add(path)
    return path


def hold_temporary(path: Path) -> None:
    """A temporary path made otherwise (a private folder: runtime/private_folder.py), removed as temporary()'s are."""
    _temporaries.add(path)


def drop_temporary(path: Path) -> None:
    """`path` removed by its owner: no longer remove_temporaries'."""
    _temporaries.discard(path)


def remove_temporaries() -> None:
    """Remove every temporary file or folder this process made and has not removed (a process about to end at once)."""
    for path in list(_temporaries):
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        except OSError:
            pass  # (ending anyway: what is left, writer.remove_stale removes on the next run)


def _stat(path: Path) -> os.stat_result | None:
    """What `path` names (symlinks followed); None when nothing is there. A dangling symlink is an lstat."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        try:
            return os.lstat(path)
        except OSError:
            return None
    except NotADirectoryError:
        return None
    except OSError as e:  # a symlink loop, a name too long, a folder that cannot be searched
        raise OutputError(f"cannot use {path} as an output: {e.strerror or e}") from None


def is_stream(path: Path) -> bool:
    """A FIFO or a character device (/dev/null, a terminal, a pipe's /dev/fd/N): what decide may stream into."""
    st = _stat(path)
    return st is not None and (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode))


def refuse_special(path: Path) -> None:
    """Refuse a `path` that exists and is not a regular file (or a symlink to one), --force or not."""
    st = _stat(path)
    if st is None or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
        return
    kind = file_kind(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path} is a folder; give the path of a file to write")
    raise OutputError(f"{path} is {kind}, not a regular file: it is never replaced, --force or not; give a file path")


def same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)  # hard links and symlinks included
    except OSError:
        return False


def refuse_inputs(out: Path, inputs: Iterable[str | os.PathLike[str] | None]) -> None:
    """OUT may never be one of the files the command reads, --force or not."""
    for source in inputs:
        if source is not None and same_file(out, Path(source)):
            also = "" if Path(source) == out else f" ({source})"
            raise OutputError(f"{out} is one of the input files{also}; choose another output path")


def check_in_place(out: Path, inputs: Iterable[str | os.PathLike[str] | None]) -> bool:
    """For an output written in place, in order (decide's answers file): True when OUT is a stream (is_stream), which
    is written into as it is; else refuse a special file or one of `inputs`, and return False."""
    if is_stream(out):
        return True
    refuse_special(out)
    refuse_inputs(out, inputs)
    return False


def check_writable_folder(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{folder} is not a folder; the output cannot be written under it")
    if not folder.is_dir():
        raise OutputError(f"the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write in {folder}: no permission, or a read-only file system")


def check_file(out: Path, *, force: bool, inputs: Iterable[str | os.PathLike[str] | None] = ()) -> None:
    """Before any work: refuse an OUT that is special, one of `inputs`, or exists (without --force), or whose
    folder is missing or not writable."""
    refuse_special(out)
    refuse_inputs(out, inputs)
    if os.path.lexists(out) and not force:
        raise OutputError(f"{out} exists; pass --force to overwrite it")
    check_writable_folder(out.parent)


def check_folder(
    folder: Path, patterns: Iterable[str], *, force: bool, inputs: Iterable[str | os.PathLike[str] | None] = ()
) -> None:
    """Before any work, for a folder of reports whose files are named by `patterns` (fnmatch): FOLDER is a folder
    or will be made (its nearest existing parent writable); each of its files a pattern names is a regular file,
    none of `inputs`, and, without --force, not there at all."""
    inputs = list(inputs)
    st = _stat(folder)
    if st is None:
        parent = folder.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        check_writable_folder(parent)
        return
    if not stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{folder} is {file_kind(st.st_mode)}, not a folder: -o takes the folder to write the reports into")
    patterns = list(patterns)
    try:
        names = sorted(name for name in os.listdir(folder) if any(fnmatch.fnmatchcase(name, p) for p in patterns))
    except OSError as e:
        raise OutputError(f"cannot read the folder {folder}: {e.strerror or e}") from None
    for name in names:
        path = folder / name
        refuse_special(path)
        refuse_inputs(path, inputs)
        if not force:
            raise OutputError(f"{path} exists; pass --force to overwrite the reports in {folder}")
    check_writable_folder(folder)


def publish(tmp: Path, out: Path, force: bool) -> None:
    """Give the finished `tmp` its final name `out` (the same folder): replacing OUT with --force, else only if
    OUT still does not exist."""
    refuse_special(out)  # (made special since the check: still never replaced)
    try:
        if force:
            os.replace(tmp, out)
            return
        try:
            os.link(tmp, out)
        except FileExistsError:
            raise OutputError(f"another run wrote {out} first; this run's result is not kept (--force overwrites)") from None
        except OSError as e:
            if e.errno not in NO_LINKS:
                raise
            # No hard links here: claim the name with an empty file made by O_EXCL (one creator wins, as link's),
            # then rename over it. Readers may see that empty file for the moment between the two.
            try:
                os.close(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                raise OutputError(f"another run wrote {out} first; this run's result is not kept (--force overwrites)") from None
            try:
                os.replace(tmp, out)
            except OSError:
                out.unlink(missing_ok=True)  # the placeholder, empty: not left as if it were the result
                raise
        else:
            tmp.unlink()
    except OSError as e:
        raise OutputError(f"cannot write {out}: {e.strerror or e}") from None


@contextmanager
def atomic_file(out: Path, force: bool, kind: str = "partial") -> Iterator[Path]:
    """A temporary path beside `out` to write; published as `out` only when the block succeeds, removed anyway."""
    tmp = temporary(out, kind)
    try:
        yield tmp
        publish(tmp, out, force)
    finally:
        tmp.unlink(missing_ok=True)
        _temporaries.discard(tmp)

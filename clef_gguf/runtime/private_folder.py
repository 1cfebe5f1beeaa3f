"""Folders only this process writes, in the temporary folder (TMPDIR): where adapters' private copies live.

A process writes into one folder, `clef-adapters-PID-START-BOOT-NS` in tempfile.gettempdir(), mode 0700: PID its
process id, START its start time (the kernel's, in clock ticks since boot: field 22 of /proc/PID/stat), BOOT the first
8 hex digits of the boot's id, NS its PID namespace's inode (containers sharing a temporary folder see other PIDs).
Each PrivateFolder is a folder of its own in it, removed at close, and the process's folder with the last one; the
CLI's watchdog, which ends a stuck command at once, removes it too (outputs.hold_temporary). A process killed outright
(SIGKILL, the OOM killer) removes nothing: the next process that makes a private folder removes the folders of
processes that no longer run. Only folders whose name has that form, of this PID namespace, owned by this user and not
symlinks, and only when no process of that PID runs or the one that does is another (a PID reused: its start time or
the boot differs): a live process's folder is never removed. Where a start time cannot be read (no /proc: macOS,
Windows) nothing is removed, for a PID alone cannot tell a live process from a reused PID.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import stat
import tempfile
import threading
from pathlib import Path

from ..outputs import drop_temporary, hold_temporary

PREFIX = "clef-adapters-"
_OURS = re.compile(rf"{PREFIX}(\d+)-(\d+)-([0-9a-f]{{8}})-(\d+)")
_lock = threading.Lock()  # around making, sweeping and removing process folders
_made: dict[tuple[int, Path], Path] = {}  # (pid, temporary root): this process's folder there (a fork makes its own)
_users: dict[Path, int] = {}  # a process folder: how many PrivateFolders are open in it
_swept: set[tuple[int, Path]] = set()  # (pid, temporary root) swept at this process's first PrivateFolder


def _boot() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:8]
    except OSError:
        return None


def _namespace() -> str | None:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def _started(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (None: no such process, or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # (the command's name may hold spaces and parentheses)
    return fields[19] if len(fields) > 19 and fields[19].isdigit() else None


def _runs(pid: int, started: str, boot: str) -> bool:
    """Whether the process that made a folder named (pid, started, boot) still runs."""
    return boot == _boot() and _started(pid) == started


def sweep(root: Path) -> list[Path]:
    """Remove the folders in `root` left by processes of this user that no longer run; the folders removed."""
    namespace = _namespace()
    if _boot() is None or _started(os.getpid()) is None or namespace is None:
        return []  # (no way to tell a live process from a reused PID)
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    for entry in entries:
        m = _OURS.fullmatch(entry.name)
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if m is None or m[4] != namespace or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if _runs(int(m[1]), m[2], m[3]):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed


def _process_folder(root: Path) -> Path:
    """(Under _lock) This process's folder in `root`, made when first needed."""
    key = (os.getpid(), root)
    folder = _made.get(key)
    if folder is not None and folder.is_dir():
        return folder
    boot, started, namespace = _boot(), _started(os.getpid()), _namespace()
    if boot is None or started is None or namespace is None:
        folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))
    else:
        folder = root / f"{PREFIX}{os.getpid()}-{started}-{boot}-{namespace}"
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:  # (ours, made before in this process; anything else is refused)
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise
    _made[key] = folder
    hold_temporary(folder)
    return folder


def process_folder(root: Path) -> Path:
    """This process's folder in `root`, a folder several processes share (an adapter cache's staging): made when first
    needed, removed at exit; the folders there of processes that no longer run removed first, never a live one's."""
    root.mkdir(parents=True, exist_ok=True)
    with _lock:
        if (os.getpid(), root) not in _swept:
            _swept.add((os.getpid(), root))
            sweep(root)
        return _process_folder(root)


def _release(folder: Path) -> None:
    """(Under _lock) One PrivateFolder fewer in `folder`: the last one removes it."""
    _users[folder] = _users.get(folder, 1) - 1
    if _users[folder] <= 0:
        del _users[folder]
        shutil.rmtree(folder, ignore_errors=True)
        drop_temporary(folder)


@atexit.register
def _remove_all() -> None:
    with _lock:
        for (pid, _), folder in list(_made.items()):
            if pid == os.getpid():
                shutil.rmtree(folder, ignore_errors=True)


class PrivateFolder:
    """A folder only this process writes (mode 0700) in its process folder, made when first needed; removed at close.
    OSError when it cannot be made (the temporary folder full or not writable)."""

    def __init__(self) -> None:
        self._path: Path | None = None
        self._lock = threading.Lock()
        root = Path(tempfile.gettempdir())
        with _lock:  # (a process starting cleans up after the dead: before it copies anything itself)
            if (os.getpid(), root) not in _swept:
                _swept.add((os.getpid(), root))
                sweep(root)

    def new_file(self, name: str) -> Path:
        """A path for a new file called `name` (a folder of its own: messages that name the file name the original)."""
        with self._lock:
            if self._path is None:
                with _lock:
                    parent = _process_folder(Path(tempfile.gettempdir()))
                    self._path = Path(tempfile.mkdtemp(dir=parent))
                    _users[parent] = _users.get(parent, 0) + 1
            return Path(tempfile.mkdtemp(dir=self._path)) / name

    def close(self) -> None:
        with self._lock:
            if self._path is not None:
                shutil.rmtree(self._path, ignore_errors=True)
                with _lock:
                    _release(self._path.parent)
                self._path = None

"""Nothing served that was not loaded: an adapter's versions cannot go stale or be shared,
and its private copies never outlive their use nor fill the temporary disk for nothing.

- A file rewritten in place with the same size and its mtime put back (`rsync --inplace -t`) is a new version: the
  signature holds the ctime, which no utime can set back.
- Two names over equal bytes are two entries: deleting or redeploying one leaves the other answering.
- The temporary disk full (a real small tmpfs as TMPDIR): a 503 `unavailable_error` with Retry-After and the reason,
  on both loader routes (the cookie's copy; the portable route's LoRA file beside it), nothing left on that disk.
- Junk, or an adapter with junk after its tensors, is refused by its header before a byte is copied (a temporary
  disk too small for it says so), and not opened again on the next request (inotify counts the opens).
- The CLI's watchdog, ending a command stuck in C, removes the copies; a SIGKILLed process's are removed by the next
  process, and only those: a live process's folder, another user's and a folder of another name stay.

Adapters: tests/peft_adapters.py over the untied fixture release; references: the base with one adapter file alone.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from file_helpers import mounted_tmpfs
from peft_adapters import peft_adapter
from server_helpers import start

import clef_gguf
from clef_gguf.check.validate import validate
from clef_gguf.errors import RequestError
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama.qwen35_view import open_adapter_view
from clef_gguf.server import create_app
from clef_gguf.settings import LOADER_ENV
from clef_gguf.testing.request_suite import flat_probabilities, labelled_requests

CONTEXT = 2048
CLOSE = 2e-4  # answers are rounded to 4 decimals; float noise may move one by a unit or two
REQUEST = labelled_requests(1)[0]
RACY_S = 2.0  # runtime/catalog.RACY_NS: a file changed this close to its read is read again anyway
PAGE = 4096


class Files:
    """The base's f32 file and three adapter files over it (one and two of the same size), each answering otherwise."""

    def __init__(self, ws, root: Path) -> None:
        release = ws.release("untied_f32")
        self.base = ws.gguf("untied_f32", "f32")
        self.one, self.two, self.three = (peft_adapter(release, root, n, seed=s) for s, n in enumerate(("one", "two", "three")))
        assert self.one.stat().st_size == self.two.stat().st_size


@pytest.fixture(scope="module")
def files(ws, tmp_path_factory) -> Files:
    return Files(ws, tmp_path_factory.mktemp("copies"))


@pytest.fixture(scope="module")
def alone(files) -> dict[str, list[float]]:
    """The answer to REQUEST of each adapter file alone over the base."""
    out = {}
    for key in ("one", "two", "three"):
        with clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapters={"x": getattr(files, key)}, state_cache=0) as m:
            out[key] = flat_probabilities(m.decide({**REQUEST, "model": "x"}))
    assert np.abs(np.subtract(out["one"], out["two"])).max() > 0.01
    return out


def _as(name: str, request: dict = REQUEST) -> dict:
    return {**request, "model": name}


def _far(a: list[float], b: list[float]) -> float:
    return float(np.abs(np.subtract(a, b)).max())


def _answers(model: clef_gguf.ClefModel, name: str) -> list[float]:
    return flat_probabilities(model.decide(_as(name)))


def _settled(path: Path) -> None:
    """Wait (polling) until `path` last changed over RACY_S ago: its signature alone then tells its versions apart."""
    while time.time() - path.stat().st_ctime <= RACY_S:
        time.sleep(0.05)


# --- versions --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_an_in_place_rewrite_with_its_mtime_put_back_is_a_new_version(files, alone, tmp_path):
    """`a` answered (and loaded), then rewritten in place with another version of the same size, its atime and mtime
    put back (the same dev, inode, size and mtime): the next answer is the new version's, loaded or evicted."""
    folder = tmp_path / "tunes"
    folder.mkdir()
    target = folder / "a.adapter.gguf"
    shutil.copyfile(files.one, target)
    shutil.copyfile(files.three, folder / "b.adapter.gguf")
    _settled(target)
    with clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter_dir=folder, max_adapters=1, state_cache=0) as model:
        assert _far(_answers(model, "a"), alone["one"]) <= CLOSE
        for version, evict in (("two", False), ("one", True)):
            before = target.stat()
            with target.open("r+b") as f:  # (`rsync --inplace -t`: the same inode rewritten, its times put back)
                f.write(getattr(files, version).read_bytes())
            os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
            after = target.stat()
            assert (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns) == (
                before.st_dev,
                before.st_ino,
                before.st_size,
                before.st_mtime_ns,
            )
            if evict:
                model.decide(_as("b"))
                assert model.decider.loaded == ["b"]
            assert _far(_answers(model, "a"), alone[version]) <= CLOSE, (version, evict)


def test_two_names_over_equal_bytes_are_independent(files, alone, tmp_path):
    """`a` and `b` hold the same bytes (one identity, loaded once): deleting `b`, or redeploying `a` with another
    version, leaves the other answering as its own file, after evictions (its file read again) too."""
    folder = tmp_path / "tunes"
    folder.mkdir()
    for name, source in (("a", files.one), ("b", files.one), ("c", files.three)):
        shutil.copyfile(source, folder / f"{name}.adapter.gguf")
    with clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter_dir=folder, max_adapters=1, state_cache=0) as model:
        assert model.encode(_as("a")).identity == model.encode(_as("b")).identity
        assert _far(_answers(model, "a"), alone["one"]) <= CLOSE
        assert _far(_answers(model, "b"), alone["one"]) <= CLOSE
        (folder / "b.adapter.gguf").unlink()
        model.decide(_as("c"))  # (evicts them)
        assert _far(_answers(model, "a"), alone["one"]) <= CLOSE
        shutil.copyfile(files.one, folder / "b.adapter.gguf")
        shutil.copyfile(files.two, folder / "a.tmp")
        os.replace(folder / "a.tmp", folder / "a.adapter.gguf")  # a redeployed
        model.decide(_as("c"))
        assert _far(_answers(model, "b"), alone["one"]) <= CLOSE
        assert _far(_answers(model, "a"), alone["two"]) <= CLOSE
        model.decide(_as("c"))
        assert _far(_answers(model, "b"), alone["one"]) <= CLOSE


# --- the temporary disk --------------------------------------------------------------------------------------------
def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _files_in(root: Path) -> list[Path]:
    return [Path(d, f) for d, _, names in os.walk(root) for f in names]


@contextmanager
def temporary_disk(tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real tmpfs of `size` bytes as this process's temporary folder (tempfile's, where the copies go)."""
    with mounted_tmpfs(tmp_path / "tmp", f"size={size}") as small:
        monkeypatch.setattr(tempfile, "tempdir", str(small))
        try:
            yield small
        finally:
            monkeypatch.undo()


@pytest.mark.parametrize("route", ["cookie", "portable"])
def test_a_full_temporary_disk_is_a_503_with_its_reason_and_leaves_nothing(files, tmp_path, monkeypatch, route):
    """cookie: no room for the copy; portable: room for the copy, not for the LoRA file llama.cpp reads beside it.
    Either way a 503 unavailable_error with Retry-After saying why (it was a 422 and a 500), no file left on that
    disk, and the base and the server go on."""
    folder = tmp_path / "tunes"
    folder.mkdir()
    shutil.copyfile(files.one, folder / "a.adapter.gguf")
    size = files.one.stat().st_size
    f = GGUFFile.open(files.one)
    try:
        with open_adapter_view(f) as view:
            lora = view.size  # (the portable route's file for llama.cpp)
    finally:
        f.close()
    room = _pages(size) - PAGE if route == "cookie" else _pages(size) + _pages(lora) - 2 * PAGE
    monkeypatch.setenv(LOADER_ENV, route)
    with temporary_disk(tmp_path, room, monkeypatch) as small:
        model = clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter_dir=folder, state_cache=0)
        live = start(create_app(model, owns_model=False))
        try:
            with httpx.Client(base_url=live.url, timeout=120) as client:
                for _ in range(2):
                    full = client.post("/v1/systemone", json=_as("a"))
                    assert full.status_code == 503, full.text
                    assert full.headers.get("retry-after") == "10", full.headers
                    detail = full.json()["detail"]
                    assert detail["error_type"] == "unavailable_error", detail
                    assert "No space left on device" in detail["message"] and "a.adapter.gguf" in detail["message"], detail
                    assert str(small) not in full.text, full.text
                    assert _files_in(small) == [], _files_in(small)
                assert client.post("/v1/systemone", json=REQUEST).status_code == 200
        finally:
            live.stop()
            model.close()
        assert list(small.iterdir()) == []


class Opens:
    """The opens of one file by anyone (Linux's inotify, IN_OPEN), counted as they are read."""

    IN_OPEN = 0x20

    def __init__(self, path: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self._fd >= 0 and self._libc.inotify_add_watch(self._fd, os.fsencode(path), self.IN_OPEN) >= 0

    def count(self) -> int:
        n = 0
        while True:
            try:
                data = os.read(self._fd, 4096)
            except BlockingIOError:
                return n
            at = 0
            while at < len(data):  # struct inotify_event: wd, mask, cookie, len, then len bytes of name
                n += 1
                at += 16 + struct.unpack_from("iIII", data, at)[3]

    def close(self) -> None:
        os.close(self._fd)


def test_junk_is_refused_by_its_header_before_any_copy_and_not_read_again(files, tmp_path, monkeypatch):
    """A temporary disk with room for two adapters but not for 4 MiB: 4 MiB of junk, and an adapter followed by 4 MiB
    of junk, are refused for what their headers say (a copy would have found the disk full first), the good adapter
    answers, and a second request for either opens neither file (the verdict is remembered until the file changes)."""
    folder = tmp_path / "tunes"
    folder.mkdir()
    shutil.copyfile(files.one, folder / "a.adapter.gguf")
    junk, long = folder / "junk.adapter.gguf", folder / "long.adapter.gguf"
    junk.write_bytes(np.random.default_rng(0).bytes(4 << 20))
    long.write_bytes(files.one.read_bytes() + bytes(4 << 20))
    says = {"junk": "not a GGUF file", "long": f"{4 << 20} bytes follow its tensor data"}
    room = 2 * _pages(files.one.stat().st_size) + 4 * PAGE  # (a loaded adapter's copy, and one being validated)
    with (
        temporary_disk(tmp_path, room, monkeypatch) as small,
        clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter_dir=folder, state_cache=0) as model,
    ):
        watched = {name: Opens(folder / f"{name}.adapter.gguf") for name in says}
        try:
            for name, why in says.items():
                for attempt in range(2):
                    with pytest.raises(RequestError, match=why) as refused:
                        model.encode(_as(name))
                    assert refused.value.field == "model" and f"{name}.adapter.gguf" in str(refused.value)
                    assert watched[name].count() == (1 if attempt == 0 else 0), (name, attempt)
                    assert _files_in(small) == []
            model.decide(_as("a"))
            assert model.adapter_names() == ["a"]
            assert watched["junk"].count() == watched["long"].count() == 0
        finally:
            for w in watched.values():
                w.close()
    assert says["long"] in validate(long).summary  # (validate says it too)


# --- copies left by a process that ended at once ---------------------------------------------------------------
_CHILD = """
import ctypes, json, sys, clef_gguf
from clef_gguf.cli.errors import end_on_signals, signals_clean_up
base, adapter, request = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
end_on_signals()
with signals_clean_up():
    model = clef_gguf.load(base, max_prompt_tokens={context}, adapters={{"a": adapter}}, state_cache=0)
    model.decide({{**request, "model": "a"}})
    print("ready", flush=True)
    ctypes.CDLL(None).system(b"exec sleep 60 >/dev/null 2>&1")  # (stuck in C: glibc's system() waits through signals)
"""


def _child(files: Files, tmp: Path) -> subprocess.Popen[str]:
    code = textwrap.dedent(_CHILD.format(context=CONTEXT))
    env = {**os.environ, "TMPDIR": str(tmp)}
    argv = [sys.executable, "-c", code, str(files.base), str(files.one), json.dumps(REQUEST)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None and process.stdout.readline() == "ready\n", process.stderr and process.stderr.read()
    return process


def _grandchildren(pid: int) -> list[int]:
    """The processes `pid` started (the child's `sleep`, polled for: system() forks it after "ready")."""
    deadline = time.monotonic() + 60
    while not (found := Path(f"/proc/{pid}/task/{pid}/children").read_text().split()):
        assert time.monotonic() < deadline, "no sleep started"
        time.sleep(0.01)
    return [int(p) for p in found]


def _ours(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("clef-adapters-"))


@pytest.mark.slow
def test_the_watchdog_removes_the_copies_of_a_command_it_ends(files, tmp_path):
    """A command holding a loaded adapter, stuck in C when SIGTERM comes: the watchdog ends it (exit 143) and its
    private copies go with it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    process = _child(files, tmp)
    sleeper = _grandchildren(process.pid)
    try:
        assert len(_ours(tmp)) == 1 and _files_in(tmp), _ours(tmp)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in sleeper:
            os.kill(pid, signal.SIGKILL)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert _ours(tmp) == [] and _files_in(tmp) == [], (_ours(tmp), _files_in(tmp))


def _stamp(pid: int) -> str:
    """What a folder of process `pid` is named for: its pid, start time (clock ticks since boot), boot and PID
    namespace."""
    stat_line = Path(f"/proc/{pid}/stat").read_text()
    started = stat_line[stat_line.rfind(")") + 2 :].split()[19]
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:8]
    return f"{pid}-{started}-{boot}-{os.stat(f'/proc/{pid}/ns/pid').st_ino}"


@pytest.mark.slow
def test_a_killed_process_s_copies_are_removed_by_the_next_and_only_those(files, tmp_path, monkeypatch):
    """SIGKILL leaves a process's folder; the next process removes it, and a folder whose PID runs as another
    process (a reused PID), but not a live process's folder, another user's, another PID namespace's (a container
    sharing the temporary folder), or another name's."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    process = _child(files, tmp)
    for pid in _grandchildren(process.pid):
        os.kill(pid, signal.SIGKILL)
    process.kill()
    process.wait()
    [dead] = _ours(tmp)
    assert dead.startswith(f"clef-adapters-{process.pid}-") and _files_in(tmp / dead)
    live = subprocess.Popen(["sleep", "60"])
    try:
        pid, started, boot, ns = _stamp(live.pid).split("-")
        kept: dict[str, int | None] = {
            f"clef-adapters-{pid}-{started}-{boot}-{ns}": None,  # a live process's
            f"clef-adapters-{process.pid}-1-{boot}x-{ns}": None,  # not of that form
            f"clef-adapters-{process.pid}-{started}-{boot}-{ns}-other": None,
            f"clef-adapters-{process.pid}-7-{boot}-{int(ns) + 1}": None,  # another PID namespace's
        }
        if os.geteuid() == 0:  # (only root can give a folder to another user)
            kept[f"clef-adapters-{process.pid}-7-{boot}-{ns}"] = 65534
        reused = f"clef-adapters-{pid}-{int(started) + 1}-{boot}-{ns}"  # its PID runs, started at another time
        for name, owner in {**kept, reused: None}.items():
            (tmp / name).mkdir(mode=0o700)
            (tmp / name / "copy").write_bytes(b"x")
            if owner is not None:
                os.chown(tmp / name, owner, owner)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        with clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapters={"a": files.one}, state_cache=0) as model:
            model.decide(_as("a"))
            mine = [n for n in _ours(tmp) if n.startswith(f"clef-adapters-{_stamp(os.getpid())}")]
            assert sorted(set(_ours(tmp)) - set(mine)) == sorted(kept), _ours(tmp)
        assert sorted(_ours(tmp)) == sorted(kept)  # (and this process's own removed at close)
    finally:
        live.kill()
        live.wait()

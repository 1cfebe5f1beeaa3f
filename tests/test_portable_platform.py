"""Where glibc, fcntl and /proc are not (macOS, Windows): a decision and the dataset mode without them,
and the portable code paths one by one (the default threads, the answers file's lock, malloc_trim, signals, paths).

The first test blocks, in a fresh interpreter and before `import clef_gguf`: loading libc.so.6 (ctypes.CDLL and
ctypes.util.find_library refuse it, and CDLL(None), which is glibc's namespace here), importing fcntl (a sys.meta_path
finder) and /proc (open, os.open, io.open, os.stat, os.listdir, os.scandir, pathlib on a /proc path raise
FileNotFoundError, as where there is none). Then it decides the demo model's request with the portable model loader
(CLEF_GGUF_LOADER=portable) and runs `decide` on JSON Lines twice (the second --resume), which takes the answers
file's lock; the answers must be those of the ordinary route, unblocked, to the last digit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clef_gguf import data
from clef_gguf.errors import ReleaseError
from clef_gguf.llama import backends, threads
from clef_gguf.runtime import file_lock

DEMO = Path(data.__file__).parent

BLOCKERS = textwrap.dedent(
    r"""
    import atexit, builtins, ctypes, ctypes.util, io, json, os, sys, traceback

    refused = []  # what was asked of the blocked pieces, and by whom (the innermost frames): said on stderr at exit
    atexit.register(lambda: print("refused: " + json.dumps(refused), file=sys.stderr))

    def _refuse(what):
        frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.startswith("<")]
        refused.append(what + " by " + " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames[:-4:-1]))

    class _NoFcntl:
        def find_spec(self, name, path=None, target=None):
            if name == "fcntl":
                _refuse("import fcntl")
                raise ModuleNotFoundError("No module named 'fcntl' (blocked: not on this platform)", name=name)
            return None

    sys.modules.pop("fcntl", None)
    sys.meta_path.insert(0, _NoFcntl())

    _LIBC = {"c", "libc", "libc.so", "libc.so.6"}
    _cdll_init = ctypes.CDLL.__init__

    def _cdll(self, name, *args, **kwargs):
        if name is None or os.path.basename(os.fsdecode(name)) in _LIBC:
            _refuse(f"ctypes.CDLL({name!r})")
            raise OSError(f"{name}: cannot open shared object file (blocked: no glibc)")
        _cdll_init(self, name, *args, **kwargs)

    ctypes.CDLL.__init__ = _cdll
    _find_library = ctypes.util.find_library

    def _find(name):
        if name in _LIBC:
            _refuse(f"find_library({name!r})")
            return None
        return _find_library(name)

    ctypes.util.find_library = _find

    def _proc(path):
        if isinstance(path, int):
            return False
        try:
            text = os.path.abspath(os.fsdecode(path))
        except TypeError:
            return False
        return text == "/proc" or text.startswith("/proc/")

    def _guard(function):
        def guarded(path, *args, **kwargs):
            if _proc(path):
                _refuse(f"{function.__name__}({os.fsdecode(path)})")
                raise FileNotFoundError(2, "No such file or directory (blocked: no /proc)", os.fsdecode(path))
            return function(path, *args, **kwargs)
        return guarded

    builtins.open = io.open = _guard(io.open)
    for _name in ("open", "stat", "lstat", "listdir", "scandir"):
        setattr(os, _name, _guard(getattr(os, _name)))
    """
)

DECIDE = textwrap.dedent(
    r"""
    import json, sys
    from pathlib import Path
    import clef_gguf
    from clef_gguf.cli import main

    demo, work = Path(sys.argv[1]), Path(sys.argv[2])
    request = json.loads((demo / "demo_request.json").read_text())
    with clef_gguf.load(demo / "demo.gguf") as model:
        answer = model.decide(request)
    second = dict(request, state={"ticket": "Where is my parcel? It was due on Monday.", "customer_tier": "silver"})
    requests = work / "requests.jsonl"
    answers = work / "answers.jsonl"
    for lines in ([request, second], [request, second, request]):  # the second run continues the first's file
        requests.write_text("".join(json.dumps(r) + "\n" for r in lines))
        sys.argv = ["clef-gguf", "decide", str(demo / "demo.gguf"), str(requests), "-o", str(answers), "--resume"]
        try:
            main()
        except SystemExit as e:
            assert e.code in (0, None), f"decide exited {e.code}"
    print(json.dumps({"decide": answer, "answers": answers.read_text().splitlines()}))
    """
)


def _run(code: str, work: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    work.mkdir()
    return subprocess.run(
        [sys.executable, "-c", code, str(DEMO), str(work)], capture_output=True, text=True, timeout=600, env=env, cwd=work
    )


def _answer(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_decision_and_the_dataset_mode_run_without_libc_fcntl_and_proc(tmp_path):
    plain = {k: v for k, v in os.environ.items() if k != "CLEF_GGUF_LOADER"}
    expected = _answer(_run(DECIDE, tmp_path / "plain", plain))
    blocked = _run(BLOCKERS + DECIDE, tmp_path / "blocked", plain | {"CLEF_GGUF_LOADER": "portable"})
    refused = next((line for line in blocked.stderr.splitlines() if line.startswith("refused: ")), "")
    got = _answer(blocked)
    assert got == expected, refused
    assert len(got["answers"]) == 3 and all('"error"' not in line for line in got["answers"])


# --- the pieces, one by one ---------------------------------------------------------------------------------------


def test_without_an_affinity_mask_the_threads_are_the_cpus_python_counts(monkeypatch):
    # macOS and Windows: no os.sched_getaffinity; Python 3.13's os.process_cpu_count where there is one.
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "process_cpu_count", lambda: 3, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(threads, "_measured", None)
    assert threads.physical_threads() == 3
    assert threads.default_threads() == 3
    monkeypatch.delattr(os, "process_cpu_count")  # Python 3.12 and older
    monkeypatch.setattr(threads, "_measured", None)
    assert threads.default_threads() == 8


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="an affinity mask is Linux's")
def test_where_proc_cannot_be_read_the_threads_are_the_cores_of_the_mask(monkeypatch):
    read_text = Path.read_text

    def no_proc(self: Path, *args, **kwargs):
        if str(self).startswith("/proc/"):
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return read_text(self, *args, **kwargs)

    allowed = os.sched_getaffinity(0)
    cores = {threads._core(cpu) for cpu in allowed}
    monkeypatch.setattr(Path, "read_text", no_proc)
    monkeypatch.setattr(threads, "_measured", None)
    assert threads.cgroup_quota() is None and threads.busy_cpus(allowed, 0.01) == 0.0
    assert threads.default_threads() == (len(allowed) if None in cores else len(cores))


def test_the_answers_file_lock_keeps_a_second_writer_out(tmp_path):
    path = tmp_path / "answers.jsonl"
    with open(path, "ab") as first, open(path, "ab") as second:
        assert file_lock.lock_exclusive(first.fileno())
        assert not file_lock.lock_exclusive(second.fileno())  # (flock: per open file, even in one process)
    with open(path, "ab") as again:  # closed: free again
        assert file_lock.lock_exclusive(again.fileno())


def _emulated_locking(fd: int, mode: int, size: int) -> None:
    """msvcrt.locking's contract on POSIX record locks: `size` bytes from the file's position, EACCES when held."""
    import fcntl

    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, size, 0, os.SEEK_CUR)
    except OSError as e:
        raise PermissionError(13, "Permission denied") from e


@pytest.mark.skipif(sys.platform == "win32", reason="emulates Windows' lock with POSIX record locks")
def test_the_windows_lock_holds_one_byte_past_the_end_and_leaves_the_position(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_bytes(b'{"line":1}\n')
    child = textwrap.dedent(
        f"""
        import fcntl, os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_portable_platform import _emulated_locking
        from clef_gguf.runtime.file_lock import windows_lock
        fd = os.open({str(path)!r}, os.O_RDWR)
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)  # the answers themselves: not locked
        print(windows_lock(fd, _emulated_locking, 0))
        """
    )
    with open(path, "ab") as file:
        position = os.lseek(file.fileno(), 0, os.SEEK_CUR)
        assert file_lock.windows_lock(file.fileno(), _emulated_locking, 0)
        assert os.lseek(file.fileno(), 0, os.SEEK_CUR) == position
        held = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
        assert held.returncode == 0, held.stderr
        assert held.stdout.strip() == "False"  # another process: refused
    free = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert free.stdout.strip() == "True"  # closed: released


def _no_confstr(name: str) -> str:
    raise ValueError(f"unrecognized configuration name {name}")  # (musl, macOS; Windows has no os.confstr)


@pytest.mark.slow
def test_the_server_loads_no_libc_at_import_and_trims_only_on_glibc(monkeypatch):
    code = BLOCKERS + (
        "import clef_gguf.server.app, clef_gguf.server.intake as intake\n"
        "print(json.dumps([r for r in refused if 'intake.py' in r]))\n"
        "print(intake._malloc_trim()())"  # glibc by os.confstr, but CDLL(None) refused: a no-op, not an error
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-2:] == ["[]", "None"]

    from clef_gguf.server import intake

    intake._malloc_trim.cache_clear()
    monkeypatch.setattr(os, "confstr", _no_confstr, raising=False)
    assert intake._malloc_trim()() is None  # not glibc: nothing asked of any libc
    intake._malloc_trim.cache_clear()
    monkeypatch.undo()
    if (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
        assert intake._malloc_trim()() in (0, 1)  # glibc's malloc_trim: 1 if memory was released
    intake._malloc_trim.cache_clear()


def test_the_commands_signals_where_there_is_no_sighup():
    # Windows' signal module has no SIGHUP (and has SIGBREAK): the command's module must import and stop on the rest.
    code = (
        "import signal; del signal.SIGHUP; signal.SIGBREAK = 21\n"
        "from clef_gguf.cli import errors\n"
        "print(sorted(int(s) for s in errors.STOPPING))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout) == sorted([signal.SIGINT, signal.SIGTERM, 21])


@pytest.mark.slow
def test_the_watchdog_ends_a_command_stuck_after_sigterm():
    # The watchdog's wake-up is a socket pair (Windows' set_wakeup_fd takes a socket): a command stuck in a sleep
    # that ignores the exception still ends, 128 + SIGTERM, within STOP_S.
    code = textwrap.dedent(
        """
        import os, signal, sys, threading, time
        from clef_gguf.cli import errors
        errors.end_on_signals()
        with errors.signals_clean_up():
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
            while True:
                try:
                    time.sleep(30)
                except KeyboardInterrupt:
                    pass  # stuck: only the watchdog can end it
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert "stopped by SIGTERM" in result.stderr


@pytest.mark.parametrize("source", ["C:/clef-flash", "D:clef/flash"])
def test_a_release_path_with_a_drive_is_a_missing_folder_not_a_hub_id(source):
    from clef_gguf.conversion.release import resolve

    with pytest.raises(ReleaseError, match="no such folder"):
        resolve(source)


def test_the_device_backends_are_read_from_each_platforms_file_names(tmp_path, monkeypatch):
    for name in ("ggml-cuda.dll", "libggml-metal.dylib", "libggml-vulkan.so.0", "libggml-cpu.so"):
        (tmp_path / name).touch()
    monkeypatch.setattr(backends, "library_folder", lambda: tmp_path)
    assert backends.built_backends() == ["CUDA", "Vulkan", "Metal"]

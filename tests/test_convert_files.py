"""convert's files: real kills of a real `clef-gguf convert` at several points, stale leftovers
removed by the next run, OUT never an input, one-line errors for unwritable outputs.

Each kill waits for its point (bounded: KILL_WAIT_S), sends the signal, and checks what is left
beside OUT. SIGINT, SIGTERM and SIGHUP must leave nothing; SIGKILL cannot be caught, so it leaves
its `.OUT.PID.partial` / `.OUT.PID.stage`, and the next run must remove them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import typer
from cli_helpers import run_cli as cli  # the CLI in this process; the kills are of real processes
from file_helpers import mounted_tmpfs, read_only_folder

from clef_gguf.cli import errors as cli_errors
from clef_gguf.conversion.convert import backbone_tensors, default_mmproj_path
from clef_gguf.conversion.graft import graft, head_tensors
from clef_gguf.conversion.release import open_release
from clef_gguf.conversion.vocab import read_vocab
from clef_gguf.conversion.writer import GT, header_bytes, remove_stale
from clef_gguf.errors import OutputError
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama import log as llama_log
from clef_gguf.llama.qwen35_view import write_backbone_gguf
from clef_gguf.testing.release_builder import ReleaseSpec, build_release

# Big enough (~300 MB of f32 weights) that each stage of a conversion lasts a while on a loaded machine: 8 layers
# 1024 wide, attention heads 128 wide, linear-attention heads 64 wide (the tiny fixture's are 16).
LINEAR_HEADS_64 = {"linear_key_head_dim": 64, "linear_value_head_dim": 64}
SLOW = ReleaseSpec(
    seed=3, layers=8, hidden=1024, intermediate=2048, heads=8, kv_heads=2, head_dim=128, head_width=64, **LINEAR_HEADS_64
)
KILL_WAIT_S = 120.0
POLL_S = 0.002


@pytest.fixture(scope="module")
def slow_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_release(tmp_path_factory.mktemp("slow") / "release", SLOW)


def beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


# --- Points to kill at: a predicate on the output folder ------------------------------------------
def _leftover(out: Path, kind: str) -> Path | None:
    return next(iter(out.parent.glob(f".{out.name}.*.{kind}")), None)


def staging(out: Path) -> bool:
    """The bf16 backbone is being written into the stage folder."""
    stage = _leftover(out, "stage")
    return stage is not None and (stage / "backbone-bf16.gguf").exists()


def quantizing(out: Path) -> bool:
    """llama.cpp's quantizer is writing its output (C code: the signal waits for it to return)."""
    stage = _leftover(out, "stage")
    return stage is not None and any(stage.glob("backbone-q4_0.gguf"))


def writing(min_bytes: int) -> Callable[[Path], bool]:
    """The Clef file is being written under its temporary name, `min_bytes` of it done."""

    def point(out: Path) -> bool:
        partial = _leftover(out, "partial")
        try:
            return partial is not None and partial.stat().st_size > min_bytes
        except FileNotFoundError:
            return False

    return point


POINTS: dict[str, tuple[str, Callable[[Path], bool]]] = {
    "staging": ("q4_0", staging),
    "quantizing": ("q4_0", quantizing),
    "writing-f32": ("f32", writing(100 << 20)),  # of ~300 MB
    "writing-q4_0": ("q4_0", writing(10 << 20)),  # of ~45 MB
}


def kill_at(release: Path, out: Path, file_type: str, point: Callable[[Path], bool], signum: int) -> tuple[subprocess.Popen, str]:
    """Run convert, send `signum` once `point` holds; the process and its stderr."""
    log = out.parent.parent / "stderr.txt"  # a file, not a pipe: a full pipe would stall convert before the point
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "clef_gguf.cli", "convert", str(release), "-o", str(out), "--type", file_type],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + KILL_WAIT_S
        while not point(out):
            assert process.poll() is None, f"convert ended before the kill point: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the kill point never came"
            time.sleep(POLL_S)
        process.send_signal(signum)
        process.wait(timeout=KILL_WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process, log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
@pytest.mark.parametrize("point", list(POINTS))
def test_a_caught_signal_removes_everything_it_wrote(slow_release, tmp_path, point, signum):
    out = tmp_path / "out" / "model.gguf"
    out.parent.mkdir()
    file_type, predicate = POINTS[point]
    process, stderr = kill_at(slow_release, out, file_type, predicate, signum)
    assert process.returncode == 128 + signum, stderr[-2000:]
    assert f"stopped by {signum.name}" in stderr or "interrupted" in stderr, stderr[-2000:]
    assert "Traceback" not in stderr
    assert beside(out) == []


def test_a_signal_that_c_code_swallowed_still_stops_with_its_code(capsys):
    """numpy's tofile, interrupted, cleared the handler's exception and raised a TypeError instead (pathlib a
    SystemError). Nested as the commands nest them: run outside, the handlers inside the action."""

    def swallowed() -> None:
        with cli_errors.signals_clean_up():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises here
            except KeyboardInterrupt:
                raise TypeError("expected str, bytes or os.PathLike object, not BufferedWriter") from None

    with pytest.raises(typer.Exit) as stop:
        cli_errors.run(swallowed)
    assert stop.value.exit_code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in capsys.readouterr().err


def test_inside_callback_tells_llamas_log_callback_from_elsewhere():
    """The signal handler defers its exception inside the callback (ctypes would drop it): called through the
    C function pointer llama.cpp calls, as the quantizer's log lines are."""
    seen: list[bool] = []
    with llama_log.capture_info(lambda line: seen.append(llama_log.inside_callback())):
        llama_log._log(2, b"a line\n", None)
    assert seen == [True] and not llama_log.inside_callback()


@pytest.mark.slow
@pytest.mark.parametrize("point", list(POINTS))
def test_after_sigkill_the_next_run_removes_the_leftovers(slow_release, tmp_path, point):
    out = tmp_path / "out" / "model.gguf"
    out.parent.mkdir()
    file_type, predicate = POINTS[point]
    process, _ = kill_at(slow_release, out, file_type, predicate, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    left = beside(out)
    mmproj = default_mmproj_path(out)
    # what the test is about: the model's leftovers, and those of its mmproj (written first, renamed last)
    assert f".{mmproj.name}.{process.pid}.partial" in left, left
    assert left and all(f".{out.name}.{process.pid}." in name or f".{mmproj.name}.{process.pid}." in name for name in left), left
    rerun = cli("convert", str(slow_release), "-o", str(out), "--type", "f32")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert beside(out) == sorted([mmproj.name, out.name])


def test_leftovers_of_a_live_process_and_other_files_stay(tmp_path):
    out = tmp_path / "model.gguf"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        dead_pid = int(dead.stdout)
        live = tmp_path / f".{out.name}.{sleeper.pid}.partial"
        stale = tmp_path / f".{out.name}.{dead_pid}.partial"
        stale_stage = tmp_path / f".{out.name}.{dead_pid}.stage"
        other = tmp_path / f".other.gguf.{dead_pid}.partial"  # another OUT's: not this run's business
        for path in (live, stale, other):
            path.write_bytes(b"x")
        stale_stage.mkdir()
        (stale_stage / "backbone-bf16.gguf").write_bytes(b"x")
        assert sorted(remove_stale(out)) == sorted([stale, stale_stage])
        assert live.exists() and other.exists() and not stale.exists() and not stale_stage.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


# --- OUT is never an input -------------------------------------------------------------------------------
def test_out_can_never_be_an_input_file(ws, tmp_path):
    release = shutil.copytree(ws.release("untied_f32"), tmp_path / "release")
    weights = release / "model.safetensors"
    before = weights.read_bytes()
    for target in (weights, release / "config.json", release / "tokenizer.json"):
        run = cli("convert", str(release), "-o", str(target), "--type", "f32", "--force")
        assert run.returncode == 9 and "is one of the input files" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
    link = tmp_path / "link.safetensors"
    link.symlink_to(weights)  # the same file under another name
    run = cli("convert", str(release), "-o", str(link), "--type", "f32", "--force")
    assert run.returncode == 9 and "is one of the input files" in run.stderr, run.stderr
    assert weights.read_bytes() == before

    backbone = tmp_path / "backbone.gguf"
    shutil.copy(ws.gguf("untied_f32", "f32"), tmp_path / "clef.gguf")
    f = GGUFFile.open(tmp_path / "clef.gguf")
    try:
        write_backbone_gguf(f, backbone)
    finally:
        f.close()
    with pytest.raises(OutputError, match="is one of the input files"):
        graft(backbone, release, backbone, force=True)
    with pytest.raises(OutputError, match="is one of the input files"):
        graft(backbone, release, release / "joint_head.safetensors", force=True)


# --- Outputs that cannot be written: one line each (a read-only folder, a small tmpfs: test_outputs.py's) ----
def test_unwritable_outputs_are_one_line_errors(ws, tmp_path):
    release = str(ws.release("untied_f32"))
    folder = tmp_path / "a-folder"
    folder.mkdir()
    cases = {
        "missing parent": (tmp_path / "nowhere" / "out.gguf", "does not exist"),
        "a folder with --force": (folder, "is a folder"),
        "markup in a missing path": (tmp_path / "[/b]" / "[bold]out.gguf", "does not exist"),
    }
    for name, (out, message) in cases.items():
        run = cli("convert", release, "-o", str(out), "--type", "f32", "--force")
        assert run.returncode == 9, (name, run.stderr)  # the output rule (clef_gguf/outputs.py): OutputError
        assert message in run.stderr and "Traceback" not in run.stderr, (name, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1, (name, run.stderr)
    assert "[/b]" in cli("convert", release, "-o", str(cases["markup in a missing path"][0]), "--type", "f32").stderr
    with read_only_folder(tmp_path / "read-only") as ro:
        run = cli("convert", release, "-o", str(ro / "out.gguf"), "--type", "f32")
        assert run.returncode == 9 and "cannot write in" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_path_with_markup_is_printed_as_it_is(ws, tmp_path):
    folder = tmp_path / "[/b]"  # the folders "[" and "b]": Rich would read "[/b]" as a closing tag
    folder.mkdir(parents=True)
    run = cli("convert", str(ws.release("untied_f32")), "-o", str(folder / "[red]x.gguf"), "--type", "f32")
    assert run.returncode == 0, run.stderr
    assert f"wrote {folder / '[red]x.gguf'}" in run.stderr


def test_free_space_counts_the_header(ws, tmp_path):
    """A disk with room for the tensors but not for the header too is refused up front, leaving nothing."""
    clef = ws.gguf("untied_f32", "f32")
    f = GGUFFile.open(clef)
    header, size = f.header.data_offset, clef.stat().st_size
    f.close()
    release = ws.release("untied_f32")
    r = open_release(release)
    vocab = read_vocab(r.tokenizer, r.tokenizer_config, r.backbone_shape().n_vocab, r.text_config.get("eos_token_id"))
    tensors = backbone_tensors(r, GT.F32) + head_tensors(r, GT.F32)
    assert header <= header_bytes(vocab, tensors) < header + (1 << 20)  # the estimate bounds the real header, closely
    room = (size - header) + header // 2  # the data fits, the header does not
    with mounted_tmpfs(tmp_path / "small", f"size={-(-room // 4096) * 4096}") as small:
        assert shutil.disk_usage(small).free < size
        run = cli("convert", str(release), "-o", str(small / "out.gguf"), "--type", "f32")
        assert run.returncode == 4 and "free; this conversion needs" in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert list(small.iterdir()) == []

"""One output rule for every command that writes (clef_gguf/outputs.py): a special file is never
replaced, an input is never the output, nothing is overwritten without --force (reports included), of two runs
exactly one creates OUT, and every such refusal comes before any work, one line, exit 9."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import run_cli as cli  # the CLI in this process
from file_helpers import read_only_folder

from clef_gguf.data import DEMO_CONTEXT, DEMO_MODEL
from clef_gguf.errors import OutputError
from clef_gguf.outputs import publish

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "labelled.jsonl"
CTX = ["--ctx", str(DEMO_CONTEXT)]
OUTPUT_ERROR = 9
QUICK = 60  # s: a refusal comes before any work; a run that waits on its FIFO input never ends (cli_helpers' timeout)


def refused(run: subprocess.CompletedProcess[str], says: str, code: int = OUTPUT_ERROR) -> None:
    assert run.returncode == code, (run.returncode, run.stderr[-2000:])
    assert says in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr[-2000:]


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def unopened_input(tmp_path: Path) -> Path:
    """Labelled data as a FIFO nobody writes: a command that starts its work waits on it forever (the timeout)."""
    return fifo(tmp_path / "data-fifo.jsonl")


def char_device_link(tmp_path: Path, device: str = "/dev/full") -> Path:
    """A symlink in tmp_path to a character device: the device itself is only ever stat'ed."""
    link = tmp_path / f"{Path(device).name}-link.gguf"
    link.symlink_to(device)
    return link


def assert_device_intact(link: Path, device: str = "/dev/full") -> None:
    assert link.is_symlink() and os.readlink(link) == device
    assert stat.S_ISCHR(os.stat(device).st_mode)


# --- A special file is never replaced, --force or not ---------------------------------------------------
def test_convert_never_replaces_a_fifo_or_a_device(ws, tmp_path):
    release = ws.release("untied_f32")
    pipe = fifo(tmp_path / "out.gguf")
    refused(cli("convert", release, "-o", pipe, "--type", "f32", "--force", "--no-mmproj"), "is a FIFO")
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)
    for device in ("/dev/full", "/dev/null"):
        link = char_device_link(tmp_path, device)
        refused(cli("convert", release, "-o", link, "--type", "f32", "--force", "--no-mmproj"), "is a character device")
        assert_device_intact(link, device)
    assert not list(tmp_path.glob(".*.partial"))


def test_calibrate_never_replaces_a_fifo_or_a_device(tmp_path):
    pipe = fifo(tmp_path / "calibrated.gguf")
    refused(cli("calibrate", DEMO_MODEL, DATA, *CTX, "-o", pipe, "--force", timeout=QUICK), "not a regular file")
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)
    link = char_device_link(tmp_path)
    refused(cli("calibrate", DEMO_MODEL, DATA, *CTX, "-o", link, "--force", timeout=QUICK), "not a regular file")
    assert_device_intact(link)


# --- calibrate's DATA is an input too -----------------------------------------------------------------
def test_calibrate_never_writes_over_its_labelled_data(tmp_path):
    data = shutil.copy(DATA, tmp_path / "labelled.jsonl")
    before = data.read_bytes()
    refused(cli("calibrate", DEMO_MODEL, data, *CTX, "-o", data, "--force", timeout=QUICK), "is one of the input files")
    os.link(data, tmp_path / "same.gguf")  # the same inode under another name
    refused(cli("calibrate", DEMO_MODEL, data, *CTX, "-o", tmp_path / "same.gguf", "--force", timeout=QUICK), "input files")
    assert data.read_bytes() == before


# --- Reports are never overwritten unasked, nor their own input ------------------------------------------
def test_eval_refuses_a_report_folder_that_holds_its_reports_unless_forced(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "metrics.json").write_text("precious")
    run = cli("eval", DEMO_MODEL, DATA, *CTX, "-o", reports, timeout=QUICK)
    refused(run, f"{reports / 'metrics.json'} exists")
    assert "--force" in run.stderr
    assert sorted(p.name for p in reports.iterdir()) == ["metrics.json"] and (reports / "metrics.json").read_text() == "precious"
    done = cli("eval", DEMO_MODEL, DATA, *CTX, "-o", reports, "--force")
    assert done.returncode == 0, done.stderr
    assert (reports / "metrics.json").read_text().startswith("{") and (reports / "report.md").exists()


def test_eval_never_writes_over_its_own_input_inside_its_folder(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    data = shutil.copy(DATA, reports / "predictions.jsonl")
    before = data.read_bytes()
    refused(cli("eval", DEMO_MODEL, data, *CTX, "-o", reports, "--force", timeout=QUICK), "is one of the input files")
    assert data.read_bytes() == before and sorted(p.name for p in reports.iterdir()) == ["predictions.jsonl"]


def test_a_report_that_is_a_fifo_is_never_replaced(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    pipe = fifo(reports / "report.md")
    refused(cli("eval", DEMO_MODEL, DATA, *CTX, "-o", reports, "--force", timeout=QUICK), "is a FIFO")
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    refused(cli("eval", DEMO_MODEL, DATA, *CTX, "-o", not_a_folder, "--force", timeout=QUICK), "not a folder")


def test_compare_refuses_an_existing_report_unless_forced(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "comparison.json").write_text("precious")
    run = cli("compare", DEMO_MODEL, DEMO_MODEL, DATA, *CTX, "-o", reports, timeout=QUICK)
    refused(run, "comparison.json exists")
    assert "--force" in run.stderr and (reports / "comparison.json").read_text() == "precious"
    done = cli("compare", DEMO_MODEL, DEMO_MODEL, DATA, *CTX, "-o", reports, "--force")
    assert done.returncode == 0, done.stderr
    assert (reports / "comparison.json").read_text().startswith("{")


def test_decide_refuses_an_existing_answers_file_with_exit_9_as_the_other_commands(tmp_path):
    """decide -o onto an answers file that exists is an output refused before any work (exit 9), as calibrate's and
    convert's are: not a bad input (2)."""
    out = tmp_path / "answers.jsonl"
    out.write_text("precious\n")
    run = cli("decide", DEMO_MODEL, DATA, *CTX, "-o", out, timeout=QUICK)
    refused(run, f"{out} exists: --resume continues it, --force overwrites it")
    assert out.read_text() == "precious\n"


# --- Of two runs without --force, exactly one creates OUT ---------------------------------------------------
RACER = """
import sys, time
from pathlib import Path
from clef_gguf.conversion.writer import atomic_output
from clef_gguf.errors import OutputError
out, ready, go = map(Path, sys.argv[1:4])
try:
    with atomic_output(out, force=False) as tmp:  # both runs pass the checks: OUT does not exist yet
        tmp.write_bytes(ready.name.encode())
        ready.touch()
        while not go.exists():
            time.sleep(0.01)
except OutputError as e:
    print(e, file=sys.stderr)
    sys.exit(9)
"""


def test_of_two_runs_without_force_exactly_one_wins(tmp_path):
    out, go = tmp_path / "model.gguf", tmp_path / "go"
    ready = [tmp_path / "run-a", tmp_path / "run-b"]
    runs = [subprocess.Popen([sys.executable, "-c", RACER, out, r, go], stderr=subprocess.PIPE, text=True) for r in ready]
    try:
        for _ in range(3000):
            if all(r.exists() for r in ready) or any(p.poll() is not None for p in runs):
                break
            time.sleep(0.01)
        go.touch()
        outcomes = [(p.wait(60), p.stderr.read()) for p in runs if p.stderr]
    finally:
        for p in runs:
            p.kill()
    assert sorted(code for code, _ in outcomes) == [0, OUTPUT_ERROR], outcomes
    loser = next(text for code, text in outcomes if code)
    assert f"another run wrote {out} first" in loser
    winner = ready[[code for code, _ in outcomes].index(0)]
    assert out.read_bytes() == winner.name.encode()
    assert not list(tmp_path.glob(".*.partial"))


def test_without_hard_links_the_name_is_claimed_exclusively(tmp_path, monkeypatch):
    """Where link(2) is refused (FAT, some FUSE and network file systems), an O_EXCL placeholder claims OUT."""

    def no_links(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "link", no_links)
    out, tmp = tmp_path / "out.gguf", tmp_path / ".out.gguf.1.partial"
    tmp.write_bytes(b"first")
    publish(tmp, out, force=False)
    assert out.read_bytes() == b"first" and not tmp.exists()
    tmp.write_bytes(b"second")
    with pytest.raises(OutputError, match="another run wrote"):
        publish(tmp, out, force=False)
    assert out.read_bytes() == b"first"
    publish(tmp, out, force=True)
    assert out.read_bytes() == b"second"


# --- Every output check before any work -------------------------------------------------------------------
def test_compare_checks_b_before_deciding_with_a(tmp_path):
    run = cli("compare", DEMO_MODEL, tmp_path / "missing.gguf", unopened_input(tmp_path), *CTX, timeout=QUICK)
    refused(run, "missing.gguf", code=5)


@pytest.mark.parametrize("command", ["eval", "compare"])
def test_a_read_only_report_folder_is_refused_before_any_work(tmp_path, command):
    models = [DEMO_MODEL] if command == "eval" else [DEMO_MODEL, DEMO_MODEL]
    data = unopened_input(tmp_path)
    with read_only_folder(tmp_path / "read-only") as folder:
        refused(cli(command, *models, data, *CTX, "-o", folder / "reports", timeout=QUICK), "cannot write in")
        refused(cli(command, *models, data, *CTX, "-o", folder, timeout=QUICK), "cannot write in")


def test_calibrate_over_its_model_is_refused_before_deciding(tmp_path):
    model = shutil.copy(DEMO_MODEL, tmp_path / "model.gguf")
    before = model.read_bytes()
    run = cli("calibrate", model, unopened_input(tmp_path), *CTX, "-o", model, "--force", timeout=QUICK)
    refused(run, "is one of the input files")
    assert model.read_bytes() == before


# --- decide streams into /dev/null and pipes; its model is an input ----------------------------------------
def test_decide_streams_into_dev_null_and_a_fifo(tmp_path):
    done = cli("decide", DEMO_MODEL, DATA, *CTX, "-o", "/dev/null")
    assert done.returncode == 0 and "into /dev/null" in done.stderr, done.stderr
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    pipe, copy = fifo(tmp_path / "answers"), tmp_path / "copy.jsonl"
    reader = subprocess.Popen(["bash", "-c", f"cat '{pipe}' > '{copy}'"])
    done = cli("decide", DEMO_MODEL, DATA, *CTX, "-o", pipe)
    reader.wait(60)
    assert done.returncode == 0, done.stderr
    assert len(copy.read_text().splitlines()) == 24
    refused(cli("decide", DEMO_MODEL, DATA, *CTX, "-o", "/dev/null", "--resume", timeout=QUICK), "is a stream", code=2)


def test_decide_never_writes_over_its_model(tmp_path):
    model = shutil.copy(DEMO_MODEL, tmp_path / "model.gguf")
    before = model.read_bytes()
    refused(cli("decide", model, DATA, *CTX, "-o", model, "--force", timeout=QUICK), "is one of the input files")
    assert model.read_bytes() == before

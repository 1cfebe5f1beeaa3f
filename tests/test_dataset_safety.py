"""The dataset mode loses nothing and never ends in a traceback: any readable input is read, every line gets
its line, output errors are errors, --resume checks the model, image paths stay inside the data's folder, one writer
per answers file."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli
from PIL import Image

import clef_gguf
from clef_gguf.data import DEMO_CONTEXT, DEMO_MODEL, DEMO_REQUEST

DEMO = json.loads(DEMO_REQUEST.read_text())
DECIDE = [sys.executable, "-m", "clef_gguf.cli", "decide", "--ctx", str(DEMO_CONTEXT)]
OUTPUT_ERROR = 9


def _lines(n: int) -> str:
    return "".join(json.dumps({**DEMO, "id": f"r{i}", "state": {"ticket": f"ticket {i}"}}) + "\n" for i in range(n))


def _decide(*args: str, model: Path = DEMO_MODEL) -> subprocess.CompletedProcess[str]:
    """`decide` in this process (cli_helpers); from a shell, or under a file size limit, a real process (DECIDE)."""
    return run_cli(*DECIDE[3:], model, *args)


@pytest.mark.slow
def test_a_pipe_and_a_fifo_are_read_as_stdin_is(tmp_path):
    source = tmp_path / "requests.jsonl"
    source.write_text(_lines(5))
    command = f"{' '.join(DECIDE)} {DEMO_MODEL} --jsonl <(cat {source}) -o {tmp_path / 'piped.jsonl'}"
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert len((tmp_path / "piped.jsonl").read_text().splitlines()) == 5
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["bash", "-c", f"cat {source} > {fifo}"])
    done = _decide("--jsonl", str(fifo), "-o", str(tmp_path / "fifo.jsonl"))
    writer.wait(60)
    assert done.returncode == 0, done.stderr
    assert "5 records: 5 answered" in done.stderr
    assert (tmp_path / "fifo.jsonl").read_text().splitlines() == (tmp_path / "piped.jsonl").read_text().splitlines()


def test_an_id_json_cannot_hold_is_replaced_by_the_line_number_and_said(tmp_path):
    source = tmp_path / "requests.jsonl"
    source.write_text(_lines(1) + '{"id": 1e400, "state": "s", "questions": {"q": {"type": "noul"}}}\n' + _lines(1))
    out = tmp_path / "answers.jsonl"
    done = _decide(str(source), "-o", str(out))
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["id"] for a in answers] == ["r0", 2, "r0"]
    assert "not a finite JSON value" in answers[1]["id_error"] and "answers" in answers[1]
    assert _decide(str(source), "-o", str(out), "--resume").returncode == 0  # and the run can be resumed


@pytest.mark.parametrize("target", ["/dev/full", "/proc/version", "missing-folder/answers.jsonl"])
def test_an_output_that_cannot_be_written_is_one_line_and_exit_9(tmp_path, target):
    source = tmp_path / "requests.jsonl"
    source.write_text(_lines(3))
    out = target if target.startswith("/") else str(tmp_path / target)
    done = _decide(str(source), "-o", out)
    assert done.returncode == OUTPUT_ERROR, done.stderr
    assert "Traceback" not in done.stderr and f"cannot write {out}" in done.stderr


@pytest.mark.slow
def test_a_full_disk_mid_run_leaves_what_resume_mends(tmp_path):
    """A file that stops growing after some bytes (RLIMIT_FSIZE: as a full disk does), then --resume with room."""
    source = tmp_path / "requests.jsonl"
    source.write_text(_lines(6))
    out = tmp_path / "answers.jsonl"
    limit = "import resource, signal, runpy, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    limit += "resource.setrlimit(resource.RLIMIT_FSIZE, (2500, 2500)); sys.argv = sys.argv[1:]; "
    limit += "runpy.run_module('clef_gguf.cli', run_name='__main__')"
    args = ["clef_gguf.cli", "decide", "--ctx", str(DEMO_CONTEXT), str(DEMO_MODEL), str(source), "-o", str(out)]
    done = subprocess.run([sys.executable, "-c", limit, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == OUTPUT_ERROR, done.stderr
    assert "File too large" in done.stderr and "Traceback" not in done.stderr
    resumed = _decide(str(source), "-o", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    whole = tmp_path / "whole.jsonl"
    assert _decide(str(source), "-o", str(whole)).returncode == 0
    assert out.read_text() == whole.read_text()


def test_resume_with_another_model_is_refused(ws, tmp_path):
    source = tmp_path / "requests.jsonl"
    source.write_text(_lines(2))
    out = tmp_path / "answers.jsonl"
    assert _decide(str(source), "-o", str(out)).returncode == 0
    source.write_text(_lines(3))
    other = _decide(str(source), "-o", str(out), "--resume", model=ws.gguf("untied_f32", "f32"))
    assert other.returncode == 2
    assert "decided by another model" in other.stderr and len(out.read_text().splitlines()) == 2
    assert _decide(str(source), "-o", str(out), "--resume").returncode == 0
    assert len(out.read_text().splitlines()) == 3


def test_a_second_writer_is_refused(tmp_path):
    source = tmp_path / "requests.jsonl"
    source.write_text(_lines(2))
    out = tmp_path / "answers.jsonl"
    out.write_text("")
    with open(out, "ab") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        done = _decide(str(source), "-o", str(out), "--force")
    assert done.returncode == 2 and "being written by another run" in done.stderr
    assert out.read_text() == ""


def test_image_paths_stay_inside_the_folder_and_errors_keep_the_id(ws, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (32, 32), (10, 200, 10)).save(tmp_path / "outside.png")
    Image.new("RGB", (32, 32), (10, 200, 10)).save(data / "inside.png")
    requests = [
        {**DEMO, "id": "in", "images": ["inside.png"]},
        {**DEMO, "id": "up", "images": ["../outside.png"]},
        {**DEMO, "id": "etc", "images": ["../../../../../../etc/passwd"]},
        {**DEMO, "id": "nowhere", "images": ["../../../../../../etc/no-such-file.png"]},
        {**DEMO, "id": "missing", "images": ["missing.png"]},
    ]
    source = data / "requests.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests))
    path = ws.gguf("untied_f32", "f32")
    mmproj = ["--mmproj", str(clef_gguf.conversion.convert.default_mmproj_path(path))]
    done = _decide(str(source), "-o", str(tmp_path / "a.jsonl"), *mmproj, model=path)
    assert done.returncode == 8, done.stderr
    answers = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == ["in", "up", "etc", "nowhere", "missing"]
    assert "answers" in answers[0]
    outside = [json.dumps(a["error"]) for a in answers[1:4]]
    assert all("must stay inside" in e for e in outside)
    assert outside[1] == outside[2].replace("no-such-file.png", "passwd")  # an existing file and a missing one alike
    assert "missing.png" in json.dumps(answers[4]["error"])
    anywhere = _decide(str(source), "-o", str(tmp_path / "b.jsonl"), *mmproj, "--allow-image-paths-anywhere", model=path)
    assert "answers" in json.loads((tmp_path / "b.jsonl").read_text().splitlines()[1])
    assert anywhere.returncode == 8  # /etc/passwd is no image, the missing ones are missing


def test_decide_many_answers_every_request_it_took_before_the_source_fails():
    def source():
        for i in range(6):
            yield {**DEMO, "state": {"ticket": f"ticket {i}"}}
        raise OSError("the source broke")

    with clef_gguf.load(DEMO_MODEL, max_prompt_tokens=DEMO_CONTEXT) as model:
        for sort_by_state in (False, True):
            got = []
            with pytest.raises(OSError, match="the source broke"):
                for answer in model.decide_many(source(), sort_by_state=sort_by_state):
                    got.append(answer)
            assert len(got) == 6 and all("answers" in a for a in got)

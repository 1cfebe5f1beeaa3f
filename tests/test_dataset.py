"""`clef-gguf decide` on JSON Lines and model.decide_many: order and ids, error lines, resume, progress."""

from __future__ import annotations

import base64
import io
import json
import os
import pty
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli
from PIL import Image

import clef_gguf
from clef_gguf.data import DEMO_CONTEXT, DEMO_MODEL, DEMO_REQUEST
from clef_gguf.runtime.dataset import Outcome, _windows, decide_outcomes
from clef_gguf.runtime.dataset_file import LINE_FIELDS
from clef_gguf.testing.request_suite import mixed_request

DEMO = json.loads(DEMO_REQUEST.read_text())
CLI = [sys.executable, "-m", "clef_gguf.cli", "decide", "--ctx", str(DEMO_CONTEXT)]


def _requests(n: int) -> list[dict]:
    """n requests about 3 states; every other one with an id of its own."""
    return [{**DEMO, "state": {"ticket": f"ticket {i % 3}"}, **({"id": f"r{i}"} if i % 2 else {})} for i in range(n)]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return path


def decide(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """`decide` in this process (cli_helpers); a run to kill, or on a terminal, is a real process (CLI)."""
    return run_cli(*CLI[3:], *args, stdin=stdin, text=False)


@pytest.fixture(scope="module")
def demo_model():
    with clef_gguf.load(DEMO_MODEL, max_prompt_tokens=DEMO_CONTEXT) as model:
        yield model


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, bytes]:
    """10 requests, a bad one in the middle, and their answers from one uninterrupted run."""
    folder = tmp_path_factory.mktemp("reference")
    lines = [json.dumps(r) for r in _requests(10)]
    lines.insert(4, '{"state": "s", "questions": {"q": {"type": "maybe"}}}')
    source = _write(folder / "requests.jsonl", lines)
    run = decide(str(source), "-o", str(folder / "answers.jsonl"))
    assert run.returncode == 8, run.stderr
    return source, (folder / "answers.jsonl").read_bytes()


def test_answers_are_in_order_with_ids_and_a_bad_line_is_the_servers_error(reference, demo_model):
    source, answers = reference
    lines = [json.loads(line) for line in answers.splitlines()]
    assert [a["line"] for a in lines] == list(range(1, 12))
    assert [a["id"] for a in lines] == [1, "r1", 3, "r3", 5, 6, "r5", 8, "r7", 10, "r9"]
    bad = lines[4]
    assert bad["error"] == {
        "status": 422,
        "detail": [{"loc": ["body", "questions", "q", "type"], "msg": "must be noul, choice or score", "type": "value_error"}],
    }
    assert "model" not in bad
    requests = [json.loads(line) for line in source.read_text().splitlines()]
    want = list(demo_model.decide_many(requests))  # the Python API: the same answers and the same error object
    for line, answer in zip(lines, want, strict=True):
        assert {k: v for k, v in line.items() if k not in LINE_FIELDS} == answer


def test_the_summary_says_the_errors_and_json_gives_it_to_a_machine(tmp_path):
    source = _write(tmp_path / "r.jsonl", [json.dumps(DEMO), "not json"])
    run = decide(str(source), "-o", str(tmp_path / "a.jsonl"), "--json")
    assert run.returncode == 8
    summary = json.loads(run.stdout)
    assert (summary["records"], summary["answered"], summary["errors"], summary["exit_code"]) == (2, 1, 1, 8)
    assert b"1 errors" in run.stderr and b"exit 8" in run.stderr
    again = decide(str(source), "-o", str(tmp_path / "a.jsonl"))
    assert again.returncode == 9 and b"--resume" in again.stderr  # an output refused: never overwritten unasked


def test_stdin_to_stdout_gives_the_same_lines(reference):
    source, answers = reference
    run = decide("--jsonl", "-", "--json", stdin=source.read_bytes())
    assert run.returncode == 8
    assert run.stdout == answers  # nothing but answers on stdout: the summary is on stderr
    assert json.loads(run.stderr.splitlines()[-1])["errors"] == 1


@pytest.mark.slow
def test_resume_after_sigkill_has_no_gap_and_no_duplicate(reference, tmp_path):
    source, answers = reference
    out = tmp_path / "answers.jsonl"
    stop_after = random.Random(26).randint(1, 9)
    process = subprocess.Popen([*CLI, str(source), "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while process.poll() is None and (not out.exists() or out.read_bytes().count(b"\n") < stop_after):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    written = out.read_bytes()
    assert answers.startswith(written) and written.count(b"\n") < 11  # whole lines, the rest not yet decided
    run = decide(str(source), "-o", str(out), "--resume", "--json")
    assert run.returncode == 8, run.stderr
    assert out.read_bytes() == answers
    assert json.loads(run.stdout)["skipped"] == written.count(b"\n")


def test_a_torn_last_line_is_redone_and_another_inputs_answers_are_refused(reference, tmp_path):
    source, answers = reference
    out = tmp_path / "answers.jsonl"
    keep = answers.splitlines(keepends=True)
    for torn in (b"".join(keep[:3]) + keep[3][:40], b"".join(keep[:6]) + bytes(300)):  # a cut write, a power cut's zeros
        out.write_bytes(torn)
        run = decide(str(source), "-o", str(out), "--resume")
        assert run.returncode == 8, run.stderr
        assert out.read_bytes() == answers
    other = _write(tmp_path / "other.jsonl", [json.dumps(_requests(2)[1])])
    run = decide(str(other), "-o", str(out), "--resume")
    assert run.returncode == 2 and b"not the answer to this input" in run.stderr
    out.write_bytes(keep[0] + b"garbage\n" + keep[2])
    run = decide(str(source), "-o", str(out), "--resume")
    assert run.returncode == 2 and b"not a torn end" in run.stderr


def test_sort_by_state_keeps_the_input_order_and_the_answers(demo_model):
    requests = [{**r, "state": {"ticket": f"ticket {i % 3}" * 150}} for i, r in enumerate(_requests(9))]  # cached states
    plain = list(demo_model.decide_many(requests))
    demo_model.state_cache.clear()
    grouped = list(demo_model.decide_many(requests, sort_by_state=True))
    assert [a["answers"] for a in grouped] == [a["answers"] for a in plain]
    cached = [a["usage"]["input_tokens_details"]["cached_tokens"] for a in grouped]
    assert sum(c >= 256 for c in cached) == 6  # each state computed once, the other 6 restored


def test_decide_outcomes_gives_each_tag_back_with_its_outcome_in_input_order(demo_model):
    """What decide_file and eval read: each request's tag (its record) with its outcome; an Outcome given in a
    request's place (a line over the limit, answered unread) comes back in its place; sort_by_state reorders nothing."""
    over = Outcome(None, {"status": 413, "detail": "over the limit"}, None, reason="over the limit")
    requests = [{**r, "state": {"ticket": f"ticket {i % 3}" * 150}} for i, r in enumerate(_requests(7))]
    items = [("a", requests[0]), ("over 1", over), ("bad", b"{not json"), *((f"r{i}", r) for i, r in enumerate(requests[1:]))]
    items.append(("over 2", over))
    expected = [a["answers"] for a in demo_model.decide_many(requests)]
    for sort_by_state in (False, True):
        got = list(decide_outcomes(demo_model, items, sort_by_state=sort_by_state))
        assert [tag for tag, _ in got] == [tag for tag, _ in items]
        outcomes = dict(got)
        assert outcomes["over 1"] is over and outcomes["over 2"] is over
        assert outcomes["bad"].response is None and outcomes["bad"].error["status"] == 422  # (as the server answers it)
        decided = [outcome.response["answers"] for tag, outcome in got if tag == "a" or tag.startswith("r")]
        assert decided == expected


def test_an_outcome_given_in_a_requests_place_counts_in_no_window():
    """The windows (model.parallel requests, or SORT_WINDOW with sort_by_state) are of requests to decide, whatever
    lines over the limit sit between them."""
    over = Outcome(None, {"status": 413, "detail": "over the limit"}, None)
    items = [(1, b"{}"), (2, over), (3, over), (4, b"{}"), (5, b"{}"), (6, over), (7, b"{}")]
    assert [[tag for tag, _ in window] for window in _windows(items, 2)] == [[1, 2, 3, 4], [5, 6, 7]]


@pytest.mark.slow
def test_images_may_be_file_paths_relative_to_the_jsonl_file(ws, tmp_path):
    model, mmproj = ws.gguf("untied_f32", "f32"), ws.mmproj("untied_f32", "f32")
    picture = io.BytesIO()
    Image.fromarray(np.random.default_rng(7).integers(0, 256, (70, 130, 3), dtype=np.uint8)).save(picture, "WEBP")
    (tmp_path / "data" / "img").mkdir(parents=True)
    (tmp_path / "data" / "img" / "photo.webp").write_bytes(picture.getvalue())
    os.mkfifo(tmp_path / "data" / "img" / "fifo.png")  # (a regular file only: reader.read_image)
    url = "data:image/webp;base64," + base64.b64encode(picture.getvalue()).decode()
    with clef_gguf.load(model, max_prompt_tokens=4096, mmproj=mmproj, state_cache=0) as loaded:
        want = loaded.decide({**mixed_request(), "images": [url]})
    lines = [
        json.dumps({**mixed_request(), "images": [image]}) for image in ("img/photo.webp", url, "img/none.png", "img/fifo.png")
    ]
    _write(tmp_path / "data" / "requests.jsonl", lines)
    run = subprocess.run(
        [*CLI[:-2], "--ctx", "4096", str(model), "data/requests.jsonl", "--mmproj", str(mmproj), "--state-cache", "0"],
        capture_output=True,
        timeout=600,
        cwd=tmp_path,  # (paths are the file's folder's, not the working directory's)
    )
    assert run.returncode == 8, run.stderr
    answers = [json.loads(line) for line in run.stdout.splitlines()]
    assert [a["answers"] for a in answers[:2]] == [want["answers"]] * 2
    assert [a["error"]["detail"][0]["loc"] for a in answers[2:]] == [["body", "images", 0]] * 2
    assert "not a regular file" in answers[3]["error"]["detail"][0]["msg"]


def _on_a_terminal(args: list[str]) -> tuple[int, str]:
    """Run with stdin, stdout and stderr a pseudo-terminal: its exit status and what it showed."""
    pid, fd = pty.fork()
    if pid == 0:
        os.environ["COLUMNS"] = "200"
        os.execv(sys.executable, [sys.executable, *args[1:]])
    shown = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 300)
        try:
            chunk = os.read(fd, 65536) if ready else b""
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), shown.decode("utf-8", "replace")


@pytest.mark.slow
def test_a_progress_bar_on_a_terminal_and_none_elsewhere(reference, tmp_path):
    source, _ = reference
    code, shown = _on_a_terminal([*CLI, str(source), "-o", str(tmp_path / "a.jsonl")])
    assert code == 8, shown
    assert "rec/s" in shown and "tok/s" in shown and "cache hits" in shown and "11/11" in shown
    run = decide(str(source), "-o", str(tmp_path / "b.jsonl"))
    assert b"rec/s" not in run.stderr and len(run.stderr.splitlines()) == 1  # the summary line alone
    assert b"decided 11 records" in run.stderr

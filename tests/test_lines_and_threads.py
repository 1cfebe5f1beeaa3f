"""JSON Lines read in bounded lines, --threads on every command that computes, and the messages
that said too little (eval reading stdin; one BOM rule; repeated ids; the help's metavars; a mistyped --base)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
import tracemalloc
import unicodedata
from pathlib import Path

import pytest
from cli_helpers import run_cli as cli  # the CLI in this process

import clef_gguf
from clef_gguf.conversion.release import resolve
from clef_gguf.conversion.writer import check_free_space
from clef_gguf.data import DEMO_CONTEXT, DEMO_MODEL, DEMO_REQUEST
from clef_gguf.errors import AnswersFileError, OutputError, ReleaseError, RequestError
from clef_gguf.llama.threads import physical_threads
from clef_gguf.quality.calibrate import calibrate
from clef_gguf.quality.labelled import duplicates, normalize_label, read_labelled
from clef_gguf.runtime.dataset_file import decide_file, read_records
from clef_gguf.runtime.reader import read_request
from clef_gguf.settings import FileOptions, ModelSpec

ROOT = Path(__file__).resolve().parents[1]
LABELLED = ROOT / "examples" / "labelled.jsonl"
DEMO = json.loads(DEMO_REQUEST.read_text())
BOM = b"\xef\xbb\xbf"


@pytest.fixture(scope="module")
def demo_model():
    with clef_gguf.load(DEMO_MODEL, max_prompt_tokens=DEMO_CONTEXT, n_threads=1) as model:
        yield model


def _long_line(size: int) -> bytes:
    """A JSON request `size` bytes long: a valid one, so only its length can refuse it."""
    body = json.dumps({**DEMO, "state": ""}).encode()
    return body.replace(b'"state": ""', b'"state": "' + b"x" * (size - len(body)) + b'"')


# --- item 8: bounded lines ---------------------------------------------------------------------------
def test_a_line_over_the_limit_is_skipped_in_bounded_memory_and_hashed_whole():
    line = _long_line(8 << 20)
    data = line + b"\n" + b'{"b": 1}\n'
    tracemalloc.start()
    try:
        records = list(read_records(io.BufferedReader(io.BytesIO(data), 1 << 16), max_line_bytes=64 << 10))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(r.line, r.over, r.raw) for r in records] == [(1, len(line), b""), (2, 0, b'{"b": 1}')]
    assert records[0].sha256 == hashlib.sha256(line).hexdigest()
    assert peak < 1 << 20, peak  # the 8 MiB line never held whole (the 64 KiB limit and a chunk or two)


@pytest.mark.parametrize("split", [0, 1, 2])
def test_a_crlf_across_two_chunks_is_the_line_ending_not_the_line(split):
    limit = 100
    # The line's "\r\n" falls on a chunk boundary (the first read takes limit + 2 bytes, the next 64 KiB).
    line = b"y" * (limit + 2 + (1 << 16) - split)
    records = list(read_records(io.BytesIO(line + b"\r\n" + b"z\n"), max_line_bytes=limit))
    assert records[0].over == len(line) and records[0].sha256 == hashlib.sha256(line).hexdigest()
    assert records[1].raw == b"z"


def test_a_line_just_over_the_limit_is_over_and_one_at_it_is_read():
    records = list(read_records(io.BytesIO(b"a" * 10 + b"\r\n" + b"b" * 11 + b"\n" + b"c" * 11), max_line_bytes=10))
    assert [(r.raw, r.over) for r in records] == [(b"a" * 10, 0), (b"", 11), (b"", 11)]


def test_decide_answers_a_line_over_the_limit_with_the_servers_413_in_its_place(demo_model, tmp_path):
    lines = [json.dumps(DEMO).encode(), _long_line(300_000), json.dumps({**DEMO, "id": "last"}).encode(), _long_line(5000)]
    source = tmp_path / "requests.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    summary = decide_file(demo_model, str(source), str(tmp_path / "answers.jsonl"), FileOptions(max_line_bytes=4096))
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [a["line"] for a in answers] == [1, 2, 3, 4] and (summary.answered, summary.errors) == (2, 2)
    for n in (1, 3):
        assert answers[n]["error"]["status"] == 413
        assert answers[n]["error"]["detail"]["message"].startswith(f"the line is {len(lines[n])} bytes, over the limit of 4096")
        assert answers[n]["request_sha256"] == hashlib.sha256(lines[n]).hexdigest()
    assert answers[2]["id"] == "last" and "answers" in answers[2]
    # --resume checks the refused lines by their digest too: nothing is decided again
    again = decide_file(demo_model, str(source), str(tmp_path / "answers.jsonl"), FileOptions(resume=True, max_line_bytes=4096))
    assert (again.skipped, again.records) == (4, 4)


def test_eval_counts_a_line_over_the_limit_as_a_bad_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_bytes(LABELLED.read_bytes() + _long_line(20_000) + b"\n")
    run = cli("eval", str(DEMO_MODEL), str(data), "--json", "--threads", "1", "--max-line-bytes", "16KiB")
    assert run.returncode == 8, run.stderr[-2000:]
    assert json.loads(run.stdout)["records"] == 24
    assert "not counted: line 25 (?): the line is 20000 bytes, over the limit of 16384" in run.stderr


def test_max_line_bytes_is_for_json_lines_only():
    run = cli("decide", str(DEMO_REQUEST), "--max-line-bytes", "1MiB")
    assert run.returncode == 2 and "--max-line-bytes is for JSON Lines" in run.stderr


# --- one BOM rule -------------------------------------------------------------------------------------
def test_a_bom_on_line_1_is_skipped_by_every_reader(demo_model, tmp_path):
    source = tmp_path / "requests.jsonl"
    source.write_bytes(BOM + json.dumps(DEMO).encode() + b"\n" + BOM + json.dumps(DEMO).encode() + b"\n")
    decide_file(demo_model, str(source), str(tmp_path / "answers.jsonl"))
    first, second = (json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines())
    assert "answers" in first  # line 1's BOM skipped
    assert second["error"]["status"] == 422  # a BOM elsewhere is in the middle of the file: not JSON
    labelled = list(read_labelled(io.BytesIO(BOM + LABELLED.read_bytes().splitlines()[0])))
    assert labelled[0].line == 1 and labelled[0].id == "t01"
    request_file = tmp_path / "request.json"
    request_file.write_bytes(BOM + DEMO_REQUEST.read_bytes())
    assert read_request(str(request_file)) == DEMO


# --- eval reads stdin; compare says why it does not ----------------------------------------------------
def test_eval_reads_its_data_from_stdin():
    run = cli("eval", str(DEMO_MODEL), "-", "--json", "--threads", "1", stdin=LABELLED.read_bytes())
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert (result["records"], result["rows"], result["eval"]) == (24, 72, "-")


def test_compare_refuses_stdin_in_one_line():
    run = cli("compare", str(DEMO_MODEL), str(DEMO_MODEL), "-", stdin=LABELLED.read_bytes())
    assert run.returncode == 2 and "compare reads DATA once per model: give a file, not - (stdin)" in run.stderr


# --- repeated ids ---------------------------------------------------------------------------------------
def _labelled(lines: list[bytes]) -> list:
    return list(read_labelled(io.BytesIO(b"\n".join(lines))))


def test_repeated_ids_are_counted_and_contradictory_labels_named():
    first, second, third = LABELLED.read_bytes().splitlines()[:3]
    contradicting = json.loads(first)
    contradicting["labels"]["complaint"] = not contradicting["labels"]["complaint"]
    found = duplicates(_labelled([first, second, first, json.dumps(contradicting).encode(), third, third]))
    assert (found["duplicate_ids"], found["contradictory_ids"]) == (2, 1)
    assert found["warnings"] == [
        "id 't01' is on lines 1, 3, 4 with contradictory labels for complaint",
        "id 't03' is on lines 5, 6 (same labels: counted twice)",
    ]
    assert duplicates(_labelled(LABELLED.read_bytes().splitlines())) == {
        "duplicate_ids": 0,
        "contradictory_ids": 0,
        "warnings": [],
    }


def test_eval_warns_of_repeated_ids_and_counts_them_in_json(tmp_path):
    lines = LABELLED.read_bytes().splitlines()
    contradicting = json.loads(lines[0])
    contradicting["labels"]["complaint"] = not contradicting["labels"]["complaint"]
    data = tmp_path / "data.jsonl"
    data.write_bytes(b"\n".join([*lines, json.dumps(contradicting).encode()]) + b"\n")
    run = cli("eval", str(DEMO_MODEL), str(data), "--json", "--threads", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["duplicates"]["contradictory_ids"] == 1
    assert "warning: id 't01' is on lines 1, 25 with contradictory labels for complaint" in run.stderr


# --- An NFD label for an NFC option ---------------------------------------------------------------
def test_a_choice_label_matches_its_option_in_nfc():
    nfc = unicodedata.normalize("NFC", "café")
    nfd = unicodedata.normalize("NFD", "café")
    question = {"type": "choice", "criteria": {"bar": "a bar", nfc: "a café"}}
    assert normalize_label(question, nfd) == nfc
    both = {"type": "choice", "criteria": {nfc: "composed", nfd: "decomposed"}}
    assert normalize_label(both, nfd) == nfd  # the exact option first
    # s with a dot below and a dot above: composed, decomposed, and half-composed are one text in NFC
    forms = {"type": "choice", "criteria": {"\u1e69": "composed", "s\u0323\u0307": "decomposed"}}
    with pytest.raises(ValueError, match="is, in Unicode NFC, each of the options"):
        normalize_label(forms, "\u1e63\u0307")
    with pytest.raises(ValueError, match="not in options"):
        normalize_label(question, "cafe")


# --- calibrate's holdout ------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-0.1", "0.95"])
def test_calibrate_refuses_a_holdout_that_is_no_share_in_one_line(value, tmp_path):
    run = cli("calibrate", str(DEMO_MODEL), str(LABELLED), "-o", str(tmp_path / "out.gguf"), "--holdout", value)
    assert run.returncode == 2, run.stderr
    assert "--holdout is the share of records held out of the fit, a number from 0 to 0.9" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_too_few_questions_after_the_holdout_names_the_holdout(tmp_path):
    with pytest.raises(RequestError) as raised:
        spec = ModelSpec.of(DEMO_MODEL, max_prompt_tokens=DEMO_CONTEXT, n_threads=1)
        calibrate(spec, LABELLED, tmp_path / "out.gguf", holdout_fraction=0.5)
    message = str(raised.value)
    assert "no question type has 20 labelled questions" in message
    assert "after --holdout 0.5 held out" in message and "of the 72): lower --holdout" in message


# --- --resume after a half-written input line ---------------------------------------------------
def test_resume_after_a_half_written_input_line_says_what_to_do(demo_model, tmp_path):
    whole = json.dumps(DEMO).encode()
    source, out = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    source.write_bytes(whole + b"\n" + whole + b"\n" + whole[:20])  # the third line still being written
    decide_file(demo_model, str(source), str(out))
    source.write_bytes(whole + b"\n" + whole + b"\n" + whole + b"\n")
    with pytest.raises(AnswersFileError) as raised:
        decide_file(demo_model, str(source), str(out), FileOptions(resume=True))
    message = str(raised.value)
    assert "answer 3 (line 3) is not the answer to this input's request 3" in message
    assert f"`head -n 2 {out} > kept.jsonl` keeps the 2 answers before it: resume into that file" in message
    kept = tmp_path / "kept.jsonl"
    kept.write_bytes(b"".join(out.read_bytes().splitlines(keepends=True)[:2]))
    assert decide_file(demo_model, str(source), str(kept), FileOptions(resume=True)).answered == 3  # what the message said works


# --- --base, the help --------------------------------------------------------------------------------
def test_a_pseudo_file_system_is_no_place_for_a_model():
    with pytest.raises(OutputError, match=r"^/proc is on a file system that stores no files"):
        check_free_space(Path("/proc"), 1 << 20)


@pytest.mark.parametrize("base", ["./my-base", "~/my-base", "../my-base", "/my-base"])
def test_a_mistyped_local_base_is_a_missing_folder_not_a_hub_id(base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ReleaseError, match=r"no such folder \(a local path; a Hugging Face repo id is owner/name\)"):
        resolve(base)


def test_the_help_names_arguments_and_flags_as_click_does():
    for command, usage in {"eval": "MODEL DATA", "compare": "MODEL_A MODEL_B DATA", "decide": "[MODEL] REQUEST"}.items():
        run = cli(command, "--help")
        usage_line = next(line.strip() for line in run.stdout.splitlines() if "Usage:" in line)
        assert usage_line.endswith(f" {command} [OPTIONS] {usage}"), usage_line  # (typer 0.2x: {MODEL} {data})
        assert "<bool>" not in run.stdout


# --- item 7: threads ---------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["decide", "eval", "compare", "calibrate", "plan"])
def test_every_command_that_computes_takes_threads(command):
    assert "--threads" in cli(command, "--help").stdout


def test_plan_reports_the_threads_a_load_would_use():
    run = cli("plan", str(DEMO_MODEL), "--ctx", str(DEMO_CONTEXT), "--json", "--threads", "3")
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["threads"] == 3


@pytest.mark.skipif(physical_threads() < 2, reason="one core: nothing to take off")
def test_the_default_leaves_out_a_core_a_neighbour_keeps_busy():
    cpu = min(os.sched_getaffinity(0))
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        time.sleep(0.3)
        code = "from clef_gguf.llama.threads import default_threads; print(default_threads())"
        chosen = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    finally:
        spin.kill()
        spin.wait()
    assert 1 <= chosen <= physical_threads() - 1

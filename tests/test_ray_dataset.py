"""`clef-gguf decide DATA.jsonl --ray` and `eval --ray`: the dataset mode on Ray Data, held to the local mode.

The session's local Ray cluster on loopback (conftest.py's ray_address), this process its driver: the library runs
in-process on it, and the CLI as a subprocess joins it (RAY_ADDRESS). The reference is the local mode's own answers
file (runtime/dataset_file.decide_file) of the same input: byte for byte the same lines, but `cached_tokens` (what
each actor's state cache held). Checked: a dataset with ids, error lines, a line over the limit, a byte order mark and
blank lines, cut into several parts over two actors; --resume from a local run with --ray and the reverse; an actor
killed mid-run (Ray Data restarts it and decides its part again) loses and repeats no line; images by path (read
by the workers) and data URL; an adapter (`--adapter`) on every actor; `eval --ray` gives `eval`'s result; the command
on Ray: Ctrl-C leaves OUT whole (exit 130), OUT is never overwritten unasked, and `--resume` finishes it with the
local mode's summary. Each run starts a pool of actors (each loading the model): one run checks what one run can.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.data", reason="Ray Data is in the optional extra: pip install 'clef-gguf[ray]' (tools/test.sh does)")

import numpy as np  # noqa: E402
import psutil  # noqa: E402  (Ray's own dependency)
from cli_helpers import run_cli  # noqa: E402
from PIL import Image  # noqa: E402

import clef_gguf  # noqa: E402
from clef_gguf.cli.errors import STOP_S  # noqa: E402
from clef_gguf.data import DEMO_CONTEXT, DEMO_MODEL, DEMO_REQUEST  # noqa: E402
from clef_gguf.errors import DeploymentError, SettingsError  # noqa: E402
from clef_gguf.quality import evaluate as evaluating  # noqa: E402
from clef_gguf.runtime.dataset_file import decide_file  # noqa: E402
from clef_gguf.runtime.dataset_ray import DecidePart, RayData, actors_for, decide_file_on_ray  # noqa: E402
from clef_gguf.settings import FileOptions, ModelSpec  # noqa: E402
from clef_gguf.testing.ray_cluster import end_own_cluster, own_cluster_env  # noqa: E402
from clef_gguf.testing.request_suite import mixed_request  # noqa: E402

DEMO = json.loads(DEMO_REQUEST.read_text())
LOAD = {"max_prompt_tokens": DEMO_CONTEXT}
LINES = FileOptions(max_line_bytes=4096)
CLI = [sys.executable, "-m", "clef_gguf.cli", "decide", "--ctx", str(DEMO_CONTEXT)]
CACHED = re.compile(rb'"cached_tokens":\d+')
ACTOR = "_PartActor"  # in the process title of Ray Data's actors: ray::MapWorker(MapBatches(_PartActor))


def _lines(n: int) -> list[str]:
    """n requests about 5 states, every other one with an id of its own; a bad one, text that is no JSON, a blank line,
    and a line over the limit (4096 bytes) among them."""
    lines = [json.dumps({**DEMO, "state": {"ticket": f"ticket {i % 5}"}, **({"id": f"r{i}"} if i % 2 else {})}) for i in range(n)]
    lines.insert(3, '{"state": "s", "questions": {"q": {"type": "maybe"}}}')
    lines.insert(6, "not json")
    lines.insert(8, "")
    lines.insert(11, json.dumps({**DEMO, "id": "long", "state": {"ticket": "x" * 5000}}))
    return lines


def _write(path: Path, lines: list[str]) -> Path:
    path.write_bytes(b"\xef\xbb\xbf" + "".join(f"{line}\n" for line in lines).encode())  # a byte order mark on line 1
    return path


def _same(a: bytes, b: bytes) -> bool:
    return CACHED.sub(b"", a) == CACHED.sub(b"", b)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, bytes]:
    """The requests and the local mode's answers to them."""
    folder = tmp_path_factory.mktemp("data")
    source = _write(folder / "requests.jsonl", _lines(40))
    with clef_gguf.load(DEMO_MODEL, **LOAD) as model:
        summary = decide_file(model, str(source), str(folder / "local.jsonl"), LINES)
    assert (summary.records, summary.errors) == (43, 3)
    return source, (folder / "local.jsonl").read_bytes()


def test_the_actors_are_handed_one_placed_spec_and_a_typed_job(tmp_path, monkeypatch):
    """What every actor gets (pickled by Ray): the CLI's ModelSpec with paths absolute, as every node sees them, and one
    llama.cpp thread unless told; the model's identity read by the driver; decide's job with its FileOptions."""
    monkeypatch.chdir(DEMO_MODEL.parent)
    source = _write(tmp_path / "requests.jsonl", _lines(2))
    actors, known = actors_for(ModelSpec.of(DEMO_MODEL.name, **LOAD), str(source))
    assert actors.spec == ModelSpec.of(str(DEMO_MODEL.resolve()), **LOAD, n_threads=1) and actors.threads == 1
    assert (actors.source, actors.identity, known.path) == (str(source), known.identity, DEMO_MODEL.resolve())
    job = DecidePart(FileOptions(sort_by_state=True, max_line_bytes=4096), str(tmp_path))
    assert pickle.loads(pickle.dumps((actors, job))) == (actors, job) and job.max_line_bytes == 4096
    with pytest.raises(SettingsError, match="not - "):
        actors_for(ModelSpec(DEMO_MODEL), "-")


def _on_ray(source: Path, out: Path, workers: int = 2, part: int = 4, progress=None, **options) -> object:
    spec, settings = ModelSpec.of(DEMO_MODEL, **LOAD), RayData(None, workers, part)
    return decide_file_on_ray(spec, str(source), str(out), settings, FileOptions(max_line_bytes=4096, **options), progress)


@pytest.mark.ray
@pytest.mark.slow
def test_the_answers_on_ray_are_the_local_modes_in_order_and_resume_goes_across_modes_both_ways(ray_address, data, tmp_path):
    source, local = data
    summary = _on_ray(source, tmp_path / "ray.jsonl")  # 11 parts over 2 actors
    on_ray = (tmp_path / "ray.jsonl").read_bytes()
    assert _same(on_ray, local), "the answers on Ray differ from the local mode's"
    assert (summary.records, summary.answered, summary.errors, summary.workers) == (43, 40, 3, 2)
    started_on_ray = tmp_path / "ray-then-local.jsonl"  # a run on Ray stopped after 17 answers
    started_on_ray.write_bytes(b"".join(on_ray.splitlines(keepends=True)[:17]))
    with clef_gguf.load(DEMO_MODEL, **LOAD) as model:
        again = decide_file(model, str(source), str(started_on_ray), FileOptions(resume=True, max_line_bytes=4096))
    assert _same(started_on_ray.read_bytes(), local) and again.skipped == 17
    lines = local.splitlines(keepends=True)
    started_here = tmp_path / "local-then-ray.jsonl"  # a local run stopped after 9 answers, mid-write of the 10th
    started_here.write_bytes(b"".join(lines[:9]) + lines[9][:30])
    summary = _on_ray(source, started_here, resume=True)
    assert _same(started_here.read_bytes(), local) and summary.skipped == 9


def _actor_pids() -> set[int]:
    """The actor processes alive now: an earlier run's may still be stopping, so a test looks for those new to it."""
    found = set()
    for process in psutil.process_iter(["pid", "cmdline"]):
        if any(ACTOR in part for part in process.info["cmdline"] or []):
            found.add(process.info["pid"])
    return found


@pytest.mark.ray
@pytest.mark.slow
def test_an_actor_killed_mid_run_loses_no_answer_and_repeats_none(ray_address, data, tmp_path):
    source, local = data
    killed: list[int] = []
    before = _actor_pids()

    def kill_once(summary, _total) -> None:
        if not killed and summary.records >= 4:  # (39 parts of 1 request still to come)
            pids = _actor_pids() - before
            assert pids, "no actor process found"
            killed.append(min(pids))
            os.kill(killed[0], signal.SIGKILL)

    summary = _on_ray(source, tmp_path / "ray.jsonl", workers=1, part=1, progress=kill_once)
    assert killed and killed[0] not in _actor_pids()
    assert _same((tmp_path / "ray.jsonl").read_bytes(), local)  # every line once, in order
    assert summary.records == 43


def _labelled(path: Path) -> Path:
    intents = ("refund", "replacement", "information")
    records = [
        {
            **DEMO,
            "id": f"t{i}",
            "state": {"ticket": f"ticket {i % 4}"},
            "labels": {"is_complaint": i % 2 == 0, "intent": intents[i % 3], "urgency": i % 3},
        }
        for i in range(24)
    ]
    lines = [json.dumps(r) for r in records]
    lines.insert(5, json.dumps({**DEMO, "labels": {"intent": "nope"}}))  # a bad line, reported and not counted
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


@pytest.mark.ray
@pytest.mark.slow
def test_eval_on_ray_gives_evals_result(ray_address, tmp_path):
    """`eval --ray` (quality/scoring_ray.py's scorer, over two actors) gives `eval`'s result and exit code."""
    data = _labelled(tmp_path / "labelled.jsonl")
    local = json.loads(json.dumps(evaluating.evaluate(ModelSpec.of(DEMO_MODEL, **LOAD), data)))
    command = [sys.executable, "-m", "clef_gguf.cli", "eval", str(DEMO_MODEL), str(data), "--ctx", str(DEMO_CONTEXT)]
    run = subprocess.run(
        [*command, "--ray", "--workers", "2", "--json"],
        env={**os.environ, "RAY_ADDRESS": ray_address},
        capture_output=True,
        timeout=600,
    )
    assert run.returncode == 8, run.stderr.decode()[-3000:]  # (the bad line)
    timing = ("seconds", "records_per_s")
    on_ray = json.loads(run.stdout)
    assert {k: v for k, v in on_ray.items() if k not in timing} == {k: v for k, v in local.items() if k not in timing}
    assert on_ray["rows"] == 72 and len(on_ray["errors"]) == 1


@pytest.mark.ray
@pytest.mark.slow
def test_the_command_on_its_own_cluster_stops_at_once_at_sigterm_to_its_process_group(tmp_path):
    """`decide --ray` with a local cluster of its own, whose processes are in its process group: SIGTERM to the group
    (`timeout`'s, a service manager's stop) stops them with it. It ends at once, 128+15, its session folder removed (it
    waited for the watchdog's 3 s, and left the folder)."""
    source = _write(tmp_path / "requests.jsonl", _lines(2000))
    out = tmp_path / "answers.jsonl"
    env, ray_tmp = own_cluster_env()
    args = [str(source), "-o", str(out), "--max-line-bytes", "4096", "--ray", "--workers", "1"]
    process = subprocess.Popen([*CLI, *args], env=env, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while process.poll() is None and not (out.exists() and out.stat().st_size):  # deciding
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        os.killpg(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=300)
        took = time.monotonic() - started
    finally:
        sessions = end_own_cluster(process, ray_tmp)
    text = stderr.decode()
    assert process.returncode == 128 + signal.SIGTERM and took < STOP_S, (process.returncode, took, text[-3000:])
    assert "stopped by SIGTERM; the answers written are kept" in text and not sessions, (sessions, text[-3000:])


@pytest.mark.ray
@pytest.mark.slow
def test_the_command_on_ray_stops_at_ctrl_c_with_out_whole_and_resume_finishes_it(ray_address, tmp_path):
    """`decide --ray` joining the cluster: Ctrl-C leaves OUT whole (exit 130), --resume finishes it with the local mode's
    answers and summary (exit 8: error lines), and a run without --resume then refuses to overwrite it (exit 2)."""
    # Long enough to be stopped mid-run: the stop is sent as soon as the run's actor process appears.
    source = _write(tmp_path / "requests.jsonl", _lines(100))
    with clef_gguf.load(DEMO_MODEL, **LOAD) as model:
        decide_file(model, str(source), str(tmp_path / "local.jsonl"), LINES)
    local = (tmp_path / "local.jsonl").read_bytes()
    out = tmp_path / "answers.jsonl"
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    args = [str(source), "-o", str(out), "--max-line-bytes", "4096", "--ray", "--workers", "1", "--json"]
    before = _actor_pids()
    process = subprocess.Popen([*CLI, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while process.poll() is None and not _actor_pids() - before:  # the run's actor started: the cluster at work
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr.decode()[-3000:]
    assert b"--resume continues" in stderr
    while _actor_pids() - before:  # the driver gone, its actors are stopped
        assert time.monotonic() < deadline
        time.sleep(0.1)
    written = out.read_bytes()
    assert _same(written, b"".join(local.splitlines(keepends=True)[: written.count(b"\n")]))  # whole answer lines
    run = subprocess.run([*CLI, *args, "--resume"], env=env, capture_output=True, timeout=600)
    assert run.returncode == 8, run.stderr.decode()[-3000:]
    answers = out.read_bytes()
    assert _same(answers, local)
    summary = json.loads(run.stdout)
    counts = {k: summary[k] for k in ("records", "skipped", "answered", "errors", "exit_code")}
    assert counts == {"records": 103, "skipped": written.count(b"\n"), "answered": 100, "errors": 3, "exit_code": 8}
    assert b"decided 103 records: 100 answered, 3 errors" in run.stderr
    again = run_cli("decide", "--ctx", str(DEMO_CONTEXT), *args, env={"RAY_ADDRESS": ray_address})  # (in this process)
    assert again.returncode == 9 and "--resume" in again.stderr  # OUT is never overwritten unasked, on Ray neither
    assert out.read_bytes() == answers


@pytest.mark.ray
@pytest.mark.slow
def test_a_worker_that_cannot_load_the_model_stops_the_run_and_says_why(ray_address, data, tmp_path):
    source, _ = data
    spec = ModelSpec.of(DEMO_MODEL, **LOAD, mmproj=str(tmp_path / "missing.mmproj.gguf"))  # (the actors open it)
    with pytest.raises(DeploymentError, match=r"a Ray worker on \S+ cannot load the model: .*missing\.mmproj\.gguf"):
        decide_file_on_ray(spec, str(source), str(tmp_path / "out.jsonl"), RayData(None, 1), LINES)
    assert (tmp_path / "out.jsonl").read_bytes() == b""  # nothing decided, nothing written


@pytest.mark.ray
@pytest.mark.slow
def test_images_by_path_and_data_url_give_the_local_answers(ray_address, ws, tmp_path):
    model, mmproj = ws.gguf("untied_f32", "f32"), ws.mmproj("untied_f32", "f32")
    picture = io.BytesIO()
    Image.fromarray(np.random.default_rng(7).integers(0, 256, (70, 130, 3), dtype=np.uint8)).save(picture, "WEBP")
    (tmp_path / "data" / "img").mkdir(parents=True)
    (tmp_path / "data" / "img" / "photo.webp").write_bytes(picture.getvalue())
    url = "data:image/webp;base64," + base64.b64encode(picture.getvalue()).decode()
    images = ("img/photo.webp", url, "img/none.png", "../outside.png", "img/photo.webp")  # (the workers read the paths)
    source = _write(tmp_path / "data" / "requests.jsonl", [json.dumps({**mixed_request(), "images": [i]}) for i in images])
    load = {"max_prompt_tokens": 4096, "mmproj": str(mmproj)}
    with clef_gguf.load(model, **load) as loaded:
        decide_file(loaded, str(source), str(tmp_path / "local.jsonl"))
    decide_file_on_ray(ModelSpec.of(model, **load), str(source), str(tmp_path / "ray.jsonl"), RayData(None, 2, 2))
    assert _same((tmp_path / "ray.jsonl").read_bytes(), (tmp_path / "local.jsonl").read_bytes())
    assert (tmp_path / "local.jsonl").read_bytes().count(b'"error"') == 2


@pytest.mark.ray
@pytest.mark.slow
def test_an_adapter_decides_on_ray_as_it_does_locally(ray_address, ws, tmp_path):
    """`decide --adapter FILE --ray`: every actor loads the base and the adapter; the answers and their model_sha256
    (the base's and the adapter's identities together) are the local mode's."""
    from peft_adapters import peft_adapter

    base = ws.gguf("untied_f32", "f32")
    adapter = peft_adapter(ws.release("untied_f32"), tmp_path, "tuned")
    load = {**LOAD, "adapter": str(adapter)}
    source = _write(tmp_path / "requests.jsonl", _lines(12))
    with clef_gguf.load(base, **load) as model:
        decide_file(model, str(source), str(tmp_path / "local.jsonl"), LINES)
        identity = model.identity
    decide_file_on_ray(ModelSpec.of(base, **load), str(source), str(tmp_path / "ray.jsonl"), RayData(None, 2, 4), LINES)
    local, on_ray = (tmp_path / "local.jsonl").read_bytes(), (tmp_path / "ray.jsonl").read_bytes()
    assert _same(on_ray, local) and identity.encode() in on_ray
    with clef_gguf.load(base, **LOAD) as plain:
        assert plain.identity.encode() not in on_ray  # the fine-tune's answers, not the base's

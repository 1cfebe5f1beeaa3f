"""The clef-gguf command, run as a user runs it (a subprocess)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import clef_gguf as clef_gguf_api
from clef_gguf.testing.request_suite import mixed_request


def clef_gguf(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clef_gguf.cli", *args], input=stdin, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_demo_answers_the_bundled_request():
    run = clef_gguf("demo")
    assert run.returncode == 0, run.stderr
    response = json.loads(run.stdout)
    assert set(response["answers"]) == {"is_complaint", "intent", "urgency"}
    assert "RANDOM" in run.stderr


@pytest.mark.parametrize("value", ["many", "-7", "2147483648"])
def test_the_gpu_layers_may_come_from_the_environment(value):
    """CLEF_GGUF_N_GPU_LAYERS, as llama-server's LLAMA_ARG_N_GPU_LAYERS (the device set sets it for subprocesses): a
    value out of -ngl's bounds is one line naming the variable (not n_gpu_layers, which the user never wrote), exit 2."""
    env = {**os.environ, "CLEF_GGUF_N_GPU_LAYERS": value}
    run = subprocess.run([sys.executable, "-m", "clef_gguf.cli", "demo"], capture_output=True, text=True, env=env)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"error: CLEF_GGUF_N_GPU_LAYERS must be an integer from -1 (every layer) to 2147483647, not '{value}'"
    ], run.stderr


@pytest.mark.slow
def test_the_gpu_layers_given_win_over_the_environment():
    env = {**os.environ, "CLEF_GGUF_N_GPU_LAYERS": "-7"}
    run = subprocess.run([sys.executable, "-m", "clef_gguf.cli", "demo", "-ngl", "0"], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and json.loads(run.stdout)["answers"], run.stderr


@pytest.mark.slow
def test_decide_prints_exactly_the_api_response(ws, tmp_path):
    request = mixed_request()
    path = tmp_path / "request.json"
    path.write_text(json.dumps(request, ensure_ascii=False), encoding="utf-8")
    model = ws.gguf("untied_f32", "f32")
    run = clef_gguf("decide", str(model), str(path))
    assert run.returncode == 0, run.stderr
    expected = ws.model("untied_f32", "f32").decide(request)  # (whose state cache gave it the template's preamble)
    assert json.loads(run.stdout) == {**expected, "usage": {**expected["usage"], "input_tokens_details": {"cached_tokens": 0}}}
    from_stdin = clef_gguf("decide", str(model), "-", stdin=json.dumps(request))
    assert json.loads(from_stdin.stdout) == json.loads(run.stdout)


@pytest.mark.slow
def test_decide_reads_images_as_the_api_does(ws, tmp_path):
    model, mmproj = ws.gguf("untied_f32", "f32"), ws.mmproj("untied_f32", "f32")
    picture = io.BytesIO()
    Image.fromarray(np.random.default_rng(7).integers(0, 256, (70, 130, 3), dtype=np.uint8)).save(picture, "WEBP")
    (tmp_path / "photo.webp").write_bytes(picture.getvalue())
    url = "data:image/webp;base64," + base64.b64encode(picture.getvalue()).decode()
    request = {**mixed_request(), "images": [url]}
    (tmp_path / "request.json").write_text(json.dumps(request))
    (tmp_path / "text.json").write_text(json.dumps(mixed_request()))
    with clef_gguf_api.load(model, max_prompt_tokens=4096, mmproj=mmproj, state_cache=0) as loaded:
        want = loaded.decide(request)
    for args in (("request.json",), ("text.json", "--image", "photo.webp")):  # a data URL, or the file itself
        run = clef_gguf(
            "decide",
            str(model),
            *(str(tmp_path / a) if a.endswith(("json", "webp")) else a for a in args),
            "--mmproj",
            str(mmproj),
        )
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout) == want
    without = clef_gguf("decide", str(model), str(tmp_path / "request.json"))
    assert without.returncode == 2 and "mmproj" in without.stderr and "Traceback" not in without.stderr
    bad = clef_gguf(
        "decide", str(model), str(tmp_path / "text.json"), "--mmproj", str(mmproj), "--image", str(tmp_path / "text.json")
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: images.0:")


@pytest.mark.slow
def test_decide_image_files_are_held_to_the_api_limits(tmp_path):
    """--image reads a regular file of at most 4 MiB: /dev/zero, a FIFO without a writer and a large file are one
    line and exit 2 (they were a MemoryError traceback, a hang, and a 5 MiB read)."""
    (tmp_path / "request.json").write_text(json.dumps(mixed_request()))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    large = tmp_path / "large.png"
    large.write_bytes(b"\x89PNG" + bytes(5 << 20))
    for image, message in (("/dev/zero", "not a regular file"), (str(fifo), "not a regular file"), (str(large), "4 MiB")):
        run = clef_gguf("decide", str(tmp_path / "request.json"), "--image", image)  # (the demo model: refused before)
        assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1


def test_decide_without_a_model_uses_the_demo(tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps({"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}))
    run = clef_gguf("decide", str(path))
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["answers"]["q"]["type"] == "noul"


@pytest.mark.slow
def test_user_mistakes_are_one_line_and_an_exit_code(ws, tmp_path):
    model = str(ws.gguf("untied_f32", "f32"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "m", "state": "s", "questions": {"q": {"type": "rank"}}}))
    cases = {
        ("decide", model, str(bad)): (2, "questions.q.type"),
        ("decide", model, str(tmp_path / "missing.json")): (2, "cannot read the request"),
        ("decide", str(tmp_path / "missing.gguf"), str(bad)): (5, "cannot read"),
        ("convert", str(tmp_path), "-o", str(tmp_path / "x.gguf")): (3, "config.json is missing"),
        ("decide", model, str(bad), "--state-cache", "lots"): (2, "not a size"),
    }
    for args, (code, message) in cases.items():
        run = clef_gguf(*args)
        assert run.returncode == code, (args, run.stderr)
        assert message in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert run.stdout == ""


@pytest.mark.slow
def test_convert_shows_progress_and_writes_the_file(ws, tmp_path):
    out = tmp_path / "m.gguf"
    run = clef_gguf("convert", str(ws.release("untied_f32")), "-o", str(out), "--type", "q8_0")
    assert run.returncode == 0, run.stderr
    assert out.read_bytes()[:4] == b"GGUF" and "converting" in run.stderr
    mmproj = tmp_path / "mmproj-m.gguf"  # the vision tower, beside it
    assert f"wrote {out}" in run.stderr and f"wrote {mmproj} (the vision tower)" in run.stderr
    assert mmproj.read_bytes()[:4] == b"GGUF"
    run = clef_gguf("convert", str(ws.release("untied_f32")), "-o", str(out), "--type", "q8_0", "--force", "--no-mmproj")
    assert run.returncode == 0 and "vision tower" not in run.stderr, run.stderr
    run = clef_gguf("convert", str(ws.release("untied_f32")), "-o", str(out), "--no-mmproj", "--mmproj", str(mmproj))
    assert run.returncode == 2 and "exclude each other" in run.stderr


def test_version_is_the_package_s():
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    [version] = re.findall(r'^version = "([^"]+)"$', pyproject, re.MULTILINE)
    done = subprocess.run([sys.executable, "-m", "clef_gguf.cli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"clef-gguf {version}" == f"clef-gguf {clef_gguf_api.__version__}"

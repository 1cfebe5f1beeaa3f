"""The portable route (CLEF_GGUF_LOADER=portable: llama_model_init_from_user and adapters through a temporary file,
llama/loader.py) against the glibc cookie route: the same tokens, hidden states and probabilities, to the last bit, on
f32 and quantized files, with CPU_REPACK, an image request, an adapter fine-tune and `clef-gguf serve`; and parity with
the reference as tests/test_parity.py holds it. Also: the setting's values, and a tensor the view cannot fill."""

from __future__ import annotations

import base64
import functools
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import llama_cpp as L
import numpy as np
import pytest

import clef_gguf
from clef_gguf.conversion.adapter import convert_adapter
from clef_gguf.errors import BackendUnavailableError, ExitCode, ModelFileError, SettingsError
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama import backbone, cookie_file, cpu_buffers, loader, user_model
from clef_gguf.llama.qwen35_view import view_tensor_names
from clef_gguf.settings import LOADER_ENV
from clef_gguf.testing import finetune
from clef_gguf.testing.request_suite import (
    all_requests,
    labelled_requests,
    largest_difference,
    mixed_request,
    response_probabilities,
)

CONTEXT = 1024
REQUESTS = all_requests()
TEXT = ["mixed", "ten_level_score"]  # (the suite's longer requests add time, not paths)
# (release, file type, tolerance against the reference: tests/test_parity.py's; None: not held to it there)
FILES = [("untied_f32", "f32", 0.005), ("untied_f32", "q8_0", 0.035), ("k256", "q4_k_m", None)]
LORA = {"r": 8, "lora_alpha": 16, "target_modules": r".*language_model.*\.(q_proj|v_proj|in_proj_qkv|out_proj|down_proj)"}
needs_glibc = pytest.mark.skipif(not cookie_file.available(), reason="the cookie route needs glibc's fopencookie")


@contextmanager
def loaded(route: str, path: Path, **options: Any) -> Iterator[clef_gguf.ClefModel]:
    """A model of `path` loaded by `route`, the variable kept for its life (adapters are loaded when first asked for)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LOADER_ENV, route)
        assert loader.route() == route
        with clef_gguf.load(path, max_prompt_tokens=CONTEXT, state_cache=0, **options) as model:
            yield model


def observed(model: clef_gguf.ClefModel, requests: list[dict], hidden: bool = True) -> list[tuple]:
    """Per request: its tokens, the backbone's hidden states of them (text only), its unrounded probabilities and
    its response."""
    out = []
    for request in requests:
        prompt = model.encode(request)
        states = model.compute(model.backbone.hidden_states, prompt.tokens) if hidden else None
        [scores] = model.score_batch([prompt])
        out.append((prompt.tokens, states, scores.probabilities, model.decide(request)))
    return out


def assert_identical(ours: list[tuple], theirs: list[tuple]) -> None:
    for mine, other in zip(ours, theirs, strict=True):
        (tokens, states, probabilities, response), (tokens_, states_, probabilities_, response_) = mine, other
        assert tokens == tokens_
        assert (states is None and states_ is None) or (states.tobytes() == states_.tobytes())  # bit for bit, NaN or not
        assert [p.tobytes() for p in probabilities] == [p.tobytes() for p in probabilities_]
        assert response == response_


@needs_glibc
@pytest.mark.parametrize(("release", "file_type", "tolerance"), FILES)
def test_the_portable_route_decides_as_the_cookie_route(ws, oracle_probabilities, release, file_type, tolerance):
    path, requests = ws.gguf(release, file_type), [REQUESTS[name] for name in TEXT]
    with loaded(loader.COOKIE, path) as model:
        cookie = observed(model, requests)
    with loaded(loader.PORTABLE, path) as model:
        portable = observed(model, requests)
    assert_identical(portable, cookie)
    if tolerance is not None:
        theirs = oracle_probabilities(release, "mixed")
        assert largest_difference(response_probabilities(portable[0][3]), theirs) <= tolerance


@needs_glibc
def test_weights_in_cpu_repack_are_filled_through_ggml(ws, monkeypatch):
    """CPU_REPACK's buffer is no host memory: the portable route hands it each weight whole (ggml_backend_tensor_set),
    and it repacks them as it does for llama.cpp's own reads (Q4_K here: the fixtures' Q8_0 rows are too short)."""
    path = ws.gguf("k256", "q4_k_m")
    f = GGUFFile.open(path)
    try:
        tensors = {n: f.header.tensors[n] for n in view_tensor_names(f, lean=True)}
        if cpu_buffers.REPACK not in cpu_buffers.extra_buffer_types():
            pytest.skip("ggml offers no CPU_REPACK on this CPU")
        assert cpu_buffers.placement(tensors, repack=True, by_override=True).repacked  # some weights do go there
    finally:
        f.close()
    monkeypatch.setattr(cpu_buffers, "placement", functools.partial(cpu_buffers.placement, repack=True))
    request = [REQUESTS["mixed"]]
    with loaded(loader.COOKIE, path) as model:
        cookie = observed(model, request)
    with loaded(loader.PORTABLE, path) as model:
        assert_identical(observed(model, request), cookie)


def image_request() -> dict:
    from PIL import Image

    picture = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (90, 150, 3), dtype=np.uint8)).save(picture, "PNG")
    return {**mixed_request(), "images": ["data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()]}


@needs_glibc
def test_an_image_request_is_answered_alike(ws):
    path, mmproj = ws.gguf("untied_f32", "f32"), ws.mmproj("untied_f32", "f32")
    with loaded(loader.COOKIE, path, mmproj=mmproj) as model:
        cookie = observed(model, [image_request()], hidden=False)
    with loaded(loader.PORTABLE, path, mmproj=mmproj) as model:
        portable = observed(model, [image_request()], hidden=False)
        text_only = len(model.encode(mixed_request()).tokens)
    assert_identical(portable, cookie)
    assert len(portable[0][0]) > text_only + 16  # the image's tokens are in the prompt


@pytest.fixture(scope="module")
def tuned(ws, tmp_path_factory) -> tuple[Path, Path]:
    """The untied fixture's f32 file and an f32 adapter file of a PEFT LoRA over it (random A and B, a moved head)."""
    root, release = tmp_path_factory.mktemp("portable"), ws.release("untied_f32")
    checkpoint = finetune.peft_checkpoint(release, root, LORA, {"prior_logit_scale": 0.5})
    return ws.gguf("untied_f32", "f32"), convert_adapter(checkpoint, release, root / "tune.adapter.gguf", "f32")


@needs_glibc
def test_an_adapter_decides_alike(tuned):
    base, adapter = tuned
    requests = [{**r, "model": "tune"} for r in labelled_requests(2)] + [labelled_requests(1)[0]]
    with loaded(loader.COOKIE, base, adapters={"tune": adapter}) as model:
        cookie = observed(model, requests, hidden=False)
    with loaded(loader.PORTABLE, base, adapters={"tune": adapter}) as model:
        portable = observed(model, requests, hidden=False)
    assert_identical(portable, cookie)
    assert portable[0][3]["model"] == "tune"
    tuned, base = portable[0][2], portable[2][2]  # one request asked of the fine-tune and of the base
    assert not all(np.array_equal(a, b) for a, b in zip(tuned, base, strict=True))


@pytest.mark.slow
@needs_glibc
def test_serve_on_the_portable_route_answers_as_the_cookie_route(ws):
    import httpx
    from live_server import serve_process, served

    from clef_gguf.testing.processes import free_port

    path, request = ws.gguf("untied_f32", "f32"), mixed_request()
    with loaded(loader.COOKIE, path, n_threads=1) as model:  # serve runs one thread (live_server), as here
        expected = model.decide(request)
    with served(path, "--ctx", str(CONTEXT), "--state-cache", "0", env={LOADER_ENV: "portable"}) as (url, _):
        body = httpx.post(f"{url}/v1/systemone", json=request, timeout=120).json()
    assert body["answers"] == expected["answers"] and body["usage"]["input_tokens"] == expected["usage"]["input_tokens"]
    # serve does read the variable: a value it cannot have is a usage error, in one line, before it listens.
    wrong = serve_process(path, free_port(), env={LOADER_ENV: "glibc"})
    _, stderr = wrong.communicate(timeout=120)
    assert wrong.returncode == ExitCode.BAD_INPUT, stderr
    assert f"{LOADER_ENV} must be one of auto, cookie, portable, not 'glibc'" in stderr and "Traceback" not in stderr


def test_the_setting_takes_three_values_and_names_them(monkeypatch):
    monkeypatch.setenv(LOADER_ENV, "fopencookie")
    with pytest.raises(SettingsError, match=f"{LOADER_ENV} must be one of auto, cookie, portable, not 'fopencookie'"):
        loader.route()
    monkeypatch.setenv(LOADER_ENV, "portable")
    assert loader.route() == loader.PORTABLE
    monkeypatch.setattr(cookie_file, "available", lambda: False)  # as on macOS and Windows
    monkeypatch.setenv(LOADER_ENV, "auto")
    assert loader.route() == loader.PORTABLE
    monkeypatch.delenv(LOADER_ENV)
    assert loader.route() == loader.PORTABLE
    monkeypatch.setenv(LOADER_ENV, "cookie")
    with pytest.raises(SettingsError, match="needs glibc's fopencookie"):
        loader.route()


def test_a_tensor_the_view_cannot_fill_is_a_one_line_error(ws, monkeypatch):
    """llama.cpp creates tensors a Clef file lacks (biases, scales: user_model.IDENTITIES), filled with identities.
    Were it to ask for any other missing tensor, the load fails naming it (and frees what llama.cpp made)."""
    monkeypatch.setenv(LOADER_ENV, "portable")
    monkeypatch.setattr(user_model, "IDENTITIES", ())
    f = GGUFFile.open(ws.gguf("untied_f32", "f32"))
    try:
        missing = r"backbone of .*: llama.cpp asked for a tensor blk\.\d+\.\S+ that the file does not have"
        with pytest.raises(ModelFileError, match=missing):
            backbone.load_model(f, lean=True)
        model = backbone.load_model(f, lean=True, no_alloc=True)  # plan's pass fills nothing, and asks for nothing
        assert model
        L.llama_model_free(model)
    finally:
        f.close()


# A process that loads llama-cpp-python's libraries from LLAMA_CPP_LIB_PATH (a copy of them here), decides on the
# portable route (both of ggml-base's users: the rows and the view's loader), and lists the ggml-base files it maps.
ONE_GGML = """
import json
import clef_gguf
from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST

with clef_gguf.load(DEMO_MODEL, max_prompt_tokens=512, state_cache=0) as model:
    model.decide(json.loads(DEMO_REQUEST.read_text()))
print(json.dumps(sorted({line.split()[-1] for line in open("/proc/self/maps") if "ggml-base" in line})))
"""


@pytest.mark.slow
def test_ggml_base_is_bound_once_from_llama_cpps_own_folder(tmp_path):
    """One ggml in the process, the one libllama links, where LLAMA_CPP_LIB_PATH says llama-cpp-python's libraries are
    (a second copy, with its own globals, beside the one llama.cpp uses would be a second ggml)."""
    libraries = Path(shutil.copytree(Path(L.__file__).parent / "lib", tmp_path / "lib"))
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(libraries), LOADER_ENV: "portable"}
    run = subprocess.run([sys.executable, "-c", ONE_GGML], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    mapped = json.loads(run.stdout.splitlines()[-1])
    assert len(mapped) == 1 and Path(mapped[0]).parent == libraries, mapped


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_libraries_that_do_not_load_from_llama_cpp_lib_path_name_it(tmp_path, where):
    """LLAMA_CPP_LIB_PATH at a folder that does not exist, or that holds no libraries: the one line names the variable
    and its value as the cause (reinstalling llama-cpp-python, what it said, would change nothing)."""
    folder = tmp_path / where
    if where == "empty":
        folder.mkdir()
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(folder)}
    run = subprocess.run([sys.executable, "-m", "clef_gguf.cli", "demo"], env=env, capture_output=True, text=True, timeout=300)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == BackendUnavailableError.exit_code and len(lines) == 1, run.stderr[-3000:]
    assert f"LLAMA_CPP_LIB_PATH is set to '{folder}'" in lines[0] and "Reinstall" not in lines[0], lines

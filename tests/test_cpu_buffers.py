"""CPU weights never land in ggml's AMX buffer type (it segfaults: ggml-org/llama.cpp#20824).

These tests run on every CPU. On an Intel Xeon with AMX they are the regression tests of
the crash; elsewhere they check that the placement is llama.cpp's default.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import llama_cpp as L
import numpy as np
import pytest

import clef_gguf
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama import cpu_buffers
from clef_gguf.llama import log as llama_log
from clef_gguf.llama.plan import memory_plan
from clef_gguf.llama.qwen35_view import write_backbone_gguf
from clef_gguf.testing.request_suite import mixed_request

QUANTIZED = ["q8_0", "q4_k_m"]
_BUFFER_LINE = re.compile(r"(\S+) model buffer size")


def _model_buffers(load) -> set[str]:
    """The buffer types llama.cpp reports holding weights while `load()` runs."""
    lines: list[str] = []
    with llama_log.capture_info(lines.append):
        result = load()
    if hasattr(result, "close"):
        result.close()
    return {m[1] for m in _BUFFER_LINE.finditer("".join(lines))}


def _system_has_amx() -> bool:
    return "AMX_INT8 = 1" in L.llama_print_system_info().decode()


def test_amx_is_seen_where_the_cpu_and_the_build_have_it():
    types = cpu_buffers.extra_buffer_types()
    assert (cpu_buffers.AMX in types) == _system_has_amx(), (types, L.llama_print_system_info())
    if cpu_buffers.AMX in types:
        assert "amx_int8" in Path("/proc/cpuinfo").read_text()


@pytest.mark.parametrize("file_type", QUANTIZED)
def test_no_weight_lands_in_amx(ws, file_type):
    path = ws.gguf("k256", file_type)
    buffers = _model_buffers(lambda: clef_gguf.load(path, max_prompt_tokens=512, n_threads=1))
    assert cpu_buffers.AMX not in buffers
    assert "CPU" in buffers
    if cpu_buffers.AMX in cpu_buffers.extra_buffer_types():  # the measured default there: no repacking
        assert cpu_buffers.REPACK not in buffers


def test_cpu_repack_can_be_kept_without_amx(ws, tmp_path):
    """repack=True: the Q4_K weights ggml repacks go to CPU_REPACK, and still none to AMX."""
    if cpu_buffers.REPACK not in cpu_buffers.extra_buffer_types():
        pytest.skip("this CPU has no CPU_REPACK buffer type")
    clef = GGUFFile.open(ws.gguf("k256", "q4_k_m"))
    plain = tmp_path / "backbone-q4_k_m.gguf"
    write_backbone_gguf(clef, plain)
    clef.close()
    placed = cpu_buffers.for_gguf(plain, repack=True)

    def load() -> None:
        params = L.llama_model_default_params()
        placed.apply(params)
        L.llama_model_free(L.llama_model_load_from_file(str(plain).encode(), params))

    buffers = _model_buffers(load)
    assert cpu_buffers.AMX not in buffers and cpu_buffers.REPACK in buffers
    if cpu_buffers.AMX in cpu_buffers.extra_buffer_types():
        assert placed.repacked and not placed.use_extra_bufts  # routed by overrides, AMX left out
    else:
        assert placed.use_extra_bufts and not placed.repacked  # llama.cpp's own placement


def test_plan_places_weights_as_the_runtime_does(ws):
    path = ws.gguf("k256", "q4_k_m")
    assert cpu_buffers.AMX not in _model_buffers(lambda: memory_plan(path, 256, n_gpu_layers=0))


def test_a_plain_qwen35_file_loaded_by_path_decodes(ws, tmp_path):
    """What tools/ and bare llama.cpp comparisons do: the same placement, through for_gguf."""
    clef = GGUFFile.open(ws.gguf("k256", "q8_0"))
    plain = tmp_path / "backbone-q8_0.gguf"
    write_backbone_gguf(clef, plain)
    clef.close()
    code = f"""
import llama_cpp as L
from clef_gguf.llama import cpu_buffers
from clef_gguf.llama import log as llama_log
llama_log.init_backend()
params = L.llama_model_default_params()
cpu_buffers.for_gguf({str(plain)!r}).apply(params)
model = L.llama_model_load_from_file({str(plain).encode()!r}, params)
cparams = L.llama_context_default_params()
cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 64
cparams.n_threads = cparams.n_threads_batch = 1
ctx = L.llama_init_from_model(model, cparams)
tokens = (L.llama_token * 32)(*range(1, 33))
batch = L.llama_batch_get_one(tokens, 32)
assert L.llama_decode(ctx, batch) == 0
print("decoded")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.strip() == "decoded"


@pytest.mark.parametrize("file_type", QUANTIZED)
@pytest.mark.slow
def test_quantized_decisions_end_without_a_signal_and_match_in_process(ws, tmp_path, file_type):
    """`clef-gguf decide` as a user runs it; a segfault would be returncode -11."""
    request = mixed_request()
    request_path = tmp_path / "request.json"
    request_path.write_text(json.dumps(request, ensure_ascii=False), encoding="utf-8")
    path = ws.gguf("k256", file_type)
    run = subprocess.run(
        [sys.executable, "-m", "clef_gguf.cli", "decide", str(path), str(request_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    theirs = json.loads(run.stdout)["answers"]
    # Loaded here and closed, not ws.model's session copy: a model of ws's one 8192-token ubatch reserves 8.7 GB of
    # address space, and with several alive the test process's forks (subprocess, pty) fail with ENOMEM.
    with clef_gguf.load(path, max_prompt_tokens=4096) as model:
        ours = model.decide(request)["answers"]
    assert theirs.keys() == ours.keys()
    for qid, answer in ours.items():
        expected = answer.get("probabilities") or {"p": answer["noul"]}
        got = theirs[qid].get("probabilities") or {"p": theirs[qid]["noul"]}
        assert np.allclose(list(got.values()), list(expected.values()), atol=1e-3), qid

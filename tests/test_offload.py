"""Offload in part: the last layers on the device, the first ones and the token embeddings on the host.

In the device set (tests/conftest.py) the layers really split between Vulkan or CUDA and the CPU; on a CPU build
llama.cpp keeps every layer on the host, and these tests check the answers and the host placement only.
"""

from __future__ import annotations

import re

import pytest
from conftest import device_build, f16_tiles

import clef_gguf
from clef_gguf.format import hparams
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama import cpu_buffers
from clef_gguf.llama import log as llama_log
from clef_gguf.testing.request_suite import all_requests, largest_difference, response_probabilities

pytestmark = pytest.mark.device

# The device's kernels sum in other orders than the CPU's: float noise on probabilities (1.5e-4 measured on Vulkan
# with F32 tiles). A device that rounds the products' operands to F16 (conftest.f16_tiles) moves them more: 3.4e-3
# measured on lavapipe, Q4_K_M, half the layers there; the parity tests hold the device to the reference.
TOLERANCE, F16_TOLERANCE = 5e-4, 5e-3


@pytest.mark.slow
def test_half_the_layers_on_the_device_answer_as_the_cpu(ws):
    path = ws.gguf("k256", "q4_k_m")
    f = GGUFFile.open(path)
    n_layer = hparams.backbone_shape(f.header).n_layer
    f.close()
    half = n_layer // 2
    lines: list[str] = []
    with llama_log.capture_info(lines.append):
        partial = clef_gguf.load(path, n_gpu_layers=half)
    log = "".join(lines)
    with partial, clef_gguf.load(path, n_gpu_layers=0) as cpu:
        tolerance = F16_TOLERANCE if f16_tiles(partial.head.device) else TOLERANCE
        for name, request in all_requests().items():
            if name == "long_state":  # thousands of tokens: minutes on a software device
                continue
            ours, theirs = (response_probabilities(m.decide(request)) for m in (partial, cpu))
            assert largest_difference(ours, theirs) < tolerance, name
        # (a CPU build ignores the offload the device set asks for: its rehearsal on the CPU)
        assert partial.head.device == cpu.head.device if not device_build() else partial.head.device != "CPU"
    # The host part (CPU, or a device's pinned Vulkan_Host / CUDA_Host): never AMX, which segfaults.
    buffers = {m[1] for m in re.finditer(r"(\S+) model buffer size", log)}
    host_buffers = {b for b in buffers if b.startswith("CPU") or b.endswith("_Host")}
    assert cpu_buffers.AMX not in host_buffers and host_buffers, log
    if device_build():
        assert f"offloaded {half}/{n_layer + 1} layers to GPU" in log, log

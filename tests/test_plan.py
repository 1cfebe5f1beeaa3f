"""The memory plan: figures from the file, from llama.cpp's no-alloc pass, and what fits."""

from __future__ import annotations

import re

import pytest
from cli_helpers import run_cli  # the CLI in this process
from conftest import device_build

import clef_gguf
from clef_gguf.errors import SettingsError
from clef_gguf.format import contract as C
from clef_gguf.format import hparams
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama import log as llama_log
from clef_gguf.llama.backbone import MAX_UBATCH
from clef_gguf.llama.plan import MIB, memory_plan
from clef_gguf.settings import DEFAULT_UBATCH, LoadOptions
from clef_gguf.table_checks import parse_size

pytestmark = pytest.mark.device  # in the device set (tests/conftest.py)


def _line(plan, prefix: str):
    return next(line for line in plan.lines if line.component.startswith(prefix))


_BUFFER = re.compile(r"(\S+) +(model|KV|RS|compute) buffer size = +([\d.]+) MiB")


def _allocated(path, **load_args) -> dict[tuple[str, str], int]:
    """Bytes of each kind of buffer llama.cpp allocated while the runtime loaded `path`, on the device and on the
    host, from its own log lines ("Vulkan0 KV buffer size = 0.25 MiB")."""
    lines: list[str] = []
    with llama_log.capture_info(lines.append):
        clef_gguf.load(path, **load_args).close()
    sizes: dict[tuple[str, str], int] = {}
    for m in _BUFFER.finditer("".join(lines)):
        side = "host" if m[1].startswith("CPU") or m[1].endswith("_Host") else "device"
        sizes[m[2], side] = sizes.get((m[2], side), 0) + int(float(m[3]) * MIB)
    return sizes


def _close(planned: int, allocated: int) -> bool:
    """Within 5%, or 0.02 MiB (llama.cpp logs sizes to 0.01 MiB, and the fixtures' buffers are small)."""
    return abs(planned - allocated) <= max(0.05 * allocated, 0.02 * MIB)


@pytest.mark.parametrize("offload", ["default", "none"])
def test_the_plan_is_what_llama_cpp_allocates(ws, default_gpu_layers, offload):
    """The runtime's real load against the plan, buffer by buffer, where they are: on the device in the device set
    (n_gpu_layers -1), on the host otherwise. n_gpu_layers 0 is the CPU alone, a device build's too: no buffer
    on the device, as the plan says."""
    path, n_ctx = ws.gguf("k256", "q4_k_m"), 1024
    n_gpu_layers = default_gpu_layers if offload == "default" else 0
    # A CPU build ignores the offload asked for (the device set's rehearsal on the CPU): it allocates as for none.
    on_device = n_gpu_layers if device_build() else 0
    plan = memory_plan(path, n_ctx, n_gpu_layers=on_device)
    allocated = _allocated(path, max_prompt_tokens=n_ctx, n_gpu_layers=n_gpu_layers)
    side = "device" if on_device else "host"
    for kind, component in (("KV", "KV cache"), ("RS", "recurrent state"), ("compute", "compute buffer")):
        line = _line(plan, component)
        planned = line.device_bytes if side == "device" else line.host_bytes
        assert _close(planned, allocated[kind, side]), (component, planned, allocated)
    if on_device:
        weights = _line(plan, "backbone weights").device_bytes + _line(plan, "identity LM head").device_bytes
        assert _close(weights, allocated["model", "device"]), (weights, allocated)
    else:
        assert not [key for key in allocated if key[1] == "device"] and plan.device_bytes == 0, allocated


def test_weights_come_from_the_file_and_llama_cpp_holds_only_the_layers(ws):
    path = ws.gguf("k256", "q4_k_m")
    plan = memory_plan(path, 1024, n_gpu_layers=-1)
    f = GGUFFile.open(path)
    tensors = f.header.tensors
    layers = sum(t.n_bytes for n, t in tensors.items() if n.startswith("blk.") or n == "output_norm.weight")
    mapped = tensors["token_embd.weight"].n_bytes + tensors["output.weight"].n_bytes  # read by the runtime on the host
    f.close()
    weights = _line(plan, "backbone weights")
    assert (weights.device_bytes, weights.host_bytes) == (layers, mapped)
    assert set(plan.weights_by_type) >= {"Q4_K", "Q6_K", "F32"}
    assert sum(t for t in plan.weights_by_type.values()) == layers + mapped


def test_the_head_is_counted_where_it_runs(ws):
    """Its weights in their stored types plus the F32 transposed key weight of each memory attention, on the
    device as soon as layers are offloaded (the native head runs where the backbone runs)."""
    path = ws.gguf("k256", "q4_k_m")
    f = GGUFFile.open(path)
    config = hparams.head_config(f.header)
    expected = sum(t.n_bytes for n, t in f.header.tensors.items() if C.is_head_tensor(n))
    expected += (config.routing_layers + config.layers) * config.width**2 * 4
    f.close()
    offloaded = _line(memory_plan(path, 512), "joint schema head")
    on_host = _line(memory_plan(path, 512, n_gpu_layers=0), "joint schema head")
    assert (offloaded.device_bytes, offloaded.host_bytes) == (expected, 0)
    assert (on_host.device_bytes, on_host.host_bytes) == (0, expected)


def test_buffers_grow_with_the_prompt_limit_and_stay_on_the_host_without_offload(ws):
    path = ws.gguf("k256", "q4_k_m")
    small, large = memory_plan(path, 512), memory_plan(path, 4096)
    for component in ("KV cache", "compute buffer"):
        assert 0 < _line(small, component).device_bytes < _line(large, component).device_bytes
    assert _line(small, "recurrent state").device_bytes == _line(large, "recurrent state").device_bytes > 0
    on_host = memory_plan(path, 512, n_gpu_layers=0)
    assert on_host.device_bytes == 0 and on_host.host_bytes > 0


def test_the_largest_fitting_prompt_follows_the_card(ws):
    path = ws.gguf("k256", "q4_k_m")
    fits = [memory_plan(path, 512, vram=parse_size(v)).max_prompt_tokens for v in ("12MiB", "24MiB", "48MiB")]
    f = GGUFFile.open(path)
    trained = hparams.context_length(f.header)
    f.close()
    assert fits[0] < fits[1] < fits[2] < trained  # in ubatches, as the runtime runs: no longer capped at MAX_UBATCH
    assert memory_plan(path, 512, vram=parse_size("1GiB")).max_prompt_tokens == trained
    plan = memory_plan(path, fits[1], vram=parse_size("24MiB"))
    assert plan.device_bytes <= parse_size("24MiB") < memory_plan(path, fits[1] + 256).device_bytes
    assert memory_plan(path, 512, vram=parse_size("1MiB")).max_prompt_tokens is None


def test_a_backbone_only_file_is_planned_too(ws, tmp_path):
    from clef_gguf.llama.qwen35_view import write_backbone_gguf

    f = GGUFFile.open(ws.gguf("k256", "q4_k_m"))
    write_backbone_gguf(f, tmp_path / "backbone.gguf")
    f.close()
    plan = memory_plan(tmp_path / "backbone.gguf", 1024)
    assert _line(plan, "joint schema head").host_bytes == 0
    assert not any(C.is_head_tensor(n) for n in plan.weights_by_type)


def test_a_backbone_without_recurrent_layers_is_planned_as_llama_cpp_reads_it(ws, tmp_path):
    """llama.cpp derives the layer types from full_attention_interval when the array is absent; so does the
    one hyperparameter reader that plan, graft and validate share (plan used to refuse such a file)."""
    from clef_gguf.llama.qwen35_view import write_backbone_gguf
    from clef_gguf.testing.gguf_bytes import rebuild

    f = GGUFFile.open(ws.gguf("k256", "q4_k_m"))
    write_backbone_gguf(f, tmp_path / "backbone.gguf")
    f.close()
    rebuild(tmp_path / "backbone.gguf", tmp_path / "bare.gguf", drop_keys={"qwen35.attention.recurrent_layers"})
    with_key, without = memory_plan(tmp_path / "backbone.gguf", 1024), memory_plan(tmp_path / "bare.gguf", 1024)
    assert [(x.component, x.device_bytes, x.host_bytes) for x in without.lines] == [
        (x.component, x.device_bytes, x.host_bytes) for x in with_key.lines
    ]


@pytest.mark.parametrize(("text", "value"), [("8GiB", 8 << 30), ("8 GB", 8 << 30), ("512MiB", 512 << 20), ("1.5G", 3 << 29)])
def test_sizes_read_like_a_card_label(text, value):
    assert parse_size(text) == value


def test_a_physical_batch_llama_cpp_cannot_plan_is_refused_before_loading(ws):
    # A context that large is fine in ubatches (the default); as one physical batch it is refused.
    with pytest.raises(SettingsError, match="ubatch"):
        clef_gguf.load(ws.gguf("untied_f32", "f32"), max_prompt_tokens=MAX_UBATCH + 1, ubatch=MAX_UBATCH + 1)


def test_the_plan_command_prints_a_table_or_json(ws):
    import json

    path = str(ws.gguf("k256", "q4_k_m"))
    run = run_cli("plan", path, "--vram", "48MiB", "--json")
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["max_prompt_tokens"] == memory_plan(path, vram=parse_size("48MiB")).max_prompt_tokens
    assert (plan["n_ctx"], plan["ubatch"]) == (LoadOptions.max_prompt_tokens, DEFAULT_UBATCH)  # what load uses
    assert {line["source"] for line in plan["lines"]} == {"file", "llama.cpp", "computed"}
    table = run_cli("plan", path, "--vram", "48MiB")
    assert table.returncode == 0 and "largest prompt that fits 48MiB" in table.stdout
    bad = run_cli("plan", path, "--vram", "lots")
    assert bad.returncode == 2 and "not a size" in bad.stderr


def test_the_vision_tower_is_counted_where_it_runs(ws):
    path, mmproj = ws.gguf("untied_f32", "f32"), ws.mmproj("untied_f32", "f32")
    f = GGUFFile.open(mmproj)
    weights = sum(t.n_bytes for t in f.header.tensors.values())
    f.close()
    text, both = memory_plan(path, 512), memory_plan(path, 512, mmproj=mmproj)
    tower = _line(both, "vision tower weights")
    assert (tower.device_bytes, tower.host_bytes) == (weights, 0)
    compute = _line(both, "vision compute")
    assert "256 tokens" in compute.component and compute.device_bytes > 0  # the fixture's largest image (its max pixels)
    assert both.device_bytes - text.device_bytes == weights + compute.device_bytes
    on_host = _line(memory_plan(path, 512, n_gpu_layers=0, mmproj=mmproj), "vision tower weights")
    assert (on_host.device_bytes, on_host.host_bytes) == (0, weights)
    with pytest.raises(clef_gguf.ModelFileError):
        memory_plan(path, 512, mmproj=path)  # a model is no mmproj


_LORA_BUFFER = re.compile(r"(\S+) +LoRA buffer size = +([\d.]+) MiB")


@pytest.fixture(scope="module")
def k256_adapters(ws, tmp_path_factory):
    """Two adapter files over the k256 release: f32 and q8_0 (whose products llama.cpp runs as such)."""
    from peft_adapters import peft_adapter

    root = tmp_path_factory.mktemp("plan-adapters")
    release = ws.release("k256")
    return [peft_adapter(release, root, "a", file_type="f32"), peft_adapter(release, root, "b", seed=1, file_type="q8_0")]


@pytest.mark.parametrize("offload", ["default", "none"])
def test_an_adapter_is_planned_as_llama_cpp_allocates_its_lora(ws, default_gpu_layers, k256_adapters, offload):
    """plan --adapter: each adapter's LoRA where llama.cpp puts it (its "LoRA buffer size" lines, logged when the
    runtime loads it for its first request), and a whole head of its own where the base's head runs."""
    from clef_gguf.llama.plan import adapter_head_bytes

    path, n_ctx = ws.gguf("k256", "q4_k_m"), 1024
    n_gpu_layers = default_gpu_layers if offload == "default" else 0
    on_device = n_gpu_layers if device_build() else 0  # (a CPU build ignores the offload)
    plan = memory_plan(path, n_ctx, n_gpu_layers=on_device, adapters=k256_adapters)
    alone = memory_plan(path, n_ctx, n_gpu_layers=on_device)
    assert [a.adapter for a in plan.adapters] == [str(p) for p in k256_adapters]
    assert plan.device_bytes + plan.host_bytes - alone.device_bytes - alone.host_bytes == plan.adapter_bytes > 0
    request = {"state": "s", "questions": {"q": {"type": "noul"}}}
    base = GGUFFile.open(path)
    try:
        for adapter, cost in zip(k256_adapters, plan.adapters, strict=True):
            lines: list[str] = []
            loading = {"max_prompt_tokens": n_ctx, "n_gpu_layers": n_gpu_layers, "adapters": {"x": adapter}}
            with clef_gguf.load(path, **loading) as model, llama_log.capture_info(lines.append):
                assert model.decide({**request, "model": "x"})["model"] == "x"  # the LoRA is loaded for its first request
            allocated = {"device": 0, "host": 0}
            for m in _LORA_BUFFER.finditer("".join(lines)):
                allocated["host" if m[1].startswith("CPU") or m[1].endswith("_Host") else "device"] += int(float(m[2]) * MIB)
            assert sum(allocated.values()) > 0, "".join(lines)[-2000:]
            assert _close(cost.lora_device_bytes, allocated["device"]) and _close(cost.lora_host_bytes, allocated["host"])
            f = GGUFFile.open(adapter)
            head = adapter_head_bytes(base, f)
            f.close()
            assert (cost.head_device_bytes, cost.head_host_bytes) == ((head, 0) if on_device else (0, head))
    finally:
        base.close()


def test_plan_adapter_prints_a_line_each_and_their_total(ws, k256_adapters, tmp_path):
    import json

    path = str(ws.gguf("k256", "q4_k_m"))
    args = [arg for adapter in k256_adapters for arg in ("--adapter", str(adapter))]
    command = ["plan", path, "--ctx", "1024", *args]
    table = run_cli(*command)
    assert table.returncode == 0, table.stderr
    assert "adapter a.adapter.gguf" in table.stdout and "adapter b.adapter.gguf" in table.stdout
    assert "2 adapters: " in table.stdout
    listed = run_cli(*command, "--json")
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    assert data["adapter_bytes"] == memory_plan(path, 1024, adapters=k256_adapters).adapter_bytes > 0
    assert [a["adapter"] for a in data["adapters"]] == [str(a) for a in k256_adapters]
    other = ws.gguf("untied_f32", "f32")  # another base: refused with validate's exit code for the pair
    refused = run_cli("plan", other, *args[:2])
    assert refused.returncode == 7 and "does not fit the base" in refused.stderr, refused.stderr

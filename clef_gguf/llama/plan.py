"""Memory plan of a Clef (or backbone-only qwen35) GGUF on llama.cpp: what fits a card.

Each figure says where it comes from:
  file      - the GGUF header (tensor sizes: exact);
  llama.cpp - llama.cpp's own no-alloc pass (model params no_alloc: it plans every
              buffer without allocating): KV cache, recurrent state, compute buffer
              at a prompt limit of n_ctx tokens in ubatches, read from its log;
  computed  - arithmetic here (placement of layers, output buffer, head).
With adapters (`plan BASE --adapter FILE...`), each adapter's LoRA tensors (from its file, where llama.cpp puts
them) and the whole head it is served with.
The compute buffer is measured on the backends this llama.cpp build has: on a
CPU-only build, the CPU backend's buffer stands in for the GPU's (same graph; the
CUDA backend's differs by a few percent) and the plan says so.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import llama_cpp as L

from ..check.adapter import is_adapter
from ..check.adapter_pair import require_adapter
from ..check.mmproj import describe_mmproj
from ..errors import ModelFileError, NotADecisionModelError
from ..format import contract as C
from ..format import hparams
from ..format import vision as V
from ..format.adapter import lora_target
from ..format.header import GGUFFile
from ..format.sizes import adapter_head_bytes, head_bytes
from ..settings import LoadOptions, default_ubatch
from . import log as llama_log
from .backbone import context_params, load_model
from .qwen35_view import lean_vocab

MIB = 1 << 20
_SIZE = re.compile(r"(\w+)\s+compute buffer size =\s+([\d.]+) MiB")
_KV = re.compile(r"llama_kv_cache: size =\s+([\d.]+) MiB")
_RS = re.compile(r"llama_memory_recurrent: size =\s+([\d.]+) MiB")
_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class Line:
    component: str
    device_bytes: int
    host_bytes: int
    source: str  # file | llama.cpp | computed


@dataclass(frozen=True)
class AdapterCost:
    """One adapter's memory once loaded: its LoRA pairs (llama.cpp's LoRA buffers) and the head it is served with."""

    adapter: str  # the file
    lora_device_bytes: int
    lora_host_bytes: int
    head_device_bytes: int
    head_host_bytes: int

    @property
    def line(self) -> Line:
        lora, head = self.lora_device_bytes + self.lora_host_bytes, self.head_device_bytes + self.head_host_bytes
        component = f"adapter {Path(self.adapter).name} (LoRA {lora / MIB:.1f} + head {head / MIB:.1f} MiB)"
        device, host = self.lora_device_bytes + self.head_device_bytes, self.lora_host_bytes + self.head_host_bytes
        return Line(component, device, host, "file")


@dataclass(frozen=True)
class Plan:
    model: str
    n_ctx: int
    ubatch: int
    n_gpu_layers: int
    lines: tuple[Line, ...]
    weights_by_type: dict[str, int]
    gpu_backend: bool  # False: the compute buffer was measured on the CPU backend
    vram: int | None = None
    max_prompt_tokens: int | None = None  # the largest prompt whose device total fits `vram`
    adapters: tuple[AdapterCost, ...] = ()  # (each also one of `lines`)

    @property
    def adapter_bytes(self) -> int:
        """The adapters' memory, device and host together."""
        return sum(a.line.device_bytes + a.line.host_bytes for a in self.adapters)

    @property
    def device_bytes(self) -> int:
        return sum(line.device_bytes for line in self.lines)

    @property
    def host_bytes(self) -> int:
        return sum(line.host_bytes for line in self.lines)

    def to_dict(self) -> dict[str, object]:
        totals = {"device_bytes": self.device_bytes, "host_bytes": self.host_bytes, "adapter_bytes": self.adapter_bytes}
        return asdict(self) | totals


class _NoAllocModel:
    """The backbone loaded by llama.cpp with no_alloc: every buffer planned, none allocated."""

    def __init__(self, f: GGUFFile, n_gpu_layers: int) -> None:
        llama_log.init_backend()
        # The lean view, as the runtime loads it (no n_vocab logits), of a Clef or a plain qwen35 file,
        # its weights placed as the runtime places them: the figures describe what runs.
        self.model = load_model(f, lean=True, n_gpu_layers=n_gpu_layers, no_alloc=True)

    def measure(self, n_ctx: int, n_ubatch: int | None = None, parallel: int = LoadOptions.parallel) -> dict[str, float]:
        """MiB of KV cache, recurrent state and compute buffers (per backend) for one context, as the runtime
        creates it (backbone.context_params: one llama_decode per prompt, up to `parallel` sequences), in one
        physical batch or ubatches of n_ubatch."""
        lines: list[str] = []
        params = context_params(n_ctx, n_ubatch or n_ctx, parallel=parallel)
        with llama_log.capture_info(lines.append):
            ctx = L.llama_init_from_model(self.model, params)
        if not ctx:
            raise ModelFileError(
                f"llama.cpp could not plan a context of {n_ctx} tokens: {llama_log.last_error('no reason given')}"
            )
        L.llama_free(ctx)
        text = "".join(lines)
        sizes = {f"compute:{m[1]}": float(m[2]) for m in _SIZE.finditer(text)}
        sizes["kv"] = sum(float(m[1]) for m in _KV.finditer(text))
        sizes["recurrent"] = sum(float(m[1]) for m in _RS.finditer(text))
        return sizes

    def close(self) -> None:
        L.llama_model_free(self.model)


def _on_device(name: str, n_layer: int, offloaded: int) -> bool:
    """llama.cpp offloads the last `offloaded` repeating layers, then the output layer.

    In the lean view llama.cpp holds neither the file's output.weight nor token_embd (its first
    lean_vocab rows): the runtime reads their rows from the mapped file on the host.
    """
    m = _BLOCK.match(name)
    if m:
        return int(m[1]) >= n_layer - offloaded
    return name == "output_norm.weight" and offloaded > n_layer


# llama.cpp allocates each LoRA tensor in a buffer of its base weight's type, rounded up to the buffer's alignment
# (ggml_backend_buft_get_alignment: 32 bytes on the CPU, 128 or less on the GPU backends).
LORA_ALIGNMENT = 32


def adapter_cost(base: GGUFFile, path: str | Path, n_layer: int, offloaded: int) -> AdapterCost:
    """An adapter's memory next to `base` loaded with `offloaded` layers on the device. llama.cpp puts a LoRA tensor
    in its base weight's buffer (src/llama-adapter.cpp; the CPU's where that is a repacking type): on the device for
    the offloaded layers, else on the host. The head runs where the base's does: on the device as soon as layers
    are offloaded."""
    adapter = GGUFFile.read(path)  # (read once, not mapped: another process may change the file meanwhile)
    try:
        if not is_adapter(adapter.header):
            why = "convert CHECKPOINT --base RELEASE --to-adapter makes one"
            raise NotADecisionModelError(f"{path} is not an adapter file ({why})")
        require_adapter(base, adapter.header, str(path))
        lora = [0, 0]  # device, host
        for name, t in adapter.header.tensors.items():
            target = lora_target(name)
            if target is not None:
                lora[0 if _on_device(target[0], n_layer, offloaded) else 1] += -(-t.n_bytes // LORA_ALIGNMENT) * LORA_ALIGNMENT
        head = adapter_head_bytes(base, adapter)
    finally:
        adapter.close()
    return AdapterCost(str(path), lora[0], lora[1], *((head, 0) if offloaded > 0 else (0, head)))


def _lines(
    f: GGUFFile, sizes: dict[str, float], n_ctx: int, ubatch: int, offloaded: int
) -> tuple[list[Line], dict[str, int], bool]:
    shape = hparams.backbone_shape(f.header, f.path.name)
    n_layer, recurrent = shape.n_layer, shape.recurrent
    tensors = f.header.tensors
    weights_device = weights_host = 0
    by_type: dict[str, int] = {}
    for name, t in tensors.items():
        if C.is_head_tensor(name):
            continue
        by_type[t.type.name] = by_type.get(t.type.name, 0) + t.n_bytes
        if _on_device(name, n_layer, offloaded):
            weights_device += t.n_bytes
        else:
            weights_host += t.n_bytes
    head = head_bytes(f)
    identity = shape.n_embd * lean_vocab(f) * 4

    def split(total_mib: float, layers: list[int]) -> tuple[int, int]:
        on = sum(1 for il in layers if il >= n_layer - offloaded)
        device = int(total_mib * MIB * on / max(len(layers), 1))
        return device, int(total_mib * MIB) - device

    full = [il for il in range(n_layer) if not recurrent[il]]
    linear = [il for il in range(n_layer) if recurrent[il]]
    kv, rs = split(sizes["kv"], full), split(sizes["recurrent"], linear)
    gpu_backend = any(not k.endswith(("CPU", "_Host")) for k in sizes if k.startswith("compute:"))
    compute_total = sum(v for k, v in sizes.items() if k.startswith("compute:")) * MIB
    if gpu_backend:
        compute_device = int(
            sum(v for k, v in sizes.items() if k.startswith("compute:") and not k.endswith(("CPU", "_Host"))) * MIB
        )
    else:  # a CPU-only build: its compute buffer stands in for the GPU's when layers are offloaded
        compute_device = int(compute_total) if offloaded > 0 else 0
    lines = [
        Line("backbone weights", weights_device, weights_host, "file"),
        Line("KV cache (full-attention layers)", *kv, "llama.cpp"),
        Line("recurrent state (linear-attention layers)", *rs, "llama.cpp"),
        Line(f"compute buffer (ubatch {ubatch})", compute_device, int(compute_total) - compute_device, "llama.cpp"),
        # The lean view's LM head, an F32 identity (qwen35_view.py), where llama.cpp puts the output layer;
        # its logits, the hidden states, in llama.cpp's output buffer on the host.
        Line("identity LM head", *((identity, 0) if offloaded > n_layer else (0, identity)), "computed"),
        Line("hidden-state output buffer", 0, n_ctx * lean_vocab(f) * 4, "computed"),
        # The native head runs where the backbone runs: on the GPU as soon as layers are offloaded.
        Line("joint schema head", *((head, 0) if offloaded > 0 else (0, head)), "file"),
    ]
    return lines, by_type, gpu_backend


def memory_plan(
    path: str | Path,
    n_ctx: int = LoadOptions.max_prompt_tokens,
    n_gpu_layers: int = -1,
    vram: int | None = None,
    ubatch: int | None = None,
    mmproj: str | Path | None = None,
    parallel: int = LoadOptions.parallel,
    adapters: Sequence[str | Path] = (),
) -> Plan:
    """The memory a model needs at a prompt limit of n_ctx tokens, and the largest prompt limit that fits `vram`.

    With `mmproj`, the vision tower too (on the device when layers are offloaded, as the runtime runs it); with
    `adapters` (adapter files over this base), each one loaded (adapter_cost).

    Prompts are processed in ubatches of `ubatch` tokens, as the runtime does (the default is
    its default: settings.default_ubatch, DEFAULT_UBATCH or the prompt limit when that is smaller), up to `parallel` of them
    together (each with a recurrent state of its own).
    """
    # load()'s checks (settings.LoadOptions): what would abort llama.cpp or wrap its C types is refused here too
    LoadOptions(n_gpu_layers=n_gpu_layers, max_prompt_tokens=n_ctx, ubatch=ubatch, parallel=parallel)

    def ubatch_at(n: int) -> int:
        return default_ubatch(n) if ubatch is None else min(ubatch, n)

    f = GGUFFile.open(path)
    try:
        n_layer = hparams.backbone_shape(f.header, f.path.name).n_layer
        offloaded = n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer + 1)
        costs = tuple(adapter_cost(f, a, n_layer, offloaded) for a in adapters)  # (refused before llama.cpp plans)
        model = _NoAllocModel(f, n_gpu_layers)
        try:
            vision = vision_lines(mmproj, offloaded > 0) if mmproj is not None else []

            def lines_at(n: int) -> tuple[list[Line], dict[str, int], bool]:
                lines, by_type, gpu = _lines(f, model.measure(n, ubatch_at(n), parallel), n, ubatch_at(n), offloaded)
                return lines + vision + [c.line for c in costs], by_type, gpu

            lines, by_type, gpu = lines_at(n_ctx)
            fits = None
            if vram is not None:
                limit = hparams.context_length(f.header)
                fits = _largest_fitting(lambda n: sum(x.device_bytes for x in lines_at(n)[0]), vram, limit)
        finally:
            model.close()
    finally:
        f.close()
    return Plan(str(path), n_ctx, ubatch_at(n_ctx), n_gpu_layers, tuple(lines), by_type, gpu, vram, fits, costs)


# clip.cpp's compute buffer for one image of n tokens, fitted to what tools/plan_vision.py measured on
# Qwen3.5's tower (1152 wide, f16; the peak a CPU process grows by while it encodes one image): 13, 49, 120,
# 221 and 437 MiB at 64, 256, 576, 1024 and 2048 tokens, proportional (clip.cpp's attention is flash attention):
# MiB = VISION_MIB_PER_TOKEN n, within 6 MiB of each. Another tower is scaled by its width. Images are
# encoded one at a time: the largest one sizes the buffer.
VISION_MIB_PER_TOKEN = 0.2135
QWEN35_VISION_WIDTH = 1152


def vision_compute_bytes(shape: V.VisionShape, n_tokens: int) -> int:
    return int(VISION_MIB_PER_TOKEN * n_tokens * shape.n_embd / QWEN35_VISION_WIDTH * MIB)


def vision_lines(mmproj: str | Path, on_device: bool) -> list[Line]:
    """The vision tower's memory: its weights (the file's) and the compute of its largest image."""
    f = GGUFFile.open(mmproj)
    try:
        d = describe_mmproj(f.header)
        if d is None:
            raise ModelFileError(f"{f.path.name} is not an mmproj clef-gguf runs: `clef-gguf validate` it")
        weights = sum(t.n_bytes for t in f.header.tensors.values())
    finally:
        f.close()
    per_token = V.pixels_per_token(d.shape.patch_size)
    largest = d.max_pixels // per_token if d.max_pixels is not None else V.CLIP_DEFAULT_IMAGE_TOKENS[1]
    compute = vision_compute_bytes(d.shape, largest)
    embeddings = largest * d.embedding_width * 4  # one image's embeddings, copied to the host
    return [
        Line("vision tower weights (mmproj)", *((weights, 0) if on_device else (0, weights)), "file"),
        Line(f"vision compute (an image of {largest} tokens)", *((compute, 0) if on_device else (0, compute)), "computed"),
        Line("image embeddings", 0, embeddings, "computed"),
    ]


def _largest_fitting(device_bytes, vram: int, limit: int, step: int = 256) -> int | None:
    """Binary search over multiples of `step`: device memory grows with the prompt."""
    low, high = 0, limit // step
    if device_bytes(step) > vram:
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if device_bytes(mid * step) <= vram:
            low = mid
        else:
            high = mid - 1
    return low * step

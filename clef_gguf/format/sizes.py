"""What a model's head and an adapter take in memory once loaded, from file headers alone: `plan`'s figures
(llama/plan.py) and the byte bound of the loaded adapters (runtime/adapter_files.py), which needs no llama.cpp."""

from __future__ import annotations

from . import contract as C
from . import hparams
from .adapter import lora_target
from .header import GGUFFile, TensorInfo


def _served_head_bytes(f: GGUFFile, tensors: dict[str, TensorInfo]) -> int:
    """Head tensors in their stored types, plus the F32 transposed key weight of each attention over the prompt (one
    per routing block and joint layer, width x width) that the native head makes; `f` is the base (the head's shape)."""
    config = hparams.head_config(f.header, f.path.name)
    return sum(t.n_bytes for t in tensors.values()) + (config.routing_layers + config.layers) * config.width**2 * 4


def head_bytes(f: GGUFFile) -> int:
    """The native head of a Clef file (0 for a backbone-only file)."""
    tensors = {n: t for n, t in f.header.tensors.items() if C.is_head_tensor(n)}
    return _served_head_bytes(f, tensors) if tensors else 0


def lora_bytes(adapter: GGUFFile) -> int:
    """An adapter file's LoRA pairs, in their stored types (what llama.cpp copies into its LoRA buffers)."""
    return sum(t.n_bytes for n, t in adapter.header.tensors.items() if lora_target(n))


def adapter_head_bytes(base: GGUFFile, adapter: GGUFFile) -> int:
    """The whole head an adapter is served with (a head of its own in libclef_head): its head tensors where it has
    them, else the base's."""
    tensors = {n: t for n, t in base.header.tensors.items() if C.is_head_tensor(n)}
    tensors |= {n: t for n, t in adapter.header.tensors.items() if C.is_head_tensor(n)}
    return _served_head_bytes(base, tensors)

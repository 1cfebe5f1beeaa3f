"""LoRA adapters on the lean backbone: llama.cpp's own adapter API, unmerged.

An adapter belongs to the llama.cpp model and a context applies a set of them to every token of a ubatch
(`build_lora_mm`: W x + scale B (A x), scale = alpha / rank per pair, src/llama-graph.cpp of 0.3.36's llama.cpp).
A Clef adapter file is shown to llama.cpp through a qwen35 view of its LoRA pairs (qwen35_view.open_adapter_view),
as the model itself is, by the same route (llama/loader.py). The context holds at most one adapter at a time here:
a batch is one model's.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import llama_cpp as L

from ..errors import ModelFileError
from ..format.header import GGUFFile
from . import loader
from . import log as llama_log

Handle = Any  # a llama_adapter_lora * (llama-cpp-python's ctypes pointer)


def load_lora(model: L.llama_model_p, f: GGUFFile, scratch: Path | None = None) -> Handle:
    """The adapter file's LoRA pairs loaded over `model` (the lean view of its base), in the weights' buffers.

    The view reads `f.path` again: the runtime passes a private copy of one version of the adapter (runtime/
    adapter_files.py), never a file another process may rewrite, so that the LoRA is the bytes validated. `scratch`:
    where the portable route writes its temporary file (loader.load_adapter)."""
    handle = loader.load_adapter(model, f, scratch)  # by the backbone's route (llama/loader.py)
    if not handle:
        raise ModelFileError(f"llama.cpp could not load the LoRA of {f.path.name}: {llama_log.last_error('no reason given')}")
    return handle


def apply_lora(ctx: L.llama_context_p, handle: Handle | None) -> None:
    """Make `handle` (None: no adapter) the context's whole adapter set, at scale 1 (the file's scales are folded in).

    llama.cpp reserves the context's graphs again on the next decode when the set changes: callers change it only
    when the model of a batch does."""
    if handle is None:
        L.llama_set_adapters_lora(ctx, None, 0, None)
        return
    adapters = (L.llama_adapter_lora_p_ctypes * 1)(handle)
    scales = (ctypes.c_float * 1)(1.0)
    L.llama_set_adapters_lora(ctx, adapters, 1, scales)


def free_lora(handle: Handle) -> None:
    """Free an adapter no context applies any more (llama_adapter_lora_free does not detach it from contexts)."""
    L.llama_adapter_lora_free(handle)

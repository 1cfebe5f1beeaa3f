"""The backbone alone, as plain llama.cpp runs it: the bare context benchmarks compare clef-gguf with."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def bare_context(
    path: str | Path, n_ctx: int, *, n_gpu_layers: int = 0, threads: int | None = None, repack: bool | None = None
) -> tuple[Any, Any]:
    """(llama_model, llama_context) over a plain qwen35 GGUF: one sequence, n_ctx tokens in one physical batch,
    every token's embedding out, its weights placed as the runtime places them (never AMX: it segfaults)."""
    import llama_cpp as L

    from ..llama import cpu_buffers
    from ..llama import log as llama_log

    llama_log.init_backend()
    params = L.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    cpu_buffers.for_gguf(path, n_gpu_layers=n_gpu_layers, repack=repack).apply(params)
    model = L.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    cparams = L.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_ctx
    cparams.n_seq_max = 1
    cparams.embeddings = True
    cparams.pooling_type = L.LLAMA_POOLING_TYPE_NONE
    if threads is not None:
        cparams.n_threads = cparams.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        L.llama_model_free(model)
        raise RuntimeError("llama.cpp could not create the context")
    return model, ctx

"""The backbone alone, as plain llama.cpp runs it: the bare context benchmarks compare clef-gguf with."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def bare_context(
    path: str | Path, n_ctx: int, *, n_gpu_layers: int = 0, threads: int | None = None, repack: bool | None = None
) -> tuple[Any, Any]:
    """(llama_model, llama_context) over a plain qwen35 GGUF: one sequence, n_ctx tokens in one physical batch,
    every token's embedding out, its weights placed as the runtime places them (never AMX: it crashes there)."""
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


class BareLlama:
    """The backbone alone, as plain llama.cpp runs it: a qwen35 GGUF by path, a token batch."""

    def __init__(self, path: Path, n_ctx: int, n_gpu_layers: int, threads: int) -> None:
        import llama_cpp as L

        self.L = L
        self.model, self.ctx = bare_context(path, n_ctx, n_gpu_layers=n_gpu_layers, threads=threads)
        self.batch = L.llama_batch_init(n_ctx, 0, 1)

    def prefill(self, tokens: list[int]) -> None:
        L, b = self.L, self.batch
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        for i, token in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, i, 1, True
            b.seq_id[i][0] = 0
        b.n_tokens = len(tokens)
        assert L.llama_decode(self.ctx, b) == 0
        assert L.llama_get_embeddings(self.ctx)  # the hidden states, as a decision reads them
        L.llama_synchronize(self.ctx)

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)

"""The Qwen3.5 backbone on stock llama.cpp (llama-cpp-python's libllama).

One context, sized so that a whole prompt is one physical batch (n_ubatch = n_ctx
= max_prompt_tokens): embeddings on, pooling none, so a decode yields every
token's final hidden state (after the output norm).
"""

from __future__ import annotations

import os
import unicodedata

import llama_cpp as L
import numpy as np

from ..errors import ModelFileError, PromptTooLongError
from ..gguf_header import GGUFFile
from . import llama_log
from .qwen35_view import open_qwen35_view


class Backbone:
    """A loaded backbone and its context. Not thread-safe: one decode at a time."""

    def __init__(
        self, f: GGUFFile, *, n_gpu_layers: int = 0, max_prompt_tokens: int = 4096, n_threads: int | None = None, nfc: bool = True
    ) -> None:
        llama_log.init_backend()
        self.max_prompt_tokens = max_prompt_tokens
        self.nfc = nfc
        params = L.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.load_mode = L.LLAMA_LOAD_MODE_NONE  # a FILE* from fopencookie cannot be mmapped
        view = open_qwen35_view(f)
        try:
            llama_log.clear_errors()
            self.model = L.llama_model_load_from_file_ptr(view.fp, params)
        finally:
            view.close()
        if not self.model:
            raise ModelFileError(
                f"llama.cpp could not load the backbone of {f.path.name}: {llama_log.last_error('no reason given')}"
            )
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_embd = L.llama_model_n_embd(self.model)
        cparams = L.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = max_prompt_tokens
        cparams.n_seq_max = 1
        cparams.embeddings = True
        cparams.pooling_type = L.LLAMA_POOLING_TYPE_NONE
        threads = n_threads or os.cpu_count() or 1
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise ModelFileError(
                f"llama.cpp could not create a context of {max_prompt_tokens} tokens: {llama_log.last_error('out of memory?')}"
            )
        self.batch = L.llama_batch_init(max_prompt_tokens, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens parsed, as the reference's tokenizer(text, add_special_tokens=False)."""
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        raw = text.encode("utf-8")
        capacity = len(raw) + 16
        tokens = (L.llama_token * capacity)()
        n = L.llama_tokenize(self.vocab, raw, len(raw), tokens, capacity, False, True)
        if n < 0:
            raise AssertionError("a byte-level BPE never yields more tokens than bytes")
        return tokens[:n]

    def hidden_states(self, tokens: list[int]) -> np.ndarray:
        """(len(tokens), n_embd) final hidden states of one prompt, in one physical batch."""
        if len(tokens) > self.max_prompt_tokens:
            raise PromptTooLongError(len(tokens), self.max_prompt_tokens)
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        b = self.batch
        for i, token in enumerate(tokens):
            b.token[i] = token
            b.pos[i] = i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = True
        b.n_tokens = len(tokens)
        status = L.llama_decode(self.ctx, b)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}: {llama_log.last_error('see stderr')}")
        pointer = L.llama_get_embeddings(self.ctx)
        return np.ctypeslib.as_array(pointer, shape=(len(tokens), self.n_embd)).copy()

    def close(self) -> None:
        if getattr(self, "ctx", None):
            L.llama_batch_free(self.batch)
            L.llama_free(self.ctx)
            L.llama_model_free(self.model)
            self.ctx = None

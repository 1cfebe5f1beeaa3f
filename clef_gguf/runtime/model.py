"""A loaded Clef model: `load(path).decide(request) -> response`."""

from __future__ import annotations

import threading
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import numpy as np

from ..check.validate import open_validated
from ..errors import PromptTooLongError
from ..llama.backbone import Backbone
from ..llama.defaults import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_STATE_CACHE, DEFAULT_UBATCH
from ..llama.native_head import NativeHead
from .answers import response
from .prompt import EncodedPrompt, encode, parse_request
from .state_cache import Entry, StateCache, entry_bytes, prefix_key, split_at_prefix

# One small decision run at load, on the real weights.
PROBE: dict[str, Any] = {"state": "probe", "questions": {"ok": {"type": "noul", "instructions": "Is the file sound?"}}}


class ClefModel:
    def __init__(
        self,
        path: str | Path,
        *,
        n_gpu_layers: int = 0,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        n_threads: int | None = None,
        ubatch: int | None = None,
        state_cache: int = DEFAULT_STATE_CACHE,
    ) -> None:
        self.state_cache = StateCache(state_cache)  # a bad size is refused before anything is loaded
        if ubatch is None:  # the default: ubatches of DEFAULT_UBATCH, or the whole prompt when the limit is smaller
            ubatch = min(DEFAULT_UBATCH, max_prompt_tokens)
        self.ubatch = ubatch
        self.path = Path(path)
        # Every stage registers its undo: a failure at any stage closes what the earlier ones opened.
        with ExitStack() as stack:
            validated = open_validated(self.path)  # header-only `clef-gguf validate`: refuse what it rejects, with its message
            stack.callback(validated.close)
            self.file, d = validated.file, validated.description
            self.description, self.name, self.template = d, d.name, d.template
            self.backbone = Backbone(
                self.file,
                n_gpu_layers=n_gpu_layers,
                max_prompt_tokens=max_prompt_tokens,
                n_threads=n_threads,
                nfc=d.nfc,
                ubatch=ubatch,
            )
            stack.callback(self.backbone.close)
            # The head runs where the backbone runs: on the GPU when layers are offloaded.
            self.head = NativeHead(self.path, d.head, norm_eps=d.head_norm_eps, gpu=n_gpu_layers != 0, n_threads=n_threads)
            stack.callback(self.head.close)
            self._lock = threading.Lock()
            # Weights that parse but overflow or hold NaN: refused now, not on every request. A context too
            # small for the probe leaves the check to the first request.
            with suppress(PromptTooLongError):
                self.decide(PROBE)
            self._resources = stack.pop_all()

    @property
    def max_prompt_tokens(self) -> int:
        return self.backbone.max_prompt_tokens

    def encode(self, request: dict[str, Any]) -> EncodedPrompt:
        """Validate and tokenize a request (no compute). Raises RequestError."""
        return encode(parse_request(request), self.template, self.backbone.tokenize)

    def decide(self, request: dict[str, Any] | EncodedPrompt) -> dict[str, Any]:
        """Answer a SystemOne request body (or one already encoded by `encode`) with the SystemOne response body."""
        prompt = request if isinstance(request, EncodedPrompt) else self.encode(request)
        with self._lock:
            hidden, reused = self._hidden_states(prompt)  # raises PromptTooLongError before compute
            logits = self.head(hidden, prompt)
        return response(prompt, self.name, logits, cached_tokens=reused)

    def _hidden_states(self, prompt: EncodedPrompt) -> tuple[np.ndarray, int]:
        """Every token's final hidden state, and how many tokens of them the state cache gave."""
        tokens, n = prompt.tokens, prompt.state_prefix
        if not split_at_prefix(n, len(tokens)):
            # A view of llama.cpp's output buffer, valid until the next decode: the head reads it under the same lock.
            return self.backbone.hidden_states(tokens, copy=False), 0
        if len(tokens) > self.max_prompt_tokens:
            raise PromptTooLongError(len(tokens), self.max_prompt_tokens)
        key = prefix_key(tokens[:n])
        entry = self.state_cache.get(key)
        if entry is not None:
            self.backbone.restore_sequence(entry.sequence)
            prefix, reused = entry.hidden, n
        else:
            # The prefix in a decode of its own (cache on or off: split_at_prefix), so that the recurrent
            # state saved is the state right after it.
            self.backbone.clear()
            prefix, reused = self.backbone.decode(tokens[:n]).copy(), 0  # the next decode overwrites the view
            if self.state_cache.admits(entry_bytes(key, self.backbone.sequence_size(), prefix.nbytes)):
                self.state_cache.put(key, Entry(self.backbone.save_sequence(), prefix))
        suffix = self.backbone.decode(tokens[n:], start=n)
        return np.concatenate([prefix, suffix]), reused

    def close(self) -> None:
        self.state_cache.clear()  # host memory only: the saved states are of no use without the context
        self._resources.close()  # head, backbone, then the mapping: the reverse of loading

    def __enter__(self) -> ClefModel:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def load(
    path: str | Path,
    n_gpu_layers: int = 0,
    n_ctx: int = DEFAULT_MAX_PROMPT_TOKENS,
    n_threads: int | None = None,
    ubatch: int | None = None,
    state_cache: int = DEFAULT_STATE_CACHE,
) -> ClefModel:
    """Load a Clef GGUF. n_ctx is the largest prompt it will accept (default: Clef's 65,536).

    ubatch: prompts are processed in ubatches of this many tokens, the state carried over,
    so llama.cpp's compute buffer is bounded by the ubatch, not the prompt (default:
    DEFAULT_UBATCH, or n_ctx if smaller); ubatch = n_ctx processes a prompt in one physical batch.
    state_cache: bytes of host memory for the backbone states of recent requests' state prefixes
    (runtime/state_cache.py; default 1 GiB), so that a request repeating a state computes only its
    schema; 0 turns it off. n_threads: default, the physical cores this process may use.
    """
    return ClefModel(
        path,
        n_gpu_layers=n_gpu_layers,
        max_prompt_tokens=n_ctx,
        n_threads=n_threads,
        ubatch=ubatch,
        state_cache=state_cache,
    )

"""A loaded Clef model: `load(path).decide(request) -> response`."""

from __future__ import annotations

import threading
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import numpy as np

from ..check.pair import open_vision
from ..check.validate import open_validated
from ..errors import ComputeError, PromptTooLongError
from ..llama.backbone import Backbone, prompt_positions
from ..llama.defaults import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_STATE_CACHE, default_ubatch
from ..llama.mtmd import VisionEncoder
from ..llama.native_head import NativeHead
from .answers import response
from .images import ImageLimits, image_limits
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
        mmproj: str | Path | None = None,
    ) -> None:
        self.state_cache = StateCache(state_cache)  # a bad size is refused before anything is loaded
        self.ubatch = default_ubatch(max_prompt_tokens) if ubatch is None else ubatch
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
                ubatch=self.ubatch,
            )
            stack.callback(self.backbone.close)
            # The head runs where the backbone runs: on the GPU when layers are offloaded.
            self.head = NativeHead(self.path, d.head, norm_eps=d.head_norm_eps, gpu=n_gpu_layers != 0, n_threads=n_threads)
            stack.callback(self.head.close)
            self.vision: VisionEncoder | None = None
            self.image_limits: ImageLimits | None = None
            if mmproj is not None:
                self.vision, self.image_limits = self._load_vision(Path(mmproj), n_gpu_layers != 0, n_threads)
                stack.callback(self.vision.close)
            self._lock = threading.Lock()
            # Weights that parse but overflow or hold NaN: refused now, not on every request. A context too
            # small for the probe leaves the check to the first request.
            with suppress(PromptTooLongError):
                self.decide(PROBE)
            self._resources = stack.pop_all()

    @property
    def max_prompt_tokens(self) -> int:
        return self.backbone.max_prompt_tokens

    def _load_vision(self, mmproj: Path, gpu: bool, n_threads: int | None) -> tuple[VisionEncoder, ImageLimits]:
        """The vision tower, validated and paired with this model, in libmtmd over the lean backbone."""
        limits = image_limits(open_vision(self.file.header, mmproj))
        per_token = limits.factor**2
        # mtmd's own token limits around the runtime's: it then takes every image runtime/images.py sized unresized.
        tokens = (max(1, limits.min_pixels // per_token), -(-limits.max_pixels // per_token))
        encoder = VisionEncoder(
            mmproj, self.backbone.model, n_threads=n_threads, use_gpu=gpu, min_tokens=tokens[0], max_tokens=tokens[1]
        )
        return encoder, limits

    def encode(self, request: dict[str, Any]) -> EncodedPrompt:
        """Validate, tokenize and (images) decode and size a request; no compute. Raises RequestError."""
        return encode(parse_request(request, self.image_limits), self.template, self.backbone.tokenize)

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
        images = [(p.start, p.image.nx, p.image.ny) for p in prompt.images]
        if len(tokens) > self.max_prompt_tokens:  # (an image takes fewer positions than tokens)
            raise PromptTooLongError(len(tokens), self.max_prompt_tokens)
        positions = prompt_positions(len(tokens), images)
        if not split_at_prefix(n, len(tokens)):
            self.backbone.clear()
            # A view of llama.cpp's output buffer, valid until the next decode: the head reads it under the same lock.
            return self.backbone.decode_embeddings(self._embeddings(prompt, 0, len(tokens)), positions), 0
        key = prefix_key(tokens[:n], [p.image.digest for p in prompt.images])
        entry = self.state_cache.get(key)
        if entry is not None:
            self.backbone.restore_sequence(entry.sequence)
            prefix, reused = entry.hidden, n
        else:
            # The prefix in a decode of its own (cache on or off: split_at_prefix), so that the recurrent
            # state saved is the state right after it.
            self.backbone.clear()
            prefix = self.backbone.decode_embeddings(self._embeddings(prompt, 0, n), positions[:, :n]).copy()
            reused = 0  # (the next decode overwrites the view)
            if self.state_cache.admits(entry_bytes(key, self.backbone.sequence_size(), prefix.nbytes)):
                self.state_cache.put(key, Entry(self.backbone.save_sequence(), prefix))
        suffix = self.backbone.decode_embeddings(self._embeddings(prompt, n, len(tokens)), positions[:, n:])
        return np.concatenate([prefix, suffix]), reused

    def _embeddings(self, prompt: EncodedPrompt, start: int, end: int) -> np.ndarray:
        """The input embeddings of tokens[start:end]: token rows, and the vision tower's for image tokens."""
        embeddings = self.backbone.embeddings(prompt.tokens[start:end])
        for placed in prompt.images:
            first, last = placed.start, placed.start + placed.image.n_tokens
            if first >= end or last <= start:
                continue
            if first < start or last > end:
                raise ComputeError("an image straddles the state prefix: the template placed it inside the state")
            assert self.vision is not None  # encode refuses images without it
            encoded = self.vision.encode(placed.image.pixels)
            if (encoded.nx, encoded.ny) != (placed.image.nx, placed.image.ny):
                raise ComputeError(
                    f"mtmd encoded a {placed.image.nx} x {placed.image.ny}-token image as {encoded.nx} x {encoded.ny} tokens"
                )
            embeddings[first - start : last - start] = encoded.embeddings
        return embeddings

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
    mmproj: str | Path | None = None,
) -> ClefModel:
    """Load a Clef GGUF. n_ctx is the largest prompt it will accept (default: Clef's 65,536).

    ubatch: prompts are processed in ubatches of this many tokens, the state carried over,
    so llama.cpp's compute buffer is bounded by the ubatch, not the prompt (default:
    DEFAULT_UBATCH, or n_ctx if smaller); ubatch = n_ctx processes a prompt in one physical batch.
    state_cache: bytes of host memory for the backbone states of recent requests' state prefixes
    (runtime/state_cache.py; default 1 GiB), so that a request repeating a state computes only its
    schema; 0 turns it off. n_threads: default, the physical cores this process may use.
    mmproj: the vision tower (llama.cpp's mmproj GGUF, which `clef-gguf convert` writes beside the
    model), so that requests may carry up to 4 images (runtime/images.py); without it they are refused.
    """
    return ClefModel(
        path,
        n_gpu_layers=n_gpu_layers,
        max_prompt_tokens=n_ctx,
        n_threads=n_threads,
        ubatch=ubatch,
        state_cache=state_cache,
        mmproj=mmproj,
    )

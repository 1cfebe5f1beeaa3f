"""A loaded Clef model: `load(path).decide(request) -> response`."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ..check.validate import open_validated
from ..errors import ModelFileError, PromptTooLongError
from ..format import contract as C
from ..format.header import GGUFFile
from ..format.template import PromptTemplate
from ..llama.backbone import Backbone
from ..llama.native_head import NativeHead
from .answers import response
from .defaults import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_UBATCH
from .prompt import EncodedPrompt, encode, parse_request

# One small decision run at load, on the real weights.
PROBE: dict[str, Any] = {"state": "probe", "questions": {"ok": {"type": "noul", "instructions": "Is the file sound?"}}}


def _decision_metadata(f: GGUFFile) -> tuple[C.HeadConfig, PromptTemplate]:
    h = f.header
    if h.get("general.architecture") != C.ARCH or h.get(C.KEY_DECISION_TYPE) != C.DECISION_TYPE:
        raise ModelFileError(
            f"{f.path.name} is not a Clef decision model (architecture {h.get('general.architecture')!r}, "
            f"{C.KEY_DECISION_TYPE} {h.get(C.KEY_DECISION_TYPE)!r}); run `clef-gguf validate` on it"
        )
    try:
        config = C.read_head_config(h)
        template = PromptTemplate(str(h.fields[C.KEY_TEMPLATE].value))
    except (KeyError, TypeError) as e:
        raise ModelFileError(f"{f.path.name}: incomplete Clef metadata ({e}); run `clef-gguf validate` on it") from e
    return config, template


class ClefModel:
    def __init__(
        self,
        path: str | Path,
        *,
        n_gpu_layers: int = 0,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        n_threads: int | None = None,
        ubatch: int | None = None,
    ) -> None:
        if ubatch is None:  # the default: ubatches of DEFAULT_UBATCH, or the whole prompt when the limit is smaller
            ubatch = min(DEFAULT_UBATCH, max_prompt_tokens)
        self.ubatch = ubatch
        self.path = Path(path)
        self.file = open_validated(self.path)  # header-only `clef-gguf validate`: refuse what it rejects, with its message
        config, self.template = _decision_metadata(self.file)
        self.name = str(self.file.header.get("general.name") or self.path.stem)
        # Qwen's tokenizer.json normalizes to NFC, which llama.cpp's tokenizer does not apply: the runtime does,
        # unless the file says its tokenizer has no normalizer (llama.cpp's converter writes no such key).
        nfc = self.file.header.get(C.KEY_NORMALIZER, "NFC") == "NFC"
        self.backbone = Backbone(
            self.file, n_gpu_layers=n_gpu_layers, max_prompt_tokens=max_prompt_tokens, n_threads=n_threads, nfc=nfc, ubatch=ubatch
        )
        try:
            # The head runs where the backbone runs: on the GPU when layers are offloaded.
            norm_eps = float(self.file.header.get(C.KEY_HEAD_NORM_EPS, C.HEAD_NORM_EPS))
            self.head = NativeHead(self.path, config, norm_eps=norm_eps, gpu=n_gpu_layers != 0, n_threads=n_threads)
        except Exception:
            self.backbone.close()
            raise
        self._lock = threading.Lock()
        try:
            self.decide(PROBE)  # weights that parse but overflow or hold NaN: refused now, not on every request
        except PromptTooLongError:
            pass  # a context too small for the probe: the first request checks instead
        except Exception:
            self.close()
            raise

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
            # A view of llama.cpp's output buffer, valid until the next decode: the head reads it under the same lock.
            hidden = self.backbone.hidden_states(prompt.tokens, copy=False)  # raises PromptTooLongError before compute
            logits = self.head(hidden, prompt)
        return response(prompt, self.name, logits)

    def close(self) -> None:
        self.head.close()
        self.backbone.close()
        self.file.close()

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
) -> ClefModel:
    """Load a Clef GGUF. n_ctx is the largest prompt it will accept (default: Clef's 65,536).

    ubatch: prompts are processed in ubatches of this many tokens, the state carried over,
    so llama.cpp's compute buffer is bounded by the ubatch, not the prompt (default:
    DEFAULT_UBATCH, or n_ctx if smaller); ubatch = n_ctx processes a prompt in one physical batch.
    """
    return ClefModel(path, n_gpu_layers=n_gpu_layers, max_prompt_tokens=n_ctx, n_threads=n_threads, ubatch=ubatch)

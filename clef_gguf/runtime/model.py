"""A loaded Clef model: `load(path).decide(request) -> response`."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .. import contract as C
from ..errors import ModelFileError
from ..gguf_header import GGUFFile
from ..validate import open_validated
from .answers import response
from .backbone import Backbone
from .head import JointSchemaHead
from .prompt import EncodedPrompt, encode, parse_request

DEFAULT_MAX_PROMPT_TOKENS = 4096


def _dequantize(f: GGUFFile, name: str) -> np.ndarray:
    t = f.header.tensors[name]
    return (
        gguf.quants.dequantize(f.tensor_bytes(name), t.type).reshape(t.shape).astype(np.float32)
    )  # a copy: the map closes later


def _decision_metadata(f: GGUFFile) -> tuple[C.HeadConfig, dict[str, str]]:
    h = f.header
    if h.get("general.architecture") != C.ARCH or h.get(C.KEY_DECISION_TYPE) != C.DECISION_TYPE:
        raise ModelFileError(
            f"{f.path.name} is not a Clef decision model (architecture {h.get('general.architecture')!r}, "
            f"no {C.KEY_DECISION_TYPE}); run `clef-gguf validate` on it"
        )
    try:
        config = C.HeadConfig(**{k: int(h.get(C.head_key(k))) for k in C.HEAD_CONFIG_FIELDS})
        template = {k: str(h.fields[C.prompt_key(k)].value) for k in C.PROMPT_TEMPLATE}
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
    ) -> None:
        self.path = Path(path)
        self.file = open_validated(self.path)  # header-only `clef-gguf validate`: refuse what it rejects, with its message
        config, self.template = _decision_metadata(self.file)
        names = C.head_tensor_shapes(config)
        missing = [n for n in names if C.HEAD_PREFIX + n not in self.file.header.tensors]
        if missing:
            raise ModelFileError(
                f"{self.path.name}: {len(missing)} of the {len(names)} head tensors are missing (first: {missing[0]})"
            )
        weights = {n: _dequantize(self.file, C.HEAD_PREFIX + n).reshape(shape) for n, shape in names.items()}
        self.head = JointSchemaHead(config, weights)
        tensors = self.file.header.tensors
        self._output_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        self.name = str(self.file.header.get("general.name") or self.path.stem)
        nfc = self.file.header.get(C.KEY_NORMALIZER) == "NFC"
        self.backbone = Backbone(
            self.file, n_gpu_layers=n_gpu_layers, max_prompt_tokens=max_prompt_tokens, n_threads=n_threads, nfc=nfc
        )
        self._lock = threading.Lock()

    @property
    def max_prompt_tokens(self) -> int:
        return self.backbone.max_prompt_tokens

    def encode(self, request: dict[str, Any]) -> EncodedPrompt:
        """Validate and tokenize a request (no compute). Raises RequestError."""
        return encode(parse_request(request, self.template), self.template, self.backbone.tokenize)

    def _lexical(self, prompt: EncodedPrompt) -> list[np.ndarray]:
        """Mean output-embedding row of each option's tokens (the head's lexical prior)."""
        t = self.file.header.tensors[self._output_name]
        rows = self.file.tensor_bytes(self._output_name).reshape(t.shape[0], -1)
        ids = np.unique([prompt.tokens[i] for q in prompt.questions for s, e in q.option_spans for i in range(s, e)])
        table = dict(zip(ids.tolist(), gguf.quants.dequantize(rows[ids], t.type).astype(np.float32), strict=True))
        return [
            np.stack([np.mean([table[prompt.tokens[i]] for i in range(s, e)], axis=0) for s, e in q.option_spans])
            for q in prompt.questions
        ]

    def decide(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer a SystemOne request body with the SystemOne response body."""
        prompt = self.encode(request)
        with self._lock:
            hidden = self.backbone.hidden_states(prompt.tokens)  # raises PromptTooLongError before compute
        logits = self.head(hidden, prompt, self._lexical(prompt))
        return response(prompt, self.name, logits)

    def close(self) -> None:
        self.backbone.close()
        self.file.close()

    def __enter__(self) -> ClefModel:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def load(
    path: str | Path, n_gpu_layers: int = 0, n_ctx: int = DEFAULT_MAX_PROMPT_TOKENS, n_threads: int | None = None
) -> ClefModel:
    """Load a Clef GGUF. n_ctx is the largest prompt (one physical batch) it will accept."""
    return ClefModel(path, n_gpu_layers=n_gpu_layers, max_prompt_tokens=n_ctx, n_threads=n_threads)

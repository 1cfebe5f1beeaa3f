"""A Clef file's requests validated and tokenized without its weights: ClefModel.encode, nothing else.

Where decisions are made elsewhere (the Ray Serve ingress hands them to model replicas), the front
still refuses every bad request itself, a prompt over the limit included, before any replica is
busy with it: the same validation, template and llama.cpp tokenizer as ClefModel, hence the same
prompts (ClefModel.decide takes them as they are) and the same errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..check.pair import open_vision
from ..check.validate import open_validated
from ..llama.backbone import Vocabulary
from ..settings import LoadOptions, default_ubatch
from .images import image_limits
from .prompt import EncodedPrompt, encode, parse_request


class PromptEncoder:
    """The encoding half of a ClefModel loaded with the same settings; it holds the vocabulary only."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_prompt_tokens: int = LoadOptions.max_prompt_tokens,
        ubatch: int | None = None,
        mmproj: str | Path | None = None,
    ) -> None:
        self.path = Path(path)
        self.max_prompt_tokens = max_prompt_tokens  # the replicas' limit: the front refuses what they would
        self.ubatch = default_ubatch(max_prompt_tokens) if ubatch is None else ubatch
        validated = open_validated(self.path)  # the header check ClefModel runs: the same refusals, the same messages
        try:
            d = validated.description
            self.name, self.template, self.identity = d.name, d.template, validated.file.digest()
            # The replicas' image limits: images are decoded and sized here, the tower runs on a replica.
            self.image_limits = image_limits(open_vision(validated.file.header, mmproj)) if mmproj is not None else None
            self.vocabulary = Vocabulary(validated.file, nfc=d.nfc)  # llama.cpp keeps its own copy: the file can close
        finally:
            validated.close()

    def encode(self, request: dict[str, Any]) -> EncodedPrompt:
        """Validate, tokenize and (images) decode and size a request; no compute. Raises RequestError."""
        return encode(parse_request(request, self.image_limits), self.template, self.vocabulary.tokenize, self.identity)

    def close(self) -> None:
        self.vocabulary.close()

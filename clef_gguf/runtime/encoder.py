"""A Clef file's requests validated and tokenized without its weights: ClefModel.encode, nothing else.

Where decisions are made elsewhere (the Ray Serve ingress hands them to model replicas), the front
still refuses every bad request itself, a prompt over the limit included, before any replica is
busy with it: the same validation, template and llama.cpp tokenizer as ClefModel, hence the same
prompts (ClefModel.decide takes them as they are) and the same errors. With adapters, it resolves a request's model
name as ClefModel does (a Catalog of the same files, runtime/catalog.py): the same identity, the same 422 for a name
it does not know.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..check.pair import open_vision
from ..check.validate import open_validated
from ..llama.backbone import Vocabulary
from ..settings import LoadOptions, default_ubatch
from .catalog import Catalog
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
        adapters: Mapping[str, str | Path] | None = None,
        adapter_dir: str | Path | None = None,
        base_head: bool = False,
    ) -> None:
        self.path = Path(path)
        self.max_prompt_tokens = max_prompt_tokens  # the replicas' limit: the front refuses what they would
        self.ubatch = default_ubatch(max_prompt_tokens) if ubatch is None else ubatch
        validated = open_validated(self.path)  # the header check ClefModel runs: the same refusals, the same messages
        try:
            d = validated.description
            # ClefModel's identity (header and weights): a replica refuses a prompt stamped with anything else.
            self.name, self.template, self.identity = d.name, d.template, validated.file.identity()
            # The replicas' image limits: images are decoded and sized here, the tower runs on a replica.
            self.image_limits = image_limits(open_vision(validated.file.header, mmproj)) if mmproj is not None else None
            self.vocabulary = Vocabulary(validated.file, nfc=d.nfc)  # llama.cpp keeps its own copy: the file can close
        except BaseException:
            validated.close()
            raise
        try:
            # The replicas' Variants' names and identities (an adapter folder's files are checked when first named:
            # the base's file stays mapped for that while there are adapters).
            many = {"adapters": adapters, "adapter_dir": adapter_dir, "base_head": base_head}
            self.catalog = Catalog(validated.file, d, self.identity, **many)
        except BaseException:
            self.vocabulary.close()
            validated.close()
            raise
        self._validated = validated if self.catalog.serves_adapters else None
        if self._validated is None:
            validated.close()

    def encode(self, request: dict[str, Any]) -> EncodedPrompt:
        """Validate, tokenize and (images) decode and size a request; no compute. Raises RequestError."""
        parsed = parse_request(request, self.image_limits)
        return encode(parsed, self.template, self.vocabulary.tokenize, self.catalog.of_request(parsed).identity)

    def adapter_names(self) -> list[str]:
        """The fine-tunes a request may name besides the base (the replicas', loaded with the same settings)."""
        return self.catalog.names()

    def model_name(self, prompt: EncodedPrompt) -> str:
        """The name of the model a prompt was encoded for: the base's or an adapter's."""
        return self.catalog.name_of(prompt) or self.name

    def close(self) -> None:
        self.vocabulary.close()
        self.catalog.close()
        if self._validated is not None:
            self._validated.close()

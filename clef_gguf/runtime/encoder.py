"""The encoding part of a model: requests validated and tokenized with its vocabulary and template, and the model each
names resolved once by its catalog (runtime/catalog.py). It loads no weights and imports no llama.cpp: the tokenizer
is handed to it (a ClefModel's backbone vocabulary, or the Ray ingress's own: runtime/model.py's open_encoder).

Where decisions are made elsewhere (the Ray Serve ingress hands them to model replicas), the front still refuses every
bad request itself, a prompt over the limit included, before any replica is busy with it: the same validation,
template and llama.cpp tokenizer as ClefModel, hence the same prompts (ClefModel.decide takes them as they are) and
the same errors; its catalog, built from the same ModelSpec as the replicas', gives each name the same identity.
"""

from __future__ import annotations

import datetime as dt
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..check.description import ValidatedFile
from ..check.pair import open_vision
from ..check.validate import open_validated
from ..settings import ModelSpec, default_ubatch
from .catalog import Catalog, Listed
from .catalog_sources import parse_source
from .images import image_limits
from .prompt import EncodedPrompt, Tokenize, encode, parse_request
from .relay_source import Relay
from .sources import SourceObserver


class PromptEncoder:
    """A model's vocabulary (`tokenize`), template and catalog, from its validated file and its spec. Thread-safe."""

    def __init__(
        self,
        spec: ModelSpec,
        validated: ValidatedFile,
        tokenize: Tokenize,
        source_observer: SourceObserver | None = None,
        relay: Relay | None = None,
    ) -> None:
        o, d = spec.options, validated.description
        self.path = Path(spec.path)
        self.max_prompt_tokens = o.max_prompt_tokens  # the decider's limit: a front refuses what it would
        self.ubatch = default_ubatch(o.max_prompt_tokens) if o.ubatch is None else o.ubatch
        self.name, self.template, self._tokenize = d.name, d.template, tokenize
        self.owned = ExitStack()  # what close() closes after the catalog: what open_encoder opened for it alone
        # The decider's image limits (its vision tower paired with this file): images are decoded and sized here.
        mmproj = o.mmproj
        self.image_limits = image_limits(open_vision(validated.file.header, mmproj)) if mmproj is not None else None
        # A local file has no release date: the day the version loaded was written is the honest stand-in, taken
        # now from the signature it was read under, never from the path (which may name another version, or none).
        mtime_ns = validated.file.signature[3] if validated.file.signature is not None else 0
        self.written = dt.datetime.fromtimestamp(mtime_ns / 1e9, dt.timezone.utc).date().isoformat()
        # The file's identity (header and weights): a decider refuses a prompt stamped with anything else.
        # (`source_observer`: told of its adapter sources' lookups and fetches, a pin's at start among them; `relay`:
        # where its remote sources' adapters come from instead, relay_source.py)
        self.catalog = Catalog(validated.file, d, validated.file.identity(), spec.adapter_set, source_observer, relay)

    def encode(self, request: dict[str, Any]) -> EncodedPrompt:
        """Validate, tokenize and (images) decode and size a request, its model name resolved; no compute. Raises
        RequestError (AdapterUnavailableError: a named adapter's file is gone or broken now)."""
        parsed = parse_request(request, self.image_limits)
        return encode(parsed, self.template, self._tokenize, self.catalog.resolve(parsed.named, parsed.named_by))

    def adapter_names(self) -> list[str]:
        """The fine-tunes a request may name besides the base (its `model`, Workers AI's `lora`)."""
        return self.catalog.names()

    def adapter_listing(self) -> list[Listed]:
        """Every adapter name a request may try, with its identity or why it is refused (catalog.Catalog.listing)."""
        return self.catalog.listing()

    def close(self) -> None:
        """Drop the catalog's private copies; close what it was opened with alone. A second close does nothing."""
        self.catalog.close()
        self.owned.close()


def check_spec(spec: ModelSpec) -> None:
    """The header checks loading runs, nothing loaded: the model's, the mmproj's with its pairing, and the adapters'
    against the model (the named ones, or the pinned one), as the catalog reads them at load: before a Ray cluster
    starts, a file loading would refuse gets the same message and exit code."""
    validated = open_validated(spec.path)
    try:
        if spec.options.mmproj is not None:
            open_vision(validated.file.header, spec.options.mmproj)
        adapter_set = spec.adapter_set
        if adapter_set.serves_adapters or adapter_set.adapter is not None:
            # (a pin a remote source delivers is fetched where it is served, not here too: the Ray ingress fetches
            # it for the cluster at its start, and a pin that cannot load stops that start)
            remote = [s for s in map(parse_source, adapter_set.adapter_sources or ()) if s.remote]
            pins = [name for name in adapter_set.pins or () if not any(s.claims(name) for s in remote)]
            adapter_set = replace(adapter_set, pins=pins or None)
            Catalog(validated.file, validated.description, validated.file.identity(), adapter_set).close()
    finally:
        validated.close()

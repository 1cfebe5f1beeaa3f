"""The base as the runtime holds it once loaded: one version, pinned (format/pinned.py), as an adapter is one version
in a private copy (runtime/adapter_files.py). Truncating, rewriting, replacing or deleting the file afterwards changes
no answer and no identity, and raises no signal: a new base is served by a new load (docs/serving.md)."""

from __future__ import annotations

from ..check.description import ValidatedFile
from ..check.validate import open_validated
from ..format.adapter import is_fingerprint_tensor
from ..format.contract import is_head_tensor
from ..format.pinned import PinnedFile
from ..llama.native_head import LEXICONS
from ..settings import ModelSpec

TOKEN_EMBD = "token_embd.weight"  # the backbone's input, gathered per request (llama/backbone.py)


def open_pinned(spec: ModelSpec, *, compute: bool = True) -> ValidatedFile:
    """`open_validated(spec.path)`, its file pinned: the norms an adapter is checked against (format/adapter's
    fingerprint); with `compute`, what a decision reads (the token embeddings, the head's lexicon) and, where the spec
    may serve adapters, the base's head (an adapter's head takes the tensors it lacks from it, when first loaded). Its
    mapping of the file closed. ModelFileError if the file changes while it is read."""
    validated = open_validated(spec.path)
    heads = compute and (spec.adapter_set.serves_adapters or spec.adapter_set.adapter is not None)
    try:
        kept = {n for n in validated.file.header.tensors if is_fingerprint_tensor(n) or (heads and is_head_tensor(n))}
        pinned = PinnedFile.pin(validated.file, kept | ({TOKEN_EMBD, *LEXICONS} if compute else set()))
    finally:
        validated.close()
    return ValidatedFile(pinned, validated.description)

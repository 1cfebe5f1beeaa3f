"""What a model is to those who use it: the protocols a model satisfies, beside the model (runtime/model.py's
ClefModel is every one of them).

- The server (server/worker.py, app.py, intake.py): `Prompt`, `Encoder` (runtime/encoder.py's PromptEncoder is one
  too: the Ray ingress's), `Model`, with its `Steps` (runtime/decider.py's PromptSteps: a long prompt decided in steps).
- The dataset mode: `DecidingModel` (runtime/dataset.py's decide_many) and `FileModel` (dataset_file.py's decide_file,
  which records and checks the model's identity).

Every one of them is answered by the one answer path, `answer_batch` (runtime/decider.py's Decider.decide).

Only annotations name the concrete types, so importing this module loads neither llama.cpp nor the tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .answers import Answer
    from .catalog import Listed
    from .prompt import EncodedPrompt
    from .state_cache import StateCache


class Prompt(Protocol):
    """What the server reads of an encoded prompt (runtime.prompt.EncodedPrompt): for its metrics and log line."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def images(self) -> Sequence[object]: ...

    @property
    def state_prefix(self) -> int: ...  # tokens up to and including the state

    @property
    def preamble(self) -> int: ...  # tokens before the request's own

    @property
    def identity(self) -> str: ...  # the identity of the model it was encoded for: the base's or an adapter's

    @property
    def model_name(self) -> str: ...  # that model's name, as its answer gives it (the metrics' label)

    @property
    def named_by(self) -> str: ...  # the request's field that named the model (prompt.Request.named_by): where a 422 points


class Encoder(Protocol):
    """What the server's app and its intake use of a ClefModel: a runtime.encoder.PromptEncoder is one too."""

    name: str
    path: Path
    written: str  # the day the base version loaded was written (ISO date): its release date in /v1/models
    ubatch: int  # tokens per physical batch of the prefill
    image_limits: object | None  # None: no vision tower loaded, requests with images are refused

    @property
    def max_prompt_tokens(self) -> int: ...

    def encode(self, request: dict[str, Any]) -> Prompt: ...  # validate and tokenize, no compute; thread-safe

    def adapter_names(self) -> list[str]: ...  # the fine-tunes a request may name besides the base

    def adapter_listing(self) -> list[Listed]: ...  # every name a request may try: its identity, or why it is refused

    def close(self) -> None: ...


class Steps(Protocol):
    """A prompt decided in steps (runtime/decider.py's PromptSteps)."""

    def step(self) -> Answer | Exception | None: ...  # one ubatch; then its answer (or its error)

    def finish(self) -> None: ...  # give its sequence back, answered or not


@runtime_checkable
class Model(Encoder, Protocol):
    """What the server uses of a ClefModel that decides in this process: batches, and a long prompt a ubatch at a
    time with the batches waiting decided between its steps."""

    def batchable(self, prompts: Sequence[Prompt]) -> bool: ...  # whether answer_batch takes them together

    def answer_batch(self, prompts: Sequence[Prompt]) -> Sequence[Answer | Exception]: ...  # one each, in order

    def submit(self, fn: Callable[[], None]) -> Future[None]: ...  # fn on the model's compute thread, not waited for

    def stepped(self, prompt: Prompt) -> bool: ...  # whether this prompt is decided in steps

    def begin(self, prompt: Prompt) -> Steps: ...  # on the compute thread; batchable then admits what fits beside it

    def resident_adapters(self) -> frozenset[str]: ...  # the adapter versions loaded now, by identity; any thread


class DecidingModel(Protocol):
    """What deciding many requests (runtime/dataset.py) needs of a model."""

    state_cache: StateCache

    @property
    def parallel(self) -> int: ...

    @property
    def max_prompt_tokens(self) -> int: ...

    def encode(self, request: dict[str, Any]) -> EncodedPrompt: ...

    def batchable(self, prompts: Sequence[EncodedPrompt]) -> bool: ...

    def answer_batch(self, prompts: Sequence[EncodedPrompt]) -> Sequence[Answer | Exception]: ...


class FileModel(DecidingModel, Protocol):
    """What deciding a file of requests into a file of answers (runtime/dataset_file.py) needs of a model."""

    identity: str  # the model file's identity (GGUFFile.identity): what model_sha256 records
    header_digest: str  # its header's SHA-256 (GGUFFile.digest): the model_sha256 of an older clef-gguf's answers

"""Typed errors of clef-gguf.

The library raises these; the CLI maps them to exit codes and the server to HTTP
statuses, once, at the edge. Each message is one line a person can act on.
"""

from __future__ import annotations


class ClefError(Exception):
    """Base class of every error clef-gguf raises on purpose."""

    exit_code = 1


class ReleaseError(ClefError):
    """The source is not a usable Clef release (missing file, unknown layout, offline)."""

    exit_code = 3


class ConversionError(ClefError):
    """Conversion could not finish (unsupported shapes, disk); a refused output is an OutputError."""

    exit_code = 4


class ModelFileError(ClefError):
    """A GGUF file is not a complete Clef decision model, or llama.cpp refused it."""

    exit_code = 5


class CorruptModelError(ModelFileError):
    """The file cannot be read as GGUF: unreadable, truncated, bad offsets, or damaged data."""

    exit_code = 5


class NotADecisionModelError(ModelFileError):
    """A readable GGUF that is no Clef decision model (e.g. a backbone-only qwen35 conversion)."""

    exit_code = 6


class IncompleteModelError(ModelFileError):
    """A Clef file with missing or mismatched parts: head, backbone, tokenizer or metadata."""

    exit_code = 7


class AdapterBaseError(IncompleteModelError):
    """An adapter file and a base that do not belong together: trained over another base, or shapes that differ."""


class AdapterUnavailableError(ClefError):
    """A request's adapter cannot be used now, though its name is served: its file vanished, shrank, changed while
    the request waited, or no longer validates. Another request may find it again (a file being replaced): the
    server answers 503 with Retry-After, not 500; the CLI exits 7."""

    exit_code = 7


class NonFiniteWeightsError(CorruptModelError):
    """A tensor about to be written, or a head read, holds NaN or Inf values (a diverged fine-tune, a bad
    lora_alpha, or a value beyond the range of the type it is stored in): no such file is written."""


class ModelOutputError(CorruptModelError):
    """The model's scores are not finite (NaN or Inf): weights that overflow, or are NaN, in a file that parses."""


class ComputeError(ClefError):
    """llama.cpp or the native head failed while computing a decision (a device error, memory, a broken invariant)."""

    exit_code = 1


class SettingsError(ClefError, ValueError):
    """Load settings that cannot work (a prompt limit or ubatch out of range)."""

    exit_code = 2


class DeploymentError(ClefError):
    """A Ray Serve application could not be deployed: a replica failed to start (its reason in the message)."""


class RequestError(ClefError):
    """A decision request is invalid. `field` names where, e.g. questions.q1.criteria."""

    exit_code = 2

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = message

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:
        # Rebuilt from its parts, not its formatted message, when it crosses processes (a Ray Serve replica's).
        return type(self), (self.reason, self.field)


class RequestJsonError(RequestError):
    """A request that is not strict JSON text. `path` holds the keys and indexes of the value at fault (its
    field), `offset` where in the text a syntax error is; `kind` names the failure for an HTTP 422
    (json_invalid, or string_unicode for a lone surrogate)."""

    def __init__(
        self, message: str, path: tuple[str | int, ...] = (), *, offset: int | None = None, kind: str = "json_invalid"
    ) -> None:
        super().__init__(message, ".".join(str(part) for part in path) or None)
        self.path = path
        self.offset = offset
        self.kind = kind

    def __reduce__(self) -> tuple[type, tuple[str, tuple[str | int, ...]], dict[str, object]]:  # type: ignore[override]
        return type(self), (self.reason, self.path), {"offset": self.offset, "kind": self.kind}


class PromptTooLongError(RequestError):
    """The prompt needs more tokens than the context was sized for."""

    def __init__(self, n_tokens: int, limit: int) -> None:
        super().__init__(
            f"the prompt has {n_tokens} tokens but this model was loaded with a limit of "
            f"{limit} tokens (its context); shorten the state or load the model with a larger "
            f"context (max_prompt_tokens, --max-prompt-tokens / --ctx), at the cost of a larger KV cache"
        )
        self.n_tokens = n_tokens
        self.limit = limit

    def __reduce__(self) -> tuple[type, tuple[int, int]]:  # type: ignore[override]
        return type(self), (self.n_tokens, self.limit)


class AnswersFileError(ClefError):
    """`clef-gguf decide`'s answers file cannot be continued: it exists (without --resume), holds answers to
    another input, or is damaged before its last line."""

    exit_code = 2


class OutputError(ClefError):
    """An output could not be written, or is refused before any work (clef_gguf/outputs.py): it exists without
    --force, is one of the inputs, is not a regular file, its folder is missing or read-only; the disk is full."""

    exit_code = 9


class ModelClosedError(ClefError):
    """A closed ClefModel was asked to encode or decide: its memory is freed; load the file again."""

    exit_code = 1


class BackendUnavailableError(ClefError, ImportError):
    """llama-cpp-python's libraries cannot load on this machine (a CUDA build without NVIDIA's driver, say)."""

    exit_code = 1

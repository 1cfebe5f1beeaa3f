"""A loaded Clef model: `load(path).decide(request) -> response`."""

from __future__ import annotations

import inspect
import io
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from PIL import Image

from ..errors import ComputeError, ModelClosedError, PromptTooLongError
from ..llama.backbone import Vocabulary
from ..settings import AdapterSet, LoadOptions, ModelSpec
from .answers import Answer, Scores
from .base_file import open_pinned
from .catalog import Listed
from .dataset import decide_many
from .decider import Decider, PromptSteps, load_backbone
from .encoder import PromptEncoder
from .loaded import AdapterObserver
from .prompt import EncodedPrompt
from .relay_source import Relay
from .sources import SourceObserver
from .state_cache import StateCache

T = TypeVar("T")

# One small decision run at load, on the real weights.
PROBE: dict[str, Any] = {"state": "probe", "questions": {"ok": {"type": "noul", "instructions": "Is the file sound?"}}}


def _probe(vision: bool) -> dict[str, Any]:
    """PROBE, and with a vision tower one small image too: a tower that cannot answer (NaN weights, a
    normalization that overflows) is refused at load, not on every request with an image."""
    if not vision:
        return PROBE
    png = io.BytesIO()
    Image.new("RGB", (64, 64), (128, 96, 64)).save(png, "PNG")
    return PROBE | {"images": [png.getvalue()]}


class ClefModel:
    """A loaded Clef GGUF: `clef_gguf.load(path, ...)` validates the file, loads it as its ModelSpec says (settings.py:
    LoadOptions, the fine-tunes' AdapterSet) and runs one probe decision. It keeps the spec, the compute thread and the
    lifecycle (calls in progress, close) over two parts with one job each: the encoder (runtime/encoder.py: the
    vocabulary, the template and the catalog of the models it answers as; no weights) and the decider
    (runtime/decider.py: a batch's way from prompts to answers, the loaded adapters, the prompt decided in steps). A
    request's model name is resolved once, by the encoder, into its prompt (EncodedPrompt.model). `observer` is told
    when an adapter is loaded, evicted or retired (runtime/loaded.py's AdapterObserver); `source_observer`, of its adapter
    sources' disk-cache lookups, fetches and conversions (runtime/sources.py's SourceObserver), a pin's at load included;
    `relay`, where its remote sources' adapters come from instead of the sources (runtime/relay_source.py).
    """

    def __init__(
        self,
        spec: ModelSpec,
        observer: AdapterObserver | None = None,
        source_observer: SourceObserver | None = None,
        relay: Relay | None = None,
    ) -> None:
        self.spec, self._observer, self._source_observer, self._relay = spec, observer, source_observer, relay
        self.state_cache = StateCache(spec.options.state_cache)  # a bad size is refused before anything is loaded
        self.path = Path(spec.path)
        self._closed = False
        self._busy = threading.Condition()  # guards _closed and _active
        self._active = 0  # API calls in progress: close() frees the model only once none is
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-compute", initializer=self._mark)
        try:
            self.compute(self._load)
        except BaseException:
            self._compute.shutdown()
            raise

    def _mark(self) -> None:
        self._compute_thread = threading.get_ident()

    def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the model's compute thread, where all of its llama.cpp computation runs (one at a time).

        Why one thread: llama.cpp's CPU backend is built with OpenMP (llama-cpp-python's, libgomp), and each
        thread that computes a graph owns a team of libgomp threads for the life of the thread. With two such
        teams alive (the load's probe on the caller's thread, then decisions on a server's worker thread)
        libgomp manages more threads than there are CPUs and stops spinning at barriers: every ggml barrier
        (one per graph node) sleeps and is woken: the head takes 2.3 to 2.6 times as long (docs/benchmarks.md,
        "One compute thread").
        """
        if threading.get_ident() == getattr(self, "_compute_thread", None):
            return fn(*args)
        return self._compute.submit(fn, *args).result()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """fn(*args) queued on the compute thread, not waited for: the server's worker drains its queue there."""
        return self._compute.submit(fn, *args)

    def _load(self) -> None:
        # Every stage registers its undo: a failure at any stage closes what the earlier ones opened.
        with ExitStack() as stack:
            validated = open_pinned(self.spec)  # header-only `clef-gguf validate` (its refusals), then one version pinned
            stack.callback(validated.close)
            self.file, self.description = validated.file, validated.description
            self.header_digest = self.file.digest()  # an older clef-gguf's model_sha256
            self.backbone = load_backbone(self.spec, validated)
            stack.callback(self.backbone.close)
            self.encoder = PromptEncoder(self.spec, validated, self.backbone.tokenize, self._source_observer, self._relay)
            stack.callback(self.encoder.close)
            self.catalog, self.written = self.encoder.catalog, self.encoder.written
            self.decider = Decider(
                self.spec, validated, self.backbone, self.catalog, self.encoder.image_limits, self.state_cache, self._observer
            )
            stack.callback(self.decider.close)
            # One fine-tune answers everything (decide --adapter): its identity and name are the model's.
            answering = self.catalog.pinned or self.catalog.base
            self.identity, self.name, self.template = answering.identity, answering.name, self.description.template
            self.head, self.vision, self.image_limits = self.decider.head, self.decider.vision, self.encoder.image_limits
            # Weights that parse but overflow or hold NaN: refused now, not on every request. A context too
            # small for the probe leaves the check to the first request.
            with suppress(PromptTooLongError):
                self.decide(_probe(self.vision is not None))
            self._resources = stack.pop_all()

    @property
    def max_prompt_tokens(self) -> int:
        return self.backbone.max_prompt_tokens

    @property
    def parallel(self) -> int:
        return self.backbone.parallel

    @property
    def ubatch(self) -> int:
        return self.backbone.ubatch

    def adapter_names(self) -> list[str]:
        """The fine-tunes a request may name (its `model`, Workers AI's `lora`) besides the base."""
        return self.encoder.adapter_names()

    def adapter_listing(self) -> list[Listed]:
        """Every adapter name a request may try, with its identity or why it is refused (catalog.Catalog.listing)."""
        return self.encoder.adapter_listing()

    def resident_adapters(self) -> frozenset[str]:
        """The identities of the adapter versions loaded now (any thread)."""
        return self.decider.adapters.identities

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise ModelClosedError(f"{self.path.name}: the model is closed; load the file again to decide")

    @contextmanager
    def _in_use(self) -> Iterator[None]:
        """An API call on the open model: refused once close() has begun; close() waits for it to end."""
        with self._busy:
            self._refuse_if_closed()
            self._active += 1
        try:
            yield
        finally:
            with self._busy:
                self._active -= 1
                self._busy.notify_all()

    def encode(self, request: dict[str, Any]) -> EncodedPrompt:
        """Validate, tokenize and (images) decode and size a request, its model name resolved once (the base, or one
        of its adapters); no compute. Raises RequestError."""
        with self._in_use():
            return self.encoder.encode(request)

    def decide(self, request: dict[str, Any] | EncodedPrompt) -> dict[str, Any]:
        """Answer a SystemOne request body (or one already encoded by `encode`) with the SystemOne response body."""
        prompt = request if isinstance(request, EncodedPrompt) else self.encode(request)
        [answer] = self.answer_batch([prompt])
        if isinstance(answer, Exception):
            raise answer
        return answer.body

    def decide_many(
        self, requests: Iterable[Any], *, sort_by_state: bool = False, base: Path | None = None
    ) -> Iterator[dict[str, Any]]:
        """Decide many requests, in batches and through the state cache: for each, in order, its response body or
        {"error": {"status", "detail"}}, the server's error for it (runtime/dataset.py)."""
        self._refuse_if_closed()  # here, not at the first answer (each of its calls checks again)
        return decide_many(self, requests, sort_by_state=sort_by_state, base=base)

    def batchable(self, prompts: Sequence[EncodedPrompt]) -> bool:
        """Whether these prompts may be decided together (Decider.batchable): at most `parallel` of them, one model's,
        whose tokens fit one ubatch."""
        return self.decider.batchable(prompts)

    def stepped(self, prompt: EncodedPrompt) -> bool:
        """Whether a server decides this prompt in steps (begin): one longer than a ubatch, with parallel > 1."""
        return self.decider.stepped(prompt)

    def begin(self, prompt: EncodedPrompt) -> PromptSteps:
        """Start deciding a prompt a ubatch at a time (runtime/decider.py): step() the result until it answers.

        Until then it holds the context's last sequence, and `batchable` admits only batches that fit beside it.
        One prompt at a time is decided in steps; each step is an API call (refused once the model is closed)."""
        with self._in_use():
            return self.compute(self.decider.begin, self.decider.check(prompt), self._call)

    def _call(self, fn: Callable[[], T]) -> T:
        with self._in_use():
            return self.compute(fn)

    def answer_batch(self, prompts: Sequence[EncodedPrompt]) -> list[Answer | Exception]:
        """Answer encoded prompts that are `batchable`, their backbone prefills in the same llama_decode calls: one
        Answer (its response body and its scores) or the exception that prompt raised (PromptTooLongError,
        ComputeError, ...) per prompt, in order. The one way to answers: every other call and mode takes it."""
        with self._in_use():
            prompts = [self.decider.check(prompt) for prompt in prompts]
            if not self.decider.batchable(prompts):
                tokens = sum(len(p.tokens) for p in prompts)
                raise ComputeError(f"{len(prompts)} prompts of {tokens} tokens in all cannot be decided together")
            return self.compute(self.decider.decide, prompts)

    def decide_batch(self, prompts: Sequence[EncodedPrompt]) -> list[dict[str, Any] | Exception]:
        """answer_batch's response bodies (or exceptions)."""
        return [a if isinstance(a, Exception) else a.body for a in self.answer_batch(prompts)]

    def score_batch(self, prompts: Sequence[EncodedPrompt]) -> list[Scores | Exception]:
        """answer_batch's decisions before rounding: each prompt's Scores (or its exception), in order."""
        return [a if isinstance(a, Exception) else a.scores for a in self.answer_batch(prompts)]

    def close(self) -> None:
        """Free the model once the calls in progress have ended; later calls raise ModelClosedError. A second close
        does nothing."""
        with self._busy:
            if self._closed:
                return
            self._closed = True
            self._busy.wait_for(lambda: self._active == 0)
        self.state_cache.clear()  # host memory only: the saved states are of no use without the context
        self.compute(self._resources.close)  # the decider's, the catalog's, the backbone, the mapping: loading reversed
        self._compute.shutdown()

    def __enter__(self) -> ClefModel:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def load(path: str | Path, **keywords: Any) -> ClefModel:
    """`clef_gguf.load(path, ...)`: the model at `path`, loaded with load()'s keywords, each a setting of LoadOptions
    (n_gpu_layers, max_prompt_tokens, ubatch, parallel, n_threads, state_cache, mmproj) or of AdapterSet (adapters,
    adapter_dir, max_adapters, adapter_memory, base_head, adapter: settings.py says what each does)."""
    return ClefModel(ModelSpec.of(path, **keywords))


# help(load), an editor and the README's test see every keyword with its default, each declared once in settings.py.
load.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("path", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="str | Path")]
    + [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for table in (LoadOptions, AdapterSet)
        for f in fields(table)
    ],
    return_annotation="ClefModel",
)


def open_encoder(spec: ModelSpec, source_observer: SourceObserver | None = None) -> PromptEncoder:
    """The encoding part of the model `spec` declares, alone, with llama.cpp's tokenizer and no weights: the Ray
    ingress encodes what its replicas decide. Its base is pinned (runtime/base_file.py): a folder's adapters are
    checked against the version loaded when first named."""
    with ExitStack() as stack:
        validated = open_pinned(spec, compute=False)  # ClefModel's header check: the same refusals and messages
        stack.callback(validated.close)
        vocabulary = Vocabulary(validated.file, nfc=validated.description.nfc)  # llama.cpp keeps its own copy
        stack.callback(vocabulary.close)
        encoder = PromptEncoder(spec, validated, vocabulary.tokenize, source_observer)
        encoder.owned = stack.pop_all()
    return encoder

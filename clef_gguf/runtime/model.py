"""A loaded Clef model: `load(path).decide(request) -> response`."""

from __future__ import annotations

import inspect
import io
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from PIL import Image

from ..errors import ComputeError, ModelClosedError, ModelOutputError, PromptTooLongError, RequestError
from ..format.temperatures import temperature_of
from ..llama.backbone import Vocabulary
from ..llama.native_head import NativeHead
from ..settings import AdapterSet, LoadOptions, ModelSpec
from .answers import Scores, question_probabilities, response
from .base_file import open_pinned
from .dataset import decide_many
from .decider import Decider, load_backbone
from .encoder import PromptEncoder
from .prefill import Prefill
from .prompt import EncodedPrompt
from .state_cache import StateCache
from .steps import PromptSteps

T = TypeVar("T")
Hidden = tuple[np.ndarray, int]  # a prompt's final hidden states, and the tokens of them the state cache gave

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
    LoadOptions, the fine-tunes' AdapterSet) and runs one probe decision. Two parts with one job each: the encoder
    (runtime/encoder.py: the vocabulary, the template and the catalog of the models it answers as; no weights) and the
    decider (runtime/decider.py: the backbone, the heads, the vision tower and the LRU of loaded adapters), on one
    compute thread. A request's model name is resolved once, by the encoder, into its prompt (EncodedPrompt.model).
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.state_cache = StateCache(spec.options.state_cache)  # a bad size is refused before anything is loaded
        self.path = Path(spec.path)
        self._closed = False
        self._busy = threading.Condition()  # guards _closed and _active
        self._active = 0  # API calls in progress: close() frees the model only once none is
        self._stepping: PromptSteps | None = None  # the prompt prefilled in steps now (begin), on the last sequence
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
            self.encoder = PromptEncoder(self.spec, validated, self.backbone.tokenize)
            stack.callback(self.encoder.close)
            self.catalog = self.encoder.catalog
            self.decider = Decider(self.spec, validated, self.backbone, self.catalog, self.encoder.image_limits)
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

    def _check(self, prompt: Any) -> EncodedPrompt:
        """The prompt, its model this model's own (one encoded elsewhere, as by the Ray ingress, is looked up by its
        identity); refused if another file's (its tokens would index other rows) or forged."""
        if not isinstance(prompt, EncodedPrompt):
            raise RequestError(f"a prompt is what model.encode(request) returns, not a {type(prompt).__name__}")
        model = self.catalog.adopt(prompt.model) if prompt.model is not None else None
        if model is None:
            raise RequestError("this prompt was encoded by another model (another file): encode it with this model")
        tokens, n_vocab = np.asarray(prompt.tokens), self.backbone.token_embd.n_rows
        if tokens.ndim != 1 or (tokens.size and (tokens.dtype.kind != "i" or tokens.min() < 0 or tokens.max() >= n_vocab)):
            raise RequestError(f"the prompt holds token ids outside this model's vocabulary (0..{n_vocab - 1})")
        if prompt.images and self.vision is None:
            raise RequestError("the prompt has images, and this model was loaded without a vision tower (mmproj)")
        return prompt if model is prompt.model else replace(prompt, model=model)

    def decide(self, request: dict[str, Any] | EncodedPrompt) -> dict[str, Any]:
        """Answer a SystemOne request body (or one already encoded by `encode`) with the SystemOne response body."""
        prompt = request if isinstance(request, EncodedPrompt) else self.encode(request)
        [answer] = self.decide_batch([prompt])
        if isinstance(answer, Exception):
            raise answer
        return answer

    def decide_many(
        self, requests: Iterable[Any], *, sort_by_state: bool = False, base: Path | None = None
    ) -> Iterator[dict[str, Any]]:
        """Decide many requests, in batches and through the state cache: for each, in order, its response body or
        {"error": {"status", "detail"}}, the server's error for it (runtime/dataset.py)."""
        self._refuse_if_closed()  # here, not at the first answer (each of its calls checks again)
        return decide_many(self, requests, sort_by_state=sort_by_state, base=base)

    def batchable(self, prompts: Sequence[EncodedPrompt]) -> bool:
        """Whether these prompts may be decided together: at most `parallel` of them, whose tokens fit one ubatch.

        Then each stage (state prefixes, the rest) is one ubatch, and no prompt's tokens are split at other
        boundaries than alone: its answers differ from its answers alone by float noise only (llama.cpp sums in
        another order over a ubatch of several sequences and a KV cache they share; tests/test_batching.py).
        """
        stepping, tokens = self._stepping, sum(len(p.tokens) for p in prompts)
        if stepping is not None:  # beside it: on the other sequences, in the cells it leaves, a ubatch at most
            room = min(self.backbone.ubatch, self.max_prompt_tokens - len(stepping.prompt.tokens))
            return 0 < len(prompts) < self.backbone.parallel and tokens <= room and len({p.identity for p in prompts}) == 1
        return len(prompts) == 1 or (
            len(prompts) <= self.backbone.parallel
            and tokens <= self.backbone.ubatch
            and len({p.identity for p in prompts}) == 1  # one model's: the context applies one adapter at a time
        )

    def stepped(self, prompt: EncodedPrompt) -> bool:
        """Whether a server decides this prompt in steps (begin), the batches waiting decided between them: one
        longer than a ubatch, when the context has a sequence for the others (parallel > 1)."""
        return self.backbone.parallel > 1 and len(prompt.tokens) > self.backbone.ubatch

    def begin(self, prompt: EncodedPrompt) -> PromptSteps:
        """Start deciding a prompt a ubatch at a time (runtime/steps.py): step() the result until it answers.

        Until then it holds the context's last sequence, and `batchable` admits only batches that fit beside it.
        One prompt at a time is decided in steps; each step is an API call (refused once the model is closed)."""
        with self._in_use():
            return self.compute(self._begin, self._check(prompt))

    def _begin(self, prompt: EncodedPrompt) -> PromptSteps:
        if self._stepping is not None:
            raise ComputeError("another prompt is being decided in steps: one at a time")
        self._stepping = PromptSteps(self, prompt, self._call)
        return self._stepping

    def _call(self, fn: Callable[[], T]) -> T:
        with self._in_use():
            return self.compute(fn)

    def end_steps(self, steps: PromptSteps) -> None:
        """(PromptSteps.finish) Its sequence is free again."""
        if self._stepping is steps:
            self._stepping = None

    def decide_batch(self, prompts: Sequence[EncodedPrompt]) -> list[dict[str, Any] | Exception]:
        """Answer encoded prompts that are `batchable`, their backbone prefills in the same llama_decode calls.

        One answer (or the exception that prompt raised: PromptTooLongError, ComputeError, ...) per prompt, in order.
        """
        scored = self.score_batch(prompts)
        return [s if isinstance(s, Exception) else self.answer(p, s) for p, s in zip(prompts, scored, strict=True)]

    def answer(self, prompt: EncodedPrompt, scores: Scores) -> dict[str, Any]:
        """A prompt's response body from its scores."""
        return response(prompt, prompt.model_name, scores.probabilities, scores.cached_tokens)

    def score_batch(self, prompts: Sequence[EncodedPrompt]) -> list[Scores | Exception]:
        """decide_batch's decisions before rounding: each prompt's Scores (or its exception), in order."""
        with self._in_use():
            prompts = [self._check(prompt) for prompt in prompts]
            if not self.batchable(prompts):
                tokens = sum(len(p.tokens) for p in prompts)
                raise ComputeError(f"{len(prompts)} prompts of {tokens} tokens in all cannot be decided together")
            return self.compute(self._score_batch, prompts)

    def _score_batch(self, prompts: Sequence[EncodedPrompt]) -> list[Scores | Exception]:
        head = self.activate(prompts[0])  # (batchable: one model's)
        return self.score(head, prompts, self._hidden_states(prompts))

    def activate(self, prompt: EncodedPrompt) -> NativeHead:
        """(On the compute thread) The prompt's model made the context's (its adapter loaded and applied): its head."""
        assert prompt.model is not None  # (_check)
        return self.decider.activate(prompt.model.entry)

    def score(
        self, head: NativeHead, prompts: Sequence[EncodedPrompt], hidden: Sequence[Hidden | Exception]
    ) -> list[Scores | Exception]:
        """(On the compute thread) Each prompt's Scores from its hidden states (a prompt's error, or (its hidden states,
        tokens the cache gave)) by its model's head and temperatures, or its error."""
        scored: list[Scores | Exception] = []
        for prompt, result in zip(prompts, hidden, strict=True):
            if isinstance(result, Exception):
                scored.append(result)
                continue
            assert prompt.model is not None  # (_check)
            try:  # views of llama.cpp's output buffer: the head reads them before the next decode
                questions = tuple(q.question for q in prompt.questions)
                tempered = [temperature_of(prompt.model.entry.temperatures, q.type, len(q.options)) for q in questions]
                logits = [np.array(z, dtype=np.float32) for z in head(result[0], prompt)]
                probabilities = question_probabilities(prompt.model.entry.name, logits, tempered)
                options = tuple(tuple(option for option, _ in q.options) for q in questions)
                scored.append(Scores(probabilities, result[1], tuple(q.id for q in questions), options, logits))
            except (ComputeError, ModelOutputError) as e:
                scored.append(e)
        return scored

    def _hidden_states(self, prompts: Sequence[EncodedPrompt]) -> list[tuple[np.ndarray, int] | Exception]:
        """Each prompt's hidden states and the tokens the state cache gave, or its error (runtime/prefill.py)."""
        stepping = self._stepping
        if stepping is None:
            return self.prefill().hidden_states(prompts)
        if not self.batchable(prompts):
            raise ComputeError(f"{len(prompts)} prompts cannot be decided beside the prompt decided in steps; retry after it")
        return self.prefill().hidden_states(prompts, keep=stepping.seq)  # (sequences 0.. before its own)

    def prefill(self) -> Prefill:
        return Prefill(self.backbone, self.state_cache, self.vision)

    def close(self) -> None:
        """Free the model once the calls in progress have ended; later calls raise ModelClosedError. A second close
        does nothing."""
        with self._busy:
            if self._closed:
                return
            self._closed = True
            self._busy.wait_for(lambda: self._active == 0)
        self._stepping = None  # (a prompt left in steps: its next step is refused)
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


def open_encoder(spec: ModelSpec) -> PromptEncoder:
    """The encoding part of the model `spec` declares, alone, with llama.cpp's tokenizer and no weights: the Ray
    ingress encodes what its replicas decide. Its base is pinned (runtime/base_file.py): a folder's adapters are
    checked against the version loaded when first named."""
    with ExitStack() as stack:
        validated = open_pinned(spec, compute=False)  # ClefModel's header check: the same refusals and messages
        stack.callback(validated.close)
        vocabulary = Vocabulary(validated.file, nfc=validated.description.nfc)  # llama.cpp keeps its own copy
        stack.callback(vocabulary.close)
        encoder = PromptEncoder(spec, validated, vocabulary.tokenize)
        encoder.owned = stack.pop_all()
    return encoder

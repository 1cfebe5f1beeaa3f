"""A loaded Clef model: `load(path).decide(request) -> response`."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from PIL import Image

from ..check.pair import open_vision
from ..check.validate import open_validated
from ..errors import ComputeError, ModelClosedError, ModelOutputError, PromptTooLongError, RequestError
from ..format.temperatures import temperature_of
from ..llama.backbone import Backbone
from ..llama.mtmd import VisionEncoder
from ..llama.native_head import NativeHead
from ..settings import LoadOptions, default_ubatch
from .adapters import Variant, Variants
from .answers import Scores, question_probabilities, response
from .dataset import decide_many
from .images import ImageLimits, image_limits
from .prefill import Prefill
from .prompt import EncodedPrompt, encode, parse_request
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
    """A loaded Clef GGUF: `clef_gguf.load(path, ...)` (this class) validates the file, loads it and runs one probe
    decision. n_gpu_layers: the layers on llama-cpp-python's device backend (-1 all, 0 the CPU alone).
    max_prompt_tokens is the largest prompt it will accept (default: Clef's 65,536), the
    context llama.cpp is created with (its n_ctx).

    ubatch: prompts are processed in ubatches of this many tokens, the state carried over,
    so llama.cpp's compute buffer is bounded by the ubatch, not the prompt (default:
    DEFAULT_UBATCH, or max_prompt_tokens if smaller); ubatch = max_prompt_tokens processes a prompt in one
    physical batch.
    state_cache: bytes of host memory for the backbone states of recent requests' state prefixes
    (runtime/state_cache.py; default 1 GiB), so that a request repeating a state computes only its
    schema; 0 turns it off. n_threads: default, the physical cores this process may use, less those busy (llama/threads.py).
    mmproj: the vision tower (llama.cpp's mmproj GGUF, which `clef-gguf convert` writes beside the
    model), so that requests may carry up to 4 images (runtime/images.py); without it they are refused.
    parallel: at most this many requests prefilled together (decide_batch).
    adapters: {name: adapter file} of fine-tunes over this base (runtime/adapters.py); adapter_dir: a folder of
    NAME.adapter.gguf files, each loaded when first named; at most max_adapters (and adapter_memory bytes) loaded at
    once. A request picks its model by name (its `model` field); without adapters every name is the base's.
    adapter: one adapter file that answers every request, whatever model it names (`decide --adapter`).
    base_head: an adapter without a head (llama-server's variant) decides with the base's head; else it is refused.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        n_gpu_layers: int = LoadOptions.n_gpu_layers,
        max_prompt_tokens: int = LoadOptions.max_prompt_tokens,
        n_threads: int | None = None,
        ubatch: int | None = None,
        state_cache: int = LoadOptions.state_cache,
        mmproj: str | Path | None = None,
        parallel: int = LoadOptions.parallel,
        adapters: Mapping[str, str | Path] | None = None,
        adapter: str | Path | None = None,
        adapter_dir: str | Path | None = None,
        max_adapters: int = LoadOptions.max_adapters,
        adapter_memory: int | None = None,
        base_head: bool = False,
    ) -> None:
        self.state_cache = StateCache(state_cache)  # a bad size is refused before anything is loaded
        self.ubatch = default_ubatch(max_prompt_tokens) if ubatch is None else ubatch
        self.path = Path(path)
        self._closed = False
        self._busy = threading.Condition()  # guards _closed and _active
        self._active = 0  # API calls in progress: close() frees the model only once none is
        self._stepping: PromptSteps | None = None  # the prompt prefilled in steps now (begin), on the last sequence
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-compute", initializer=self._mark)
        try:
            many = {"adapters": adapters, "adapter": adapter, "adapter_dir": adapter_dir}
            many |= {"max_adapters": max_adapters, "adapter_memory": adapter_memory, "base_head": base_head}
            self.compute(self._load, n_gpu_layers, max_prompt_tokens, n_threads, parallel, mmproj, many)
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

    def _load(
        self,
        n_gpu_layers: int,
        max_prompt_tokens: int,
        n_threads: int | None,
        parallel: int,
        mmproj: str | Path | None,
        many: dict[str, Any],
    ) -> None:
        # Every stage registers its undo: a failure at any stage closes what the earlier ones opened.
        with ExitStack() as stack:
            validated = open_validated(self.path)  # header-only `clef-gguf validate`: refuse what it rejects, with its message
            stack.callback(validated.close)
            self.file, d = validated.file, validated.description
            self.description, self.name, self.template = d, d.name, d.template
            self.identity, self.header_digest = self.file.identity(), self.file.digest()  # prompts', model_sha256's
            self.backbone = Backbone(
                self.file,
                n_gpu_layers=n_gpu_layers,
                max_prompt_tokens=max_prompt_tokens,
                n_threads=n_threads,
                nfc=d.nfc,
                ubatch=self.ubatch,
                parallel=parallel,
            )
            stack.callback(self.backbone.close)
            # The head runs where the backbone runs: on the GPU when layers are offloaded.
            self.head = NativeHead(self.file, d.head, gpu=n_gpu_layers != 0, n_threads=n_threads)
            stack.callback(self.head.close)
            gpu = n_gpu_layers != 0
            self.variants = Variants(self.backbone, self.file, d, self.identity, self.head, gpu=gpu, n_threads=n_threads, **many)
            stack.callback(self.variants.close)
            if self.variants.pinned is not None:  # one fine-tune answers everything: its identity is the model's
                self.identity, self.name = self.variants.pinned.identity, self.variants.pinned.name
            self.vision: VisionEncoder | None = None
            self.image_limits: ImageLimits | None = None
            if mmproj is not None:
                self.vision, self.image_limits = self._load_vision(Path(mmproj), n_gpu_layers != 0, n_threads)
                stack.callback(self.vision.close)
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

    def _load_vision(self, mmproj: Path, gpu: bool, n_threads: int | None) -> tuple[VisionEncoder, ImageLimits]:
        """The vision tower, validated and paired with this model, in libmtmd over the lean backbone."""
        limits = image_limits(open_vision(self.file.header, mmproj))
        per_token = limits.factor**2
        # mtmd's own token limits around the runtime's: it then takes every image runtime/images.py sized unresized.
        tokens = (max(1, limits.min_pixels // per_token), -(-limits.max_pixels // per_token))
        encoder = VisionEncoder(
            mmproj, self.backbone.model, n_threads=n_threads, use_gpu=gpu, min_tokens=tokens[0], max_tokens=tokens[1]
        )
        return encoder, limits

    def adapter_names(self) -> list[str]:
        """The fine-tunes a request may name (its `model`, Workers AI's `lora`) besides the base."""
        return self.variants.names()

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
        """Validate, tokenize and (images) decode and size a request; no compute. Raises RequestError."""
        with self._in_use():
            parsed = parse_request(request, self.image_limits)
            # The model it names (Workers AI's `lora`, else System One's `model`): the base, or one of its adapters.
            variant = self.variants.of_request(parsed)
            return encode(parsed, self.template, self.backbone.tokenize, variant.identity)

    def _check(self, prompt: Any) -> None:
        """Refuse a prompt this model did not encode (another file's tokens would index other rows) or one forged."""
        if not isinstance(prompt, EncodedPrompt):
            raise RequestError(f"a prompt is what model.encode(request) returns, not a {type(prompt).__name__}")
        if self.variants.of(prompt.model) is None:
            raise RequestError("this prompt was encoded by another model (another file): encode it with this model")
        tokens, n_vocab = np.asarray(prompt.tokens), self.backbone.token_embd.n_rows
        if tokens.ndim != 1 or (tokens.size and (tokens.dtype.kind != "i" or tokens.min() < 0 or tokens.max() >= n_vocab)):
            raise RequestError(f"the prompt holds token ids outside this model's vocabulary (0..{n_vocab - 1})")
        if prompt.images and self.vision is None:
            raise RequestError("the prompt has images, and this model was loaded without a vision tower (mmproj)")

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
            return 0 < len(prompts) < self.backbone.parallel and tokens <= room and len({p.model for p in prompts}) == 1
        return len(prompts) == 1 or (
            len(prompts) <= self.backbone.parallel
            and tokens <= self.backbone.ubatch
            and len({p.model for p in prompts}) == 1  # one model's: the context applies one adapter at a time
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
            self._check(prompt)
            return self.compute(self._begin, prompt)

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
        return response(prompt, self._name_of(prompt), scores.probabilities, scores.cached_tokens)

    def _name_of(self, prompt: EncodedPrompt) -> str:
        return self.variants.name_of(prompt) or self.name

    def model_name(self, prompt: EncodedPrompt) -> str:
        """The name of the model a prompt was encoded for (the base's or an adapter's): the server's metrics label."""
        return self._name_of(prompt)

    def score_batch(self, prompts: Sequence[EncodedPrompt]) -> list[Scores | Exception]:
        """decide_batch's decisions before rounding: each prompt's Scores (or its exception), in order."""
        with self._in_use():
            for prompt in prompts:
                self._check(prompt)
            if not self.batchable(prompts):
                tokens = sum(len(p.tokens) for p in prompts)
                raise ComputeError(f"{len(prompts)} prompts of {tokens} tokens in all cannot be decided together")
            return self.compute(self._score_batch, prompts)

    def _score_batch(self, prompts: Sequence[EncodedPrompt]) -> list[Scores | Exception]:
        variant = self.variants.of(prompts[0].model)  # (batchable: one model's)
        assert variant is not None
        head = self.variants.activate(variant)  # its LoRA applied, its head
        return self.score(variant, head, prompts, self._hidden_states(prompts))

    def score(
        self, variant: Variant, head: NativeHead, prompts: Sequence[EncodedPrompt], hidden: Sequence[Hidden | Exception]
    ) -> list[Scores | Exception]:
        """(On the compute thread) Each prompt's Scores from its hidden states (a prompt's error, or (its hidden states,
        tokens the cache gave)), by the variant's head, or its error."""
        scored: list[Scores | Exception] = []
        for prompt, result in zip(prompts, hidden, strict=True):
            if isinstance(result, Exception):
                scored.append(result)
                continue
            try:  # views of llama.cpp's output buffer: the head reads them before the next decode
                questions = tuple(q.question for q in prompt.questions)
                tempered = [temperature_of(variant.temperatures, q.type, len(q.options)) for q in questions]
                logits = [np.array(z, dtype=np.float32) for z in head(result[0], prompt)]
                probabilities = question_probabilities(variant.name, logits, tempered)
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
        self.compute(self._resources.close)  # head, backbone, then the mapping: the reverse of loading
        self._compute.shutdown()

    def __enter__(self) -> ClefModel:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# The API's verb: clef_gguf.load(path, ...) is ClefModel(path, ...), one signature.
load = ClefModel

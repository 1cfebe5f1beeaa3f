"""A loaded Clef model: `load(path).decide(request) -> response`."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from PIL import Image

from ..check.pair import open_vision
from ..check.validate import open_validated
from ..errors import ComputeError, ModelClosedError, ModelOutputError, PromptTooLongError, RequestError
from ..format.temperatures import temperature_of
from ..llama.backbone import Backbone, Part, prompt_positions
from ..llama.mtmd import VisionEncoder
from ..llama.native_head import NativeHead
from ..settings import LoadOptions, default_ubatch
from .answers import Scores, question_probabilities, response
from .dataset import decide_many
from .images import ImageLimits, image_limits
from .prompt import EncodedPrompt, encode, parse_request
from .state_cache import Entry, StateCache, cuts, entry_bytes, prefix_key


@dataclass
class _Plan:
    """A prompt's prefill as sequence `seq`: the parts to decode in order, the key of the state after each but
    the last, and the cache entry it starts from (reused: its tokens)."""

    seq: int
    parts: list[Part]
    keys: list[bytes]
    restore: Entry | None
    reused: int
    done: list[np.ndarray] = field(default_factory=list)  # hidden states so far, in order


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
    schema; 0 turns it off. n_threads: default, the physical cores this process may use.
    mmproj: the vision tower (llama.cpp's mmproj GGUF, which `clef-gguf convert` writes beside the
    model), so that requests may carry up to 4 images (runtime/images.py); without it they are refused.
    parallel: at most this many requests prefilled together (decide_batch).
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
    ) -> None:
        self.state_cache = StateCache(state_cache)  # a bad size is refused before anything is loaded
        self.ubatch = default_ubatch(max_prompt_tokens) if ubatch is None else ubatch
        self.path = Path(path)
        self._closed = False
        self._busy = threading.Condition()  # guards _closed and _active
        self._active = 0  # API calls in progress: close() frees the model only once none is
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-compute", initializer=self._mark)
        try:
            self.compute(self._load, n_gpu_layers, max_prompt_tokens, n_threads, parallel, mmproj)
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
        self, n_gpu_layers: int, max_prompt_tokens: int, n_threads: int | None, parallel: int, mmproj: str | Path | None
    ) -> None:
        # Every stage registers its undo: a failure at any stage closes what the earlier ones opened.
        with ExitStack() as stack:
            validated = open_validated(self.path)  # header-only `clef-gguf validate`: refuse what it rejects, with its message
            stack.callback(validated.close)
            self.file, d = validated.file, validated.description
            self.description, self.name, self.template = d, d.name, d.template
            self.identity = self.file.digest()  # what the prompts it encodes carry
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
            return encode(parse_request(request, self.image_limits), self.template, self.backbone.tokenize, self.identity)

    def _check(self, prompt: Any) -> None:
        """Refuse a prompt this model did not encode (another file's tokens would index other rows) or one forged."""
        if not isinstance(prompt, EncodedPrompt):
            raise RequestError(f"a prompt is what model.encode(request) returns, not a {type(prompt).__name__}")
        if prompt.model != self.identity:
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
        return len(prompts) == 1 or (
            len(prompts) <= self.backbone.parallel and sum(len(p.tokens) for p in prompts) <= self.backbone.ubatch
        )

    def decide_batch(self, prompts: Sequence[EncodedPrompt]) -> list[dict[str, Any] | Exception]:
        """Answer encoded prompts that are `batchable`, their backbone prefills in the same llama_decode calls.

        One answer (or the exception that prompt raised: PromptTooLongError, ComputeError, ...) per prompt, in order.
        """
        return [
            s if isinstance(s, Exception) else response(p, self.name, s.probabilities, s.cached_tokens)
            for p, s in zip(prompts, self.score_batch(prompts), strict=True)
        ]

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
        hidden = self._hidden_states(prompts)  # a prompt's error, or (its hidden states, tokens the cache gave)
        scored: list[Scores | Exception] = []
        for prompt, result in zip(prompts, hidden, strict=True):
            if isinstance(result, Exception):
                scored.append(result)
                continue
            try:  # views of llama.cpp's output buffer: the head reads them before the next decode
                questions = tuple(q.question for q in prompt.questions)
                tempered = [temperature_of(self.description.temperatures, q.type, len(q.options)) for q in questions]
                logits = [np.array(z, dtype=np.float32) for z in self.head(result[0], prompt)]
                probabilities = question_probabilities(self.name, logits, tempered)
                options = tuple(tuple(option for option, _ in q.options) for q in questions)
                scored.append(Scores(probabilities, result[1], tuple(q.id for q in questions), options, logits))
            except (ComputeError, ModelOutputError) as e:
                scored.append(e)
        return scored

    def _hidden_states(self, prompts: Sequence[EncodedPrompt]) -> list[tuple[np.ndarray, int] | Exception]:
        """Every token's final hidden state of each prompt (sequence i: prompts[i]), and how many tokens of
        them the state cache gave; or the prompt's error.

        A prompt is prefilled in parts, cut where its state is kept (state_cache.cuts): after the template's
        preamble, and after its state prefix. The longest cut the cache has is restored; each part after it
        is decoded once the part before it is, the state after a cut saved right then. Decodes take one
        part of each prompt, aligned at the end, so that every prompt's last part is in the last decode.
        """
        self.backbone.clear()
        out: list[tuple[np.ndarray, int] | Exception] = []
        plans: list[_Plan] = []
        for seq, prompt in enumerate(prompts):
            try:
                plan = self._plan(seq, prompt)  # (encoding's errors: this prompt's alone)
            except (PromptTooLongError, ComputeError) as e:
                out.append(e)
                continue
            out.append(ComputeError("not decoded"))  # replaced below by its hidden states
            if plan.restore is not None:  # (a refused state clears every sequence: the batch's error, not this prompt's)
                self.backbone.restore_sequence(plan.restore.sequence, seq)
                plan.done.append(plan.restore.hidden)
            plans.append(plan)
        steps = max((len(p.parts) for p in plans), default=0)
        for step in range(steps):
            now = [(p, step - steps + len(p.parts)) for p in plans if step >= steps - len(p.parts)]
            parts = [plan.parts[i] for plan, i in now]
            for (plan, i), hidden in zip(now, self.backbone.decode_batch(parts), strict=True):
                if step == steps - 1:  # a view of llama.cpp's output buffer, valid until the next decode
                    plan.done.append(hidden)
                    continue
                # The hidden states up to this cut, in one array: the cache entry's, and the start of the prompt's.
                prefix = np.concatenate([*plan.done, hidden]) if plan.done else hidden.copy()
                plan.done = [prefix]
                size = entry_bytes(plan.keys[i], self.backbone.sequence_size(plan.seq), prefix.nbytes)
                if self.state_cache.admits(size):
                    self.state_cache.put(plan.keys[i], Entry(self.backbone.save_sequence(plan.seq), prefix))
        for plan in plans:
            out[plan.seq] = (np.concatenate(plan.done) if len(plan.done) > 1 else plan.done[0], plan.reused)
        return out

    def _plan(self, seq: int, prompt: EncodedPrompt) -> _Plan:
        """How sequence `seq` prefills the prompt: the longest cached cut to restore, and the parts after it."""
        tokens = prompt.tokens
        if len(tokens) > self.max_prompt_tokens:  # (an image takes fewer positions than tokens)
            raise PromptTooLongError(len(tokens), self.max_prompt_tokens)
        positions = prompt_positions(len(tokens), [(p.start, p.image.nx, p.image.ny) for p in prompt.images])
        ends = [*cuts(prompt.preamble, prompt.state_prefix, len(tokens)), len(tokens)]
        keys = [prefix_key(tokens[:end], [p.image.digest for p in prompt.images if p.start < end]) for end in ends[:-1]]
        first, restore = 0, None
        for i in reversed(range(len(keys))):
            restore = self.state_cache.get(keys[i])
            if restore is not None:
                first = i + 1
                break
        starts = [0, *ends[:-1]]
        todo = zip(starts[first:], ends[first:], strict=True)  # (not the restored ones: their images are not encoded again)
        parts = [Part(seq, self._embeddings(prompt, a, b), positions[:, a:b]) for a, b in todo]
        return _Plan(seq, parts, keys[first:], restore, starts[first])

    def _embeddings(self, prompt: EncodedPrompt, start: int, end: int) -> np.ndarray:
        """The input embeddings of tokens[start:end]: token rows, and the vision tower's for image tokens."""
        embeddings = self.backbone.embeddings(prompt.tokens[start:end])
        for placed in prompt.images:
            first, last = placed.start, placed.start + placed.image.n_tokens
            if first >= end or last <= start:
                continue
            if first < start or last > end:
                raise ComputeError("an image straddles the state prefix: the template placed it inside the state")
            assert self.vision is not None  # encode refuses images without it
            encoded = self.vision.encode(placed.image.pixels)
            if (encoded.nx, encoded.ny) != (placed.image.nx, placed.image.ny):
                raise ComputeError(
                    f"mtmd encoded a {placed.image.nx} x {placed.image.ny}-token image as {encoded.nx} x {encoded.ny} tokens"
                )
            embeddings[first - start : last - start] = encoded.embeddings
        return embeddings

    def close(self) -> None:
        """Free the model once the calls in progress have ended; later calls raise ModelClosedError. A second close
        does nothing."""
        with self._busy:
            if self._closed:
                return
            self._closed = True
            self._busy.wait_for(lambda: self._active == 0)
        self.state_cache.clear()  # host memory only: the saved states are of no use without the context
        self.compute(self._resources.close)  # head, backbone, then the mapping: the reverse of loading
        self._compute.shutdown()

    def __enter__(self) -> ClefModel:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# The API's verb: clef_gguf.load(path, ...) is ClefModel(path, ...), one signature.
load = ClefModel

"""The deciding part of a loaded model: a batch's whole way from prompts to answers, on the model's compute thread.

A batch (prompts that are `batchable`: one model's) is decided here, and nowhere else: its model made the context's
(the adapter loaded and applied: runtime/loaded.py), its backbone prefill (through the state cache, beside a long
prompt decided in steps: runtime/prefill.py, PromptSteps below), the head, the temperatures, and the answer: the response
body with its cached tokens, and its unrounded scores (answers.Answer). The server, `decide_many`, the JSON Lines mode
and Ray's replicas and actors all take their answers from `Decider.decide` (through ClefModel, which owns the compute
thread and the model's lifecycle).

The catalog (runtime/catalog.py) says which models the base answers as, and reads a version again when it is loaded;
the loaded versions are the decider's, which tells its observer (loaded.AdapterObserver) when it loads, evicts or
retires one.

A long prompt is prefilled a ubatch at a time (PromptSteps), so that small requests are decided between its steps: the
server's compute thread is one (ClefModel.compute), and a prompt of thousands of tokens would hold it for its whole
prefill. Decider.begin reserves the context's last sequence for it; each step decodes one ubatch of it there
(runtime/prefill.py's Run: the same ubatches, cuts and saved states as deciding it alone), and between two steps the
server decides the batches waiting on the other sequences (server/worker.py), never clearing the reserved one. The
last step runs its model's head and gives the answer (Decider.answers, as a batch's). Each step applies its own
prompt's adapter (Decider.activate): a batch of another model between two steps switches the context's LoRA twice,
which makes llama.cpp reserve its graphs again on the next decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import numpy as np

from ..check.description import ValidatedFile
from ..errors import ComputeError, ModelOutputError, RequestError
from ..format.header import GGUFFile
from ..format.temperatures import temperature_of
from ..llama.backbone import Backbone
from ..llama.mtmd import VisionEncoder
from ..llama.native_head import NativeHead
from ..settings import ModelSpec, default_ubatch
from .answers import Answer, Scores, question_probabilities, response
from .catalog import Catalog, CatalogEntry
from .images import ImageLimits
from .loaded import AdapterObserver, LoadedAdapters
from .prefill import Prefill, Run
from .prompt import EncodedPrompt
from .state_cache import StateCache

T = TypeVar("T")
Hidden = tuple[np.ndarray, int]  # a prompt's final hidden states, and the tokens of them the state cache gave


def load_backbone(spec: ModelSpec, validated: ValidatedFile) -> Backbone:
    """The backbone as the spec's LoadOptions say: its context, its ubatch and sequences, and its vocabulary (which
    the encoder tokenizes with)."""
    o = spec.options
    return Backbone(
        validated.file,
        n_gpu_layers=o.n_gpu_layers,
        max_prompt_tokens=o.max_prompt_tokens,
        n_threads=o.n_threads,
        nfc=validated.description.nfc,
        ubatch=default_ubatch(o.max_prompt_tokens) if o.ubatch is None else o.ubatch,
        parallel=o.parallel,
    )


class Decider:
    """Over the backbone (load_backbone): the base's head, the vision tower (with an mmproj), the state cache, the
    loaded adapters and the prompt decided in steps. What is marked (compute) runs on the model's compute thread."""

    def __init__(
        self,
        spec: ModelSpec,
        validated: ValidatedFile,
        backbone: Backbone,
        catalog: Catalog,
        image_limits: ImageLimits | None,
        state_cache: StateCache,
        observer: AdapterObserver | None = None,
    ) -> None:
        o, d = spec.options, validated.description
        self.backbone, self.catalog = backbone, catalog
        self._gpu, self._threads = o.n_gpu_layers != 0, o.n_threads  # (the heads run where the backbone runs)
        self._file, self._head_tensors = validated.file, d.head
        bounds = (spec.adapter_set.max_adapters, spec.adapter_set.adapter_memory)
        pins = frozenset(spec.adapter_set.pins or ())
        self.adapters = LoadedAdapters(backbone, self._head_of, bounds, observer or AdapterObserver(), pins)
        self.stepping: PromptSteps | None = None  # the prompt prefilled in steps now (begin), on the last sequence
        # Every stage registers its undo: a failure at any stage closes what the earlier ones opened.
        with ExitStack() as stack:
            self.head = self._head_of(None)
            stack.callback(self.head.close)
            self.vision: VisionEncoder | None = None
            if o.mmproj is not None and image_limits is not None:
                self.vision = self._load_vision(Path(o.mmproj), image_limits)
                stack.callback(self.vision.close)
            self.prefill = Prefill(backbone, state_cache, self.vision)
            self._resources = stack.pop_all()

    def _head_of(self, adapter: GGUFFile | None) -> NativeHead:
        """The base's head, or an adapter's (its head tensors over the base's)."""
        return NativeHead(self._file, self._head_tensors, gpu=self._gpu, n_threads=self._threads, adapter=adapter)

    def _load_vision(self, mmproj: Path, limits: ImageLimits) -> VisionEncoder:
        """The vision tower (paired with this model by the encoder's check), in libmtmd over the lean backbone."""
        per_token = limits.factor**2
        # mtmd's own token limits around the runtime's: it then takes every image runtime/images.py sized unresized.
        tokens = (max(1, limits.min_pixels // per_token), -(-limits.max_pixels // per_token))
        return VisionEncoder(
            mmproj, self.backbone.model, n_threads=self._threads, use_gpu=self._gpu, min_tokens=tokens[0], max_tokens=tokens[1]
        )

    def check(self, prompt: object) -> EncodedPrompt:
        """The prompt, its model this model's own (one encoded elsewhere, as by the Ray ingress, is looked up by its
        identity: the catalog's, or a version loaded here); refused if another file's (its tokens would index other
        rows) or forged."""
        if not isinstance(prompt, EncodedPrompt):
            raise RequestError(f"a prompt is what model.encode(request) returns, not a {type(prompt).__name__}")
        ref = prompt.model
        model = None if ref is None else self.catalog.adopt(ref, self.adapters.entry(ref.identity))
        if model is None:
            raise RequestError("this prompt was encoded by another model (another file): encode it with this model")
        tokens, n_vocab = np.asarray(prompt.tokens), self.backbone.token_embd.n_rows
        if tokens.ndim != 1 or (tokens.size and (tokens.dtype.kind != "i" or tokens.min() < 0 or tokens.max() >= n_vocab)):
            raise RequestError(f"the prompt holds token ids outside this model's vocabulary (0..{n_vocab - 1})")
        if prompt.images and self.vision is None:
            raise RequestError("the prompt has images, and this model was loaded without a vision tower (mmproj)")
        return prompt if model is prompt.model else replace(prompt, model=model)

    def batchable(self, prompts: Sequence[EncodedPrompt]) -> bool:
        """Whether these prompts may be decided together: at most `parallel` of them, one model's, whose tokens fit one
        ubatch (beside the prompt decided in steps: on the other sequences, in the cells it leaves).

        Then each stage (state prefixes, the rest) is one ubatch, and no prompt's tokens are split at other
        boundaries than alone: its answers differ from its answers alone by float noise only (llama.cpp sums in
        another order over a ubatch of several sequences and a KV cache they share; tests/test_batching.py).
        """
        b, tokens, one_model = self.backbone, sum(len(p.tokens) for p in prompts), len({p.identity for p in prompts}) == 1
        if self.stepping is not None:
            room = min(b.ubatch, b.max_prompt_tokens - len(self.stepping.prompt.tokens))
            return 0 < len(prompts) < b.parallel and tokens <= room and one_model
        return len(prompts) == 1 or (len(prompts) <= b.parallel and tokens <= b.ubatch and one_model)

    def stepped(self, prompt: EncodedPrompt) -> bool:
        """Whether a server decides this prompt in steps (begin), the batches waiting decided between them: one
        longer than a ubatch, when the context has a sequence for the others (parallel > 1)."""
        return self.backbone.parallel > 1 and len(prompt.tokens) > self.backbone.ubatch

    def decide(self, prompts: Sequence[EncodedPrompt]) -> list[Answer | Exception]:
        """(compute) Each checked, batchable prompt's answer, or the exception that prompt raised, in order."""
        head = self.activate(prompts[0])  # (batchable: one model's)
        if self.stepping is None:
            hidden = self.prefill.hidden_states(prompts)
        elif self.batchable(prompts):
            hidden = self.prefill.hidden_states(prompts, keep=self.stepping.seq)  # (sequences 0.. before its own)
        else:
            raise ComputeError(f"{len(prompts)} prompts cannot be decided beside the prompt decided in steps; retry after it")
        return self.answers(head, prompts, hidden)

    def activate(self, prompt: EncodedPrompt) -> NativeHead:
        """(compute) The prompt's model made the context's (its adapter loaded and applied): its head."""
        assert prompt.model is not None  # (check)
        entry: CatalogEntry = prompt.model.entry
        head = self.adapters.apply(None if entry is self.catalog.base else entry, self.catalog.reread)
        return head if head is not None else self.head

    def answers(
        self, head: NativeHead, prompts: Sequence[EncodedPrompt], hidden: Sequence[Hidden | Exception]
    ) -> list[Answer | Exception]:
        """(compute) Each prompt's answer from its hidden states (or its error) by its model's head and temperatures."""
        answered: list[Answer | Exception] = []
        for prompt, result in zip(prompts, hidden, strict=True):
            if isinstance(result, Exception):
                answered.append(result)
                continue
            assert prompt.model is not None  # (check)
            entry = prompt.model.entry
            try:  # views of llama.cpp's output buffer: the head reads them before the next decode
                questions = tuple(q.question for q in prompt.questions)
                tempered = [temperature_of(entry.temperatures, q.type, len(q.options)) for q in questions]
                logits = [np.array(z, dtype=np.float32) for z in head(result[0], prompt)]
                probabilities = question_probabilities(entry.name, logits, tempered)
            except (ComputeError, ModelOutputError) as e:
                answered.append(e)
                continue
            options = tuple(tuple(option for option, _ in q.options) for q in questions)
            scores = Scores(probabilities, result[1], tuple(q.id for q in questions), options, logits)
            answered.append(Answer(response(prompt, prompt.model_name, probabilities, result[1]), scores))
        return answered

    def begin(self, prompt: EncodedPrompt, call: Callable[[Callable[[], T]], T]) -> PromptSteps:
        """(compute) Start deciding a checked prompt a ubatch at a time: its steps run through `call` (fn() on the
        compute thread, the model open); until its end it holds the context's last sequence."""
        if self.stepping is not None:
            raise ComputeError("another prompt is being decided in steps: one at a time")
        self.stepping = PromptSteps(self, prompt, call)
        return self.stepping

    def end_steps(self, steps: PromptSteps) -> None:
        """(PromptSteps.finish) Its sequence is free again."""
        if self.stepping is steps:
            self.stepping = None

    @property
    def loaded(self) -> list[str]:
        """The adapters loaded now, least recently used first."""
        return self.adapters.names

    def close(self) -> None:
        """Unload every adapter, then the vision tower and the head (the backbone is the model's to close)."""
        self.stepping = None  # (a prompt left in steps: its next step is refused)
        self.adapters.close()
        self._resources.close()


# A decode that writes a non-finite value makes the next clear wipe the whole memory (Backbone.clear), the
# reserved sequence with it: the prompt is prefilled again from its start (or its cached cut), once.
RESTARTS = 1


class PromptSteps:
    """One prompt's decision in steps (ClefModel.begin): step() until it returns the answer (or the prompt's error)."""

    def __init__(self, decider: Decider, prompt: EncodedPrompt, call: Callable[[Callable[[], T]], T]) -> None:
        self.decider, self.prompt, self._call = decider, prompt, call  # call: fn() on the compute thread, the model open
        self.seq = decider.backbone.parallel - 1  # the batches between its steps take the sequences before it
        self.run: Run | None = None
        self.restarts = 0
        self.done = False

    def step(self) -> Answer | Exception | None:
        """Decode the next ubatch: None while some are left, then the answer (or the prompt's exception)."""
        if self.done:
            raise ComputeError("this prompt's steps are over: its answer was given")
        try:
            answer = self._call(self._step)
        except Exception as e:  # a llama.cpp failure in a step (or the model closed): this prompt's alone
            answer = e
        if answer is not None:
            self.finish()
        return answer

    def _step(self) -> Answer | Exception | None:
        head = self.decider.activate(self.prompt)  # its LoRA applied again after a batch of another model
        if self.run is not None and self.run.cleared:
            if self.restarts >= RESTARTS:
                raise ComputeError("the context's memory was reset during this prompt's prefill, twice (non-finite values)")
            self.restarts, self.run = self.restarts + 1, None
        if self.run is None:  # nothing else is decoding when it starts: every sequence is cleared
            self.run = self.decider.prefill.start([self.prompt], [self.seq])
        if not self.run.step():
            return None
        [answer] = self.decider.answers(head, [self.prompt], self.run.out)
        return answer

    def finish(self) -> None:
        """Give the reserved sequence back; the answer is not computed if it was not."""
        if not self.done:
            self.done = True
            self.decider.end_steps(self)

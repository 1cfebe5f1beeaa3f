"""A batch's backbone prefill: each prompt cut where its states are kept, the longest cached cut restored, the parts
after it decoded (several prompts' parts in one llama_decode) and the states after the cuts saved (state_cache.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import ComputeError, PromptTooLongError
from ..llama.backbone import Backbone, Part, prompt_positions
from ..llama.mtmd import VisionEncoder
from .prompt import EncodedPrompt
from .state_cache import Entry, StateCache, cuts, entry_bytes, prefix_key


@dataclass
class _Plan:
    """A prompt's prefill as sequence `seq`: the parts to decode in order (each at most a ubatch), the key of the
    state after each part that ends at a cut (None elsewhere), and the cache entry it starts from (reused: its tokens)."""

    seq: int
    parts: list[Part]
    saves: list[bytes | None]
    restore: Entry | None
    reused: int
    done: list[np.ndarray] = field(default_factory=list)  # hidden states so far, in order


@dataclass
class Prefill:
    """The backbone, its state cache and the vision tower, as a batch's prefill uses them (on the compute thread)."""

    backbone: Backbone
    state_cache: StateCache
    vision: VisionEncoder | None

    @property
    def max_prompt_tokens(self) -> int:
        return self.backbone.max_prompt_tokens

    def hidden_states(
        self, prompts: Sequence[EncodedPrompt], seqs: Sequence[int] | None = None, keep: int | None = None
    ) -> list[tuple[np.ndarray, int] | Exception]:
        """Every token's final hidden state of each prompt (sequence seqs[i], default i: prompts[i]), and how many
        tokens of them the state cache gave; or the prompt's error. Every sequence but `keep` is cleared first."""
        run = self.start(prompts, seqs, keep)
        while not run.step():
            pass
        return run.out

    def start(self, prompts: Sequence[EncodedPrompt], seqs: Sequence[int] | None = None, keep: int | None = None) -> Run:
        """The prefill of these prompts, planned and restored from the cache, not yet decoded (Run.step decodes)."""
        return Run(self, prompts, list(range(len(prompts))) if seqs is None else list(seqs), keep)

    def _plan(self, seq: int, prompt: EncodedPrompt) -> _Plan:
        """How sequence `seq` prefills the prompt: the longest cached cut to restore, and the parts after it, each
        cut again into ubatches (llama.cpp's own split of a sequence, so that a prompt decoded a ubatch at a time,
        beside other batches, computes what it does in one llama_decode)."""
        tokens = prompt.tokens
        if len(tokens) > self.max_prompt_tokens:  # (an image takes fewer positions than tokens)
            raise PromptTooLongError(len(tokens), self.max_prompt_tokens)
        positions = prompt_positions(len(tokens), [(p.start, p.image.nx, p.image.ny) for p in prompt.images])
        ends = [*cuts(prompt.preamble, prompt.state_prefix, len(tokens)), len(tokens)]
        digests = [[p.image.digest for p in prompt.images if p.start < end] for end in ends[:-1]]
        keys = [prefix_key(tokens[:end], images, prompt.identity) for end, images in zip(ends[:-1], digests, strict=True)]
        first, restore = 0, None
        for i in reversed(range(len(keys))):
            restore = self.state_cache.get(keys[i])
            if restore is not None:
                first = i + 1
                break
        starts = [0, *ends[:-1]]
        parts: list[Part] = []
        saves: list[bytes | None] = []
        ubatch = self.backbone.ubatch
        # (not the restored parts: their images are not encoded again)
        for a, b, key in zip(starts[first:], ends[first:], [*keys, None][first:], strict=True):
            embeddings = self._embeddings(prompt, a, b)
            for c in range(a, b, ubatch):
                d = min(c + ubatch, b)
                parts.append(Part(seq, embeddings[c - a : d - a], positions[:, c:d]))
                saves.append(key if d == b else None)
        return _Plan(seq, parts, saves, restore, starts[first])

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


class Run:
    """A prefill in progress (Prefill.start): each step() is one llama_decode.

    A prompt is prefilled in parts, cut where its state is kept (state_cache.cuts): after the template's preamble,
    and after its state prefix; the longest cut the cache has is restored. Each part after it is decoded once the
    part before it is, the state after a cut saved right then. Decodes take one part of each prompt, aligned at the
    end, so that every prompt's last part is in the last decode. Between two steps other sequences may be decoded
    (not `keep`'s, which this run never clears): the hidden states so far are copied out of llama.cpp's buffer.
    """

    def __init__(self, prefill: Prefill, prompts: Sequence[EncodedPrompt], seqs: list[int], keep: int | None) -> None:
        self.prefill, backbone = prefill, prefill.backbone
        if keep is None:
            backbone.clear()
        for seq in range(backbone.parallel) if keep is not None else ():
            if seq != keep:
                backbone.clear(seq)
        self.out: list[tuple[np.ndarray, int] | Exception] = []
        self.plans: list[_Plan] = []
        for seq, prompt in zip(seqs, prompts, strict=True):
            try:
                plan = prefill._plan(seq, prompt)  # (encoding's errors: this prompt's alone)
            except (PromptTooLongError, ComputeError) as e:
                self.out.append(e)
                continue
            self.out.append(ComputeError("not decoded"))  # replaced by its hidden states
            if plan.restore is not None:  # (a refused state clears every sequence: the batch's error, not this prompt's)
                backbone.restore_sequence(plan.restore.sequence, seq)
                plan.done.append(plan.restore.hidden)
            self.plans.append(plan)
        self.index = {seq: i for i, seq in enumerate(seqs)}
        self.steps = max((len(p.parts) for p in self.plans), default=0)
        self.next = 0
        self.wipes = backbone.wipes  # (after its own clear)

    @property
    def cleared(self) -> bool:
        """Whether the backbone's memory was wiped whole since this run began (Backbone.wipes): its sequences with it."""
        return self.prefill.backbone.wipes != self.wipes

    def step(self) -> bool:
        """Decode the next parts; True once every prompt is prefilled (its results in self.out)."""
        if self.next < self.steps:
            self._decode(self.next)
            self.next += 1
        if self.next < self.steps:
            return False
        for plan in self.plans:
            hidden = np.concatenate(plan.done) if len(plan.done) > 1 else plan.done[0]
            self.out[self.index[plan.seq]] = (hidden, plan.reused)
        return True

    def _decode(self, step: int) -> None:
        backbone, cache, last = self.prefill.backbone, self.prefill.state_cache, step == self.steps - 1
        now = [(p, step - self.steps + len(p.parts)) for p in self.plans if step >= self.steps - len(p.parts)]
        for (plan, i), hidden in zip(now, backbone.decode_batch([plan.parts[i] for plan, i in now]), strict=True):
            if last:  # a view of llama.cpp's output buffer, valid until the next decode
                plan.done.append(hidden)
                continue
            key = plan.saves[i]
            if key is None:
                plan.done.append(hidden.copy())
                continue
            # The hidden states up to this cut, in one array: the cache entry's, and the start of the prompt's.
            prefix = np.concatenate([*plan.done, hidden]) if plan.done else hidden.copy()
            plan.done = [prefix]
            size = entry_bytes(key, backbone.sequence_size(plan.seq), prefix.nbytes)
            if cache.admits(size):
                cache.put(key, Entry(backbone.save_sequence(plan.seq), prefix))

"""The state cache: the backbone's state after a prompt's state prefix, kept for the next request about it.

Clef's prompt puts the state first (EncodedPrompt.state_prefix tokens), then the schema. A
request that repeats a state needs only the schema's tokens computed, if the backbone's state
after the prefix is at hand: llama.cpp's sequence state (the full-attention layers' KV cells
and the linear-attention layers' recurrent state) and the prefix's final hidden states, which
the head reads along with the rest. An entry is keyed by the exact prefix tokens (the model
is fixed per cache, so the same tokens mean the same state).

Bounded: a least-recently-used map with a byte budget. An entry's bytes are its sequence
state, its hidden states and its key; entries larger than the whole budget are not stored.

The default budget, 1 GiB, holds two 8k-token states of Clef-flash (Qwen3.5-9B: n_embd 4096,
8 full-attention layers with 4 KV heads of 256 in f16, 24 linear-attention layers with 32
value heads of 128 x 128 and a conv state of 3 x 8192, in f32):
  * KV cache: 8 layers x 2 x 4 x 256 x 2 bytes = 32 KiB per token, 256 MiB for 8,192 tokens;
  * recurrent state: 24 x (32 x 128 x 128 + 3 x 8192) x 4 bytes = 50.3 MiB, whatever the length;
  * hidden states: 4096 x 4 bytes = 16 KiB per token, 128 MiB;
  about 434 MiB each; a 1k-token state takes 98 MiB (ten fit), a 32k-token state 1.5 GiB (not kept).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import SettingsError
from ..settings import LoadOptions

# Shorter prefixes are computed, not cached: their prefill is small next to the schema's own (a
# 3-question schema is about 200 tokens), while every entry carries the whole recurrent state
# (50 MiB on Clef-flash, as much as the KV cache of 1,600 tokens), so caching them would let
# short states push the long ones, whose reuse saves seconds, out of the budget.
MIN_PREFIX_TOKENS = 256


@dataclass(frozen=True)
class Entry:
    sequence: np.ndarray  # uint8: llama.cpp's sequence state right after the prefix
    hidden: np.ndarray  # (prefix tokens, n_embd) float32: the prefix's final hidden states

    @property
    def tokens(self) -> int:
        return len(self.hidden)


def split_at_prefix(prefix_tokens: int, prompt_tokens: int) -> bool:
    """Whether a prompt's state prefix is cut off (see cuts): one of MIN_PREFIX_TOKENS or more."""
    return MIN_PREFIX_TOKENS <= prefix_tokens < prompt_tokens


def cuts(preamble: int, state_prefix: int, prompt_tokens: int) -> list[int]:
    """Where a prompt's prefill is cut, each part decoded after the other, so that the state after each
    part's end can be kept: after the template's preamble (the same for every request: kept once, it spares
    every request its prefill), and after the state prefix when split_at_prefix.

    Whatever the budget, 0 included: a cut moves llama.cpp's ubatch boundaries, which can move the answers
    by float noise, as another ubatch size would (measured on the test fixtures against one unsplit decode:
    none at ubatch 1024; at ubatch 64, 0.0002 at f32 and up to 0.0074 at q8_0, whose activation rounding
    amplifies it). Always cutting makes a request's answers the same to the bit whether the cache is on or
    off, and whether it hits or not.
    """
    points = [preamble] if 0 < preamble < prompt_tokens else []
    if split_at_prefix(state_prefix, prompt_tokens) and state_prefix > preamble:
        points.append(state_prefix)
    return points


def prefix_key(tokens: Sequence[int], images: Sequence[bytes] = (), model: str = "") -> bytes:
    """The key of a prefix: the model computing it (a base and each of its adapters compute other states), its
    images' digests (an image's tokens are all <|image_pad|>), then its tokens as int32 bytes (hashed, and compared
    in full on a match)."""
    return model.encode() + bytes([len(images)]) + b"".join(images) + np.asarray(tokens, dtype=np.int32).tobytes()


def entry_bytes(key: bytes, sequence_bytes: int, hidden_bytes: int) -> int:
    return len(key) + sequence_bytes + hidden_bytes


class StateCache:
    """LRU of prefix key -> Entry within `budget` bytes (0: off). Not thread-safe: only the model's compute thread uses it."""

    def __init__(self, budget: int = LoadOptions.state_cache) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise SettingsError(f"the state cache takes a size in bytes, 0 to turn it off, not {budget!r}")
        self.budget = budget
        self.nbytes = 0  # what the entries hold, by entry_bytes
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:  # (no use: a batch being planned only asks)
        return key in self._entries

    def admits(self, nbytes: int) -> bool:
        return nbytes <= self.budget

    def get(self, key: bytes) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: Entry) -> bool:
        """Keep an entry, evicting the least recently used until it fits; False if it cannot fit at all."""
        size = entry_bytes(key, entry.sequence.nbytes, entry.hidden.nbytes)
        if not self.admits(size):
            return False
        self.discard(key)
        while self.nbytes + size > self.budget:
            self.discard(next(iter(self._entries)))
        self._entries[key] = entry
        self.nbytes += size
        return True

    def discard(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry_bytes(key, entry.sequence.nbytes, entry.hidden.nbytes)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

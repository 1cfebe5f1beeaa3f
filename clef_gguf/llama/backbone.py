"""The Qwen3.5 backbone on stock llama.cpp (llama-cpp-python's libllama).

Two llama.cpp models over the same Clef file (llama/qwen35_view.py):
  * the full view, vocabulary only: llama.cpp's tokenizer for the prompt (Vocabulary, which
    also tokenizes where no weights are loaded: the Ray Serve ingress);
  * the lean view, for compute: its LM head is an n_embd x n_embd identity (qwen35_view.py),
    so its logits are the final hidden states (after the output norm), and llama.cpp does
    not compute (nor reserve a buffer for) n_vocab logits per token that nobody reads - on
    Clef-flash that is 4 GiB of compute buffer at 4096 tokens. It is fed the prompt's token
    embeddings, gathered from token_embd on the host.
One context of max_prompt_tokens cells, prompts processed in ubatches, every token an output.
It holds up to `parallel` sequences, one a prompt, in one unified KV cache (each may use all of
it) and a recurrent state each: decode_batch prefills several prompts in one llama_decode, and
llama.cpp puts their tokens in the same ubatches (a ubatch of outputs read as embeddings would
hold one sequence only: hence logits). A prompt may also be decoded in parts, and the memory
after a part saved and restored (llama.cpp's sequence state): the runtime's state cache
(runtime/state_cache.py) keeps a state prefix's that way.
"""

from __future__ import annotations

import ctypes
import functools
import unicodedata
from array import array
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import llama_cpp as L
import numpy as np

from ..errors import ComputeError, ModelFileError, PromptTooLongError, SettingsError
from ..format.header import GGUFFile
from ..settings import MAX_PARALLEL, MAX_UBATCH
from . import loader
from . import log as llama_log
from .rows import RowTable
from .threads import default_threads

_MULTI_POSITION_ROPE = (L.LLAMA_ROPE_TYPE_MROPE, L.LLAMA_ROPE_TYPE_IMROPE, L.LLAMA_ROPE_TYPE_VISION)


# llama_model_params.devices: a NULL-terminated list; an empty one gives llama.cpp no device at all.
_NO_DEVICES = (ctypes.c_void_p * 1)(None)


def load_model(
    f: GGUFFile, *, lean: bool, n_gpu_layers: int = 0, vocab_only: bool = False, no_alloc: bool = False
) -> L.llama_model_p:
    """A view of `f` loaded by llama.cpp (no_alloc: every buffer planned, none allocated: llama/plan.py).

    n_gpu_layers 0 is the CPU alone. With a device, llama.cpp would still offload the ops of a large batch
    whose weights stay on the host, and keep a compute buffer on the device for them (4 MiB at a 512-token
    context on Vulkan): the head and the vision tower run on the CPU then, and plan says 0 device bytes.
    """
    params = L.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    params.vocab_only = vocab_only
    params.no_alloc = no_alloc
    if n_gpu_layers == 0:
        params.devices = ctypes.cast(_NO_DEVICES, ctypes.c_void_p)
    return loader.load_model(f, lean, params)  # by the route CLEF_GGUF_LOADER picks, the CPU weights placed there


# Vocabulary's memo of tokenized pieces: how many, and the longest piece it keeps (a state is usually longer).
MEMO_ENTRIES = 1024
MEMO_CHARS = 256


def prompt_positions(n_tokens: int, images: Sequence[tuple[int, int, int]] = (), start: int = 0) -> np.ndarray:
    """(4, n_tokens) M-RoPE positions (t, h, w, and a 4th section of 0) of a prompt from position `start`.

    Text has t = h = w, one position a token. An image (its first token's index, nx tokens a row, ny rows) is
    at t = p, h = p + row, w = p + column from the position p after the text before it, and the text after it
    continues at p + max(nx, ny): transformers' Qwen3.5 get_rope_index, and mtmd's positions for M-RoPE
    (mtmd_image_tokens_get_decoder_pos, mtmd_image_tokens_get_n_pos).
    """
    positions = np.zeros((4, n_tokens), dtype=np.int32)
    done, p = 0, start
    for first, nx, ny in sorted(images):
        text = first - done
        positions[:3, done:first] = np.arange(p, p + text)
        p += text
        i = np.arange(nx * ny)
        positions[0, first : first + nx * ny] = p
        positions[1, first : first + nx * ny] = p + i // nx
        positions[2, first : first + nx * ny] = p + i % nx
        done, p = first + nx * ny, p + max(nx, ny)
    positions[:3, done:] = np.arange(p, p + n_tokens - done)
    return positions


def _bytes(array: np.ndarray) -> ctypes._Pointer:
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


@dataclass(frozen=True)
class Part:
    """Tokens of one sequence to decode: their input embeddings at their positions ((4, n): prompt_positions')."""

    seq: int
    embeddings: np.ndarray
    positions: np.ndarray


class _EmbeddingBatch:
    """A llama_batch of input embeddings, its arrays owned by numpy, for up to `capacity` tokens."""

    def __init__(self, capacity: int, n_embd: int, n_pos: int, n_seq: int) -> None:
        self.n_pos = n_pos
        self.embd = np.zeros((capacity, n_embd), dtype=np.float32)
        self.pos = np.zeros(0, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)  # every token is in one sequence
        self.seq_ids = np.arange(n_seq, dtype=np.int32)
        self.seq_id = np.zeros(capacity, dtype=np.uintp)  # llama_seq_id *: the address of its entry of seq_ids
        self.logits = np.ones(capacity, dtype=np.int8)  # every token is an output: the head reads them all

    def fill(self, parts: Sequence[Part]) -> L.llama_batch:
        """The batch of these parts' tokens, in order."""
        n = sum(len(part.embeddings) for part in parts)
        self.pos = np.empty((self.n_pos, n), dtype=np.int32)  # section-major (all t, then all h, ...), as llama.cpp reads it
        done = 0
        for part in parts:
            k = len(part.embeddings)
            self.embd[done : done + k] = part.embeddings
            self.pos[:, done : done + k] = part.positions[: self.n_pos]
            self.seq_id[done : done + k] = self.seq_ids.ctypes.data + self.seq_ids.itemsize * part.seq
            done += k
        return L.llama_batch(
            n_tokens=n,
            token=None,
            embd=self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            pos=self.pos.ctypes.data_as(ctypes.POINTER(L.llama_pos)),
            n_seq_id=self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=ctypes.cast(self.seq_id.ctypes.data, ctypes.POINTER(ctypes.POINTER(L.llama_seq_id))),
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )


def context_params(
    max_prompt_tokens: int, ubatch: int, n_threads: int | None = None, parallel: int = 1
) -> L.llama_context_params:
    """The context as the runtime creates it (and plan measures it): max_prompt_tokens cells in one KV cache
    that `parallel` sequences share, ubatches of `ubatch` tokens, every token an output (its logits are the
    lean view's hidden states)."""
    params = L.llama_context_default_params()
    params.n_ctx = params.n_batch = max_prompt_tokens
    # A decode (of one or several prompts) is one llama_decode call; llama.cpp splits it into ubatches itself,
    # carrying the recurrent and KV state over, and sizes its compute buffer for n_ubatch tokens.
    params.n_ubatch = ubatch
    params.n_seq_max = parallel
    params.kv_unified = True  # every sequence may take all max_prompt_tokens cells (not n_ctx / parallel)
    params.embeddings = False
    params.n_threads = params.n_threads_batch = n_threads or default_threads()
    return params


class Vocabulary:
    """llama.cpp's tokenizer of a Clef file: the full view loaded vocabulary only, no weights. Thread-safe."""

    def __init__(self, f: GGUFFile, *, nfc: bool = True) -> None:
        llama_log.init_backend()
        self.nfc = nfc
        self.model = load_model(f, lean=False, vocab_only=True)
        self.vocab = L.llama_model_get_vocab(self.model)
        # A prompt is tokenized piece by piece (runtime/prompt.py), and most pieces recur from request to
        # request: the template's own text ("OPTION 1: ", its header and footer) and a schema's instructions
        # and options: the memo answers a repeated piece without llama.cpp's tokenizer (docs/benchmarks.md,
        # "Measurements behind the code"). Bounded: MEMO_ENTRIES pieces of at most MEMO_CHARS, their
        # ids as int32 arrays (2 MiB at most); lru_cache is thread-safe, and tokenizing is a pure function of the text.
        self._memo = functools.lru_cache(maxsize=MEMO_ENTRIES)(lambda text: array("i", self._tokenize(text)))

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens parsed, as the reference's tokenizer(text, add_special_tokens=False)."""
        if len(text) <= MEMO_CHARS:
            return self._memo(text).tolist()  # a new list: callers extend it
        return self._tokenize(text)

    def _tokenize(self, text: str) -> list[int]:
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        raw = text.encode("utf-8")
        capacity = len(raw) + 16
        tokens = (L.llama_token * capacity)()
        n = L.llama_tokenize(self.vocab, raw, len(raw), tokens, capacity, False, True)
        if n < 0:
            raise ComputeError(f"llama.cpp's tokenizer failed ({n}): a byte-level BPE never yields more tokens than bytes")
        return tokens[:n]

    def close(self) -> None:
        """Free the vocabulary's model; a second close does nothing."""
        self._memo.cache_clear()
        if self.model:
            L.llama_model_free(self.model)
            self.model = self.vocab = None


class Backbone:
    """A loaded backbone and its context. Not thread-safe: one decode at a time."""

    def __init__(
        self,
        f: GGUFFile,
        *,
        n_gpu_layers: int = 0,
        max_prompt_tokens: int,
        n_threads: int | None = None,
        nfc: bool = True,
        ubatch: int | None = None,
        parallel: int = 1,
    ) -> None:
        if ubatch is not None and not 1 <= ubatch <= max_prompt_tokens:
            raise SettingsError(f"ubatch must be between 1 and the prompt limit ({max_prompt_tokens}), not {ubatch}")
        if (ubatch or max_prompt_tokens) > MAX_UBATCH:
            raise SettingsError(
                f"a physical batch of {ubatch or max_prompt_tokens} tokens is more than llama.cpp can plan for qwen35 in one "
                f"graph (it aborts above {MAX_UBATCH}); keep the prompt limit and process it in ubatches of at most "
                f"{MAX_UBATCH} tokens (ubatch / --ubatch)"
            )
        if not 1 <= parallel <= min(MAX_PARALLEL, max_prompt_tokens):  # (llama.cpp aborts on fewer cells than sequences)
            raise SettingsError(
                f"parallel (sequences decoded together) must be between 1 and {MAX_PARALLEL} and at most the prompt limit "
                f"({max_prompt_tokens}), not {parallel}"
            )
        llama_log.init_backend()
        self.max_prompt_tokens = max_prompt_tokens
        self.ubatch = ubatch or max_prompt_tokens
        self.parallel = parallel
        with ExitStack() as stack:  # a failure at any stage frees what the earlier ones made
            self.vocabulary = Vocabulary(f, nfc=nfc)
            stack.callback(self.vocabulary.close)
            self.model = load_model(f, lean=True, n_gpu_layers=n_gpu_layers)
            stack.callback(L.llama_model_free, self.model)
            self.n_embd = L.llama_model_n_embd(self.model)
            self.token_embd = RowTable(f, "token_embd.weight")
            self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))  # the identity's rows
            n_pos = 4 if L.llama_model_rope_type(self.model) in _MULTI_POSITION_ROPE else 1
            cparams = context_params(max_prompt_tokens, self.ubatch, n_threads, parallel)
            self.ctx = L.llama_init_from_model(self.model, cparams)
            if not self.ctx:
                reason = llama_log.last_error("out of memory?")
                raise ModelFileError(f"llama.cpp could not create a context of {max_prompt_tokens} tokens: {reason}")
            stack.callback(L.llama_free, self.ctx)
            try:
                self.batch = _EmbeddingBatch(max_prompt_tokens, self.n_embd, n_pos, parallel)
            except MemoryError:
                raise ModelFileError(f"not enough memory for a batch of {max_prompt_tokens} tokens' embeddings") from None
            self._dirty = True  # the first clear zeroes the memory (see clear)
            self.wipes = 0  # clears of the whole memory so far: a prefill in steps is told its sequence went with it
            self._resources = stack.pop_all()

    def tokenize(self, text: str) -> list[int]:
        return self.vocabulary.tokenize(text)

    def hidden_states(self, tokens: Sequence[int], copy: bool = True) -> np.ndarray:
        """(len(tokens), n_embd) final hidden states of one prompt, in one llama_decode call.

        copy=False returns a view of llama.cpp's output buffer, valid until the next decode.
        """
        if len(tokens) > self.max_prompt_tokens:
            raise PromptTooLongError(len(tokens), self.max_prompt_tokens)
        self.clear()
        hidden = self.decode(tokens)
        return hidden.copy() if copy else hidden

    def clear(self, seq: int = -1) -> None:
        """Forget every token of sequence `seq` (-1: of every sequence): its next decode starts at position 0.

        The memory's bytes are zeroed only when a decode may have left a non-finite value in them
        (self._dirty): then every sequence is forgotten. Zeroing is a memset of the whole KV cache
        (64 MiB at 65,536 cells even on the small fixtures: 10 ms a request), and finite stale bytes
        change nothing: KV cells outside a sequence are masked (-inf, which flash attention skips and a
        softmax weighs 0), and llama.cpp zeroes a new sequence's recurrent state itself (its rs_z state,
        scaled by 0). A NaN or Inf would survive that scaling, so a decode that could have written one
        is followed by a full clear. Otherwise the sequence is removed (seq_rm): the same empty cells as
        llama_memory_clear(data=False) leaves, without resetting the bookkeeping of every cell.
        """
        memory = L.llama_get_memory(self.ctx)
        seqs = range(self.parallel) if seq < 0 else [seq]  # (llama.cpp's recurrent memory refuses seq_rm of -1)
        if self._dirty or not all([L.llama_memory_seq_rm(memory, s, -1, -1) for s in seqs]):
            L.llama_memory_clear(memory, True)
            self._dirty = False
            self.wipes += 1

    def embeddings(self, tokens: Sequence[int]) -> np.ndarray:
        """The input embeddings of `tokens` (a new array: an image's rows can be written into it)."""
        return self.token_embd.rows(tokens)

    def decode(self, tokens: Sequence[int], start: int = 0) -> np.ndarray:
        """Hidden states of text `tokens` at positions start, ..., continuing the tokens in memory."""
        return self.decode_embeddings(self.embeddings(tokens), prompt_positions(len(tokens), start=start))

    def decode_embeddings(self, embeddings: np.ndarray, positions: np.ndarray, seq: int = 0) -> np.ndarray:
        """Hidden states of input embeddings at positions ((4, n): prompt_positions'), continuing the memory.

        Returns a view of llama.cpp's output buffer, valid until the next decode.
        """
        return self.decode_batch([Part(seq, embeddings, positions)])[0]

    def decode_batch(self, parts: Sequence[Part]) -> list[np.ndarray]:
        """Hidden states of each part (distinct sequences), all in one llama_decode: llama.cpp puts the
        sequences' tokens in the same ubatches, as many as fit, each sequence continuing its own memory.

        Returns views of llama.cpp's output buffer, valid until the next decode.
        """
        if len({p.seq for p in parts}) != len(parts) or not all(0 <= p.seq < self.parallel for p in parts):
            raise ComputeError(f"a batch takes distinct sequences 0 to {self.parallel - 1}: {[p.seq for p in parts]}")
        for p in parts:
            end = int(p.positions[0, -1]) + 1
            if end > self.max_prompt_tokens or len(p.embeddings) > self.max_prompt_tokens:
                raise PromptTooLongError(max(len(p.embeddings), end), self.max_prompt_tokens)
        n = sum(len(p.embeddings) for p in parts)
        if n > self.max_prompt_tokens:
            raise ComputeError(f"a batch of {n} tokens is more than the context's {self.max_prompt_tokens} cells")
        self._dirty = True  # until the decode is known to have left only finite values in memory
        status = L.llama_decode(self.ctx, self.batch.fill(parts))
        if status != 0:
            raise ComputeError(f"llama_decode failed with status {status}: {llama_log.last_error('see stderr')}")
        logits = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(n, self.n_vocab))
        hidden = logits[:, : self.n_embd]  # the identity's rows past n_embd are zeros
        ends = np.cumsum([len(p.embeddings) for p in parts])
        # A non-finite value written to memory (KV cells, recurrent or conv state) reaches the last token's
        # final hidden state: it attends to every cell and reads the state after itself, and the residual
        # stream carries a NaN to the output. Its row alone tells whether its sequence's memory is clean.
        self._dirty = not np.isfinite(hidden[ends - 1]).all()
        return np.split(hidden, ends[:-1])

    # The sequence state: what llama.cpp's memory holds of the tokens decoded so far. For qwen35's hybrid
    # memory that is the full-attention layers' KV cells and the linear-attention layers' recurrent state
    # (conv and delta-rule state), which is the state after the last token: it is saved right after
    # the tokens it stands for are decoded, before any other.
    def sequence_size(self, seq: int = 0) -> int:
        """Bytes of the sequence state of the tokens in memory."""
        return L.llama_state_seq_get_size(self.ctx, seq)

    def save_sequence(self, seq: int = 0) -> np.ndarray:
        """A copy of the sequence state (bytes, host memory), for restore_sequence."""
        state = np.empty(self.sequence_size(seq), dtype=np.uint8)
        written = L.llama_state_seq_get_data(self.ctx, _bytes(state), state.size, seq)
        if written != state.size:
            raise ComputeError(f"llama.cpp wrote {written} bytes of a sequence state of {state.size}")
        return state

    def restore_sequence(self, state: np.ndarray, seq: int = 0) -> None:
        """Replace sequence `seq`'s memory by a saved sequence state: its next decode continues after its tokens."""
        self.clear(seq)
        if L.llama_state_seq_set_data(self.ctx, _bytes(state), state.size, seq) != state.size:
            self._dirty = True  # whatever it wrote before refusing: zeroed
            self.clear()
            raise ComputeError(f"llama.cpp refused a sequence state it saved: {llama_log.last_error('see stderr')}")

    def close(self) -> None:
        """Free the context, then both models (the reverse of loading); a second close does nothing."""
        if getattr(self, "_resources", None):
            self._resources.close()
            self._resources = None
            self.ctx = None
        self.token_embd = None  # its rows are a view of the file's mapping, which can only close once they are gone

"""Is a GGUF file a complete Clef decision model? Said in one line, before anything is loaded.

Without `deep` only the header is read (key-values and tensor infos: ~16 MB of a 6 GB
file), locally through a memory map or remotely with HTTP range requests (remote.py),
so an early backbone-only conversion is caught before its download. Every check adds
a Problem; the problems decide the verdict, and the verdict the exit code:

    complete              0  a Clef decision model stock llama.cpp and the head can run
    corrupt               5  unreadable, not GGUF, truncated, bad offsets; --deep: NaN, Inf, zeros; --sha256
    not_a_decision_model  6  a sound GGUF without the decision model (e.g. a backbone-only qwen35 file)
    incomplete            7  a Clef file with missing or mismatched parts (head, backbone, tokenizer, metadata)

Whatever bytes a file holds, validate returns a report: a count or length read from the
file sizes a loop or an allocation only once bounded by the bytes that exist or by the
limits below. The runtime refuses what this module rejects (`open_validated`).
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import re
import struct
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from functools import cache
from itertools import repeat
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType as VT

from ..errors import CorruptModelError, IncompleteModelError, ModelFileError, NotADecisionModelError
from ..format import contract as C
from ..format.header import GGUF_MAGIC, Field, GGUFFile, Header, TensorInfo, TruncatedHeader, parse_header
from ..format.template import PromptTemplate

# Limits no real model comes near. A Clef header is ~16 MB (a 248k-token vocabulary and its
# merges); parsing the largest header allowed stays within seconds.
MAX_HEADER_BYTES = 64 << 20
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 16
MAX_LAYERS = 512  # LLAMA_MAX_LAYERS
MAX_WIDTH = 1 << 20  # any width, head count or vocabulary-sized dimension beyond this is not a model
MAX_HEAD_LAYERS = 64
GGML_MAX_NAME = 64  # ggml's tensor name buffer, terminating NUL included
FIRST_FETCH = 2 << 20  # remote: the first range request; grown until the header parses
MAX_FETCHES = 16
# The released head design (joint_head_config.json of Clef-flash): 20 + 18*6 + 26*3 = 206 GGUF tensors,
# holding the 22 + 14*6 + 18*3 = 160 of joint_head.safetensors.
RELEASED_HEAD = ("Clef-flash", 6, 3)
# clef-gguf 0.1.0 wrote its own layout under the same architecture name: recognized, and refused with the remedy.
OLD_DECISION_TYPE = "joint_schema"
OLD_HEAD_PREFIX = "head."
OLD_LAYOUT_MESSAGE = (
    "this file is in clef-gguf 0.1.0's own layout (clef.decision.type 'joint_schema', head.* tensors), which "
    "llama.cpp does not read: convert the release again with `clef-gguf convert`"
)

# What llama.cpp's CPU backend runs as weights; the native head is a ggml graph too, and reads the same types.
BACKBONE_TYPES = frozenset(
    {GT.F32, GT.F16, GT.BF16, GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.Q8_0, GT.Q2_K, GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K}
    | {GT.IQ2_XXS, GT.IQ2_XS, GT.IQ2_S, GT.IQ3_XXS, GT.IQ3_S, GT.IQ1_S, GT.IQ1_M, GT.IQ4_NL, GT.IQ4_XS}
    | {GT.TQ1_0, GT.TQ2_0, GT.MXFP4}
)
HEAD_TYPES = BACKBONE_TYPES
# Template special tokens must be parsed as one token each: llama.cpp does so for these types.
_SPECIAL_TOKEN_TYPES = frozenset({gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED})
_OPTIONAL_BIAS = re.compile(r"^blk\.(\d+)\.attn_([qkv])\.bias$")


class Verdict(str, Enum):
    COMPLETE = "complete"
    CORRUPT = "corrupt"
    NOT_A_DECISION_MODEL = "not_a_decision_model"
    INCOMPLETE = "incomplete"


_ERRORS: dict[Verdict, type[ModelFileError]] = {
    Verdict.CORRUPT: CorruptModelError,
    Verdict.NOT_A_DECISION_MODEL: NotADecisionModelError,
    Verdict.INCOMPLETE: IncompleteModelError,
}


@dataclass(frozen=True)
class Problem:
    check: str  # source, header, layout, decision, head, backbone, metadata, tokenizer, types, data, sha256
    message: str
    corrupt: bool = False  # the bytes are unreadable or damaged (not merely an incomplete model)


@dataclass(frozen=True)
class Counts:
    tensors: int = 0
    backbone: int = 0  # tensors not named head.*
    backbone_expected: int | None = None  # what llama.cpp's qwen35 loader asks for, given the hyperparameters
    head: int = 0  # head.* tensors
    head_expected: int | None = None  # 22 + 14*routing_layers + 18*layers, from the head config
    vocab: int = 0


@dataclass(frozen=True)
class Report:
    source: str
    verdict: Verdict
    summary: str  # one line a person understands
    problems: tuple[Problem, ...] = ()
    counts: Counts = Counts()
    architecture: str | None = None
    file_size: int | None = None
    header_size: int | None = None  # bytes before the tensor data: all a header-only validation needs
    tensor_types: dict[str, int] = field(default_factory=dict)  # ggml type -> number of tensors
    notes: tuple[str, ...] = ()
    deep: bool = False
    sha256: str | None = None  # of the whole file, when asked for
    bytes_read: int | None = None  # remote: what crossed the network
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.COMPLETE

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else _ERRORS[self.verdict].exit_code

    def error(self) -> ModelFileError | None:
        """The typed error the runtime and the CLI raise for this verdict (None when complete)."""
        return None if self.ok else _ERRORS[self.verdict](f"{self.source}: {self.summary}")

    def raise_for_verdict(self) -> None:
        error = self.error()
        if error is not None:
            raise error

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["verdict"] = self.verdict.value
        out["exit_code"] = self.exit_code
        return out


# --- Reading the header ---------------------------------------------------------------------------
def _corrupt(check: str, message: str) -> Problem:
    return Problem(check, message, corrupt=True)


EMPTY = "the file is empty (0 bytes)"


def _declared_counts(buf: Any) -> tuple[int, int] | None:
    if len(buf) < 24:
        return None
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    return n_tensors, n_kv


def parse_prefix(buf: Any, file_size: int) -> tuple[Header | None, list[Problem], int | None]:
    """Parse the header from `buf`, the first bytes of a file of `file_size` bytes.

    Returns (header, problems, more): `more` is the prefix length to fetch next when `buf`
    ends before the header does and the file has more bytes; otherwise None.
    """
    if file_size == 0:
        return None, [_corrupt("source", EMPTY)], None
    if len(buf) >= 4 and bytes(buf[:4]) != GGUF_MAGIC:
        return None, [_corrupt("header", f"not a GGUF file: it starts with {bytes(buf[:4])!r}, not {GGUF_MAGIC!r}")], None
    counts = _declared_counts(buf)
    if counts and (counts[0] > MAX_TENSORS or counts[1] > MAX_KEYS):
        message = f"the header declares {counts[0]} tensors and {counts[1]} key-values, far beyond any model: it is corrupt"
        return None, [_corrupt("header", message)], None
    try:
        return parse_header(buf), [], None
    except TruncatedHeader as e:
        limit = min(file_size, MAX_HEADER_BYTES)
        if len(buf) < limit:
            return None, [], min(limit, max(e.needed or 0, 2 * len(buf)))
        if (e.needed or 0) > file_size or len(buf) >= file_size:
            message = f"the file ends inside its header: truncated, or a count or length in it is corrupt ({e})"
        else:
            message = (
                f"the header is larger than {MAX_HEADER_BYTES >> 20} MiB, which no model needs: a count or length is corrupt"
            )
        return None, [_corrupt("header", message)], None
    except ModelFileError as e:
        return None, [_corrupt("header", f"corrupt header: {e}")], None


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def check_layout(h: Header, file_size: int) -> list[Problem]:
    """What ggml's GGUF reader and llama.cpp's loader refuse: names, alignment, offsets, data past EOF."""
    problems = []
    alignment = h.fields.get("general.alignment")
    if alignment is not None and alignment.type != VT.UINT32:
        problems.append(_corrupt("layout", f"general.alignment is stored as {alignment.type.name}; GGUF requires UINT32"))
    long_names = [n for n in h.tensors if len(n.encode()) >= GGML_MAX_NAME]
    if long_names:
        problems.append(_corrupt("layout", f"tensor name {long_names[0][:80]!r} is longer than ggml's {GGML_MAX_NAME - 1} bytes"))
    expected = 0
    for t in h.tensors.values():  # ggml requires the data in tensor-info order, each tensor padded to the alignment
        if t.offset != expected:
            message = (
                f"tensor {t.name} starts at data offset {t.offset}, where ggml expects {expected}: the tensor infos are corrupt"
            )
            problems.append(_corrupt("layout", message))
            break
        expected += _pad(t.n_bytes, h.alignment)
    end = max((h.data_offset + t.offset + t.n_bytes for t in h.tensors.values()), default=h.data_offset)
    if end > file_size:
        missing = 100 * (end - file_size) / max(end - h.data_offset, 1)
        problems.append(
            _corrupt(
                "layout",
                f"the file is truncated: its tensor data ends at byte {end} but the file has {file_size} bytes "
                f"({min(missing, 100):.0f}% of the data is missing); download it again",
            )
        )
    return problems


# --- Hyperparameters --------------------------------------------------------------------------------
class _Reader:
    """Reads `<prefix>.<suffix>` keys with llama.cpp's types and defaults; collects what is wrong."""

    def __init__(self, h: Header, prefix: str) -> None:
        self.h, self.prefix = h, prefix
        self.problems: list[Problem] = []

    def bad(self, message: str) -> None:
        self.problems.append(Problem("metadata", message))

    def _field(self, suffix: str, required: bool) -> tuple[str, Field | None]:
        """The key of a hyperparameter and its field; a missing required one is a problem."""
        key = f"{self.prefix}.{suffix}"
        f = self.h.fields.get(key)
        if f is None and required:
            self.bad(f"{key} is missing")
        return key, f

    def uint(self, suffix: str, low: int, high: int, default: int | None = None, layers: int | None = None) -> int | None:
        """A UINT32 (llama.cpp rejects other types); with `layers`, also a per-layer array of equal values."""
        key, f = self._field(suffix, required=default is None)
        if f is None:
            return default
        value = f.value
        if f.type == VT.ARRAY and layers is not None and f.item_type in (VT.INT32, VT.UINT32):
            if len(value) != layers or len(set(value)) != 1:
                self.bad(f"{key} is a per-layer array of {len(value)} values; a Qwen3.5 backbone has one value for all layers")
                return None
            value = value[0]
        elif f.type != VT.UINT32:
            self.bad(f"{key} is stored as {f.type.name}; llama.cpp reads it as UINT32")
            return None
        if not low <= value <= high:
            self.bad(f"{key} = {value} is outside [{low}, {high}]")
            return None
        return value

    def float(self, suffix: str, low: float, high: float, default: float | None = None) -> float | None:
        key, f = self._field(suffix, required=default is None)
        if f is None:
            return default
        if f.type != VT.FLOAT32:
            self.bad(f"{key} is stored as {f.type.name}; llama.cpp reads it as FLOAT32")
            return None
        if not (math.isfinite(f.value) and low < f.value <= high):
            self.bad(f"{key} = {f.value} is outside ({low}, {high}]")
            return None
        return f.value


def _layer_types(r: _Reader, n_layer: int) -> tuple[bool, ...] | None:
    """Recurrent (linear attention) or not, per layer: llama.cpp derives it from full_attention_interval."""
    interval = r.uint("full_attention_interval", 1, MAX_LAYERS, default=4)
    if interval is None:
        return None
    recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
    f = r.h.fields.get(f"{r.prefix}.attention.recurrent_layers")
    if f is not None and (f.type != VT.ARRAY or [bool(v) for v in f.value] != list(recurrent)):
        r.bad(f"{r.prefix}.attention.recurrent_layers disagrees with full_attention_interval {interval}, which llama.cpp uses")
    elif all(recurrent) or not any(recurrent):
        # llama.cpp's hybrid memory allocates a KV cache and a recurrent state: one with no layer
        # gets no buffer, and ggml asserts on it (GGML_ASSERT(buffer)): decide would abort.
        kind = "full-attention" if all(recurrent) else "linear-attention"
        r.bad(f"{n_layer} layers with {r.prefix}.full_attention_interval {interval} have no {kind} layer (llama.cpp aborts)")
    return recurrent


def _rope(r: _Reader, head_dim: int) -> None:
    """What ggml's M-RoPE asserts (docs/loader_assumptions.md): n_dims even, <= head_dim; 4 sections, one of the first 3 > 0."""
    n_rot = r.uint("rope.dimension_count", 2, head_dim, default=head_dim)
    if n_rot is not None and n_rot % 2:
        r.bad(f"{r.prefix}.rope.dimension_count {n_rot} is odd (ggml's rope asserts an even count: decide would abort)")
    r.float("rope.freq_base", 0.0, 1e12, default=10_000.0)
    key = f"{r.prefix}.rope.dimension_sections"
    f = r.h.fields.get(key)
    if f is None:
        r.bad(f"{key} is missing (llama.cpp's qwen35 requires it)")
        return
    if f.type != VT.ARRAY or f.item_type not in (VT.INT32, VT.UINT32) or len(f.value) != 4:
        r.bad(f"{key} must be an array of 4 integers (llama.cpp's loader refuses any other length)")
        return
    sections = [int(v) for v in f.value]
    shown = f"{key} = [{','.join(map(str, sections))}]"
    if min(sections) < 0 or max(sections) >= 1 << 31:
        r.bad(f"{shown}: sections must be non-negative int32 values")
    elif not any(sections[:3]):
        # ggml_compute_forward_rope: GGML_ASSERT(sections[0] > 0 || sections[1] > 0 || sections[2] > 0), an abort.
        r.bad(f"{shown}: one of the first three sections must be positive (ggml's M-RoPE asserts it: decide would abort)")
    elif n_rot is not None and 2 * sum(sections) > n_rot:
        r.bad(f"{shown} must cover at most the {n_rot // 2} rotary pairs (llama.cpp asserts)")


def backbone_shape(h: Header, prefix: str) -> tuple[C.BackboneShape | None, list[Problem]]:
    """The backbone's shape from `<prefix>.*` (clef.* in a Clef file, qwen35.* in a backbone-only one).

    Reads what llama.cpp's qwen35 loader reads, with its types, defaults and checks; the
    vocabulary size is the token count. The shape is None when a value the tensors depend
    on is unusable; the problems list what llama.cpp would refuse either way.
    """
    r = _Reader(h, prefix)
    n_layer = r.uint("block_count", 1, MAX_LAYERS)
    n_embd = r.uint("embedding_length", 1, MAX_WIDTH)
    r.uint("context_length", 1, 1 << 24)
    n_ff = r.uint("feed_forward_length", 1, MAX_WIDTH, layers=n_layer)
    n_head = r.uint("attention.head_count", 1, MAX_WIDTH, layers=n_layer)
    n_head_kv = r.uint("attention.head_count_kv", 1, MAX_WIDTH, default=n_head, layers=n_layer)
    default_dim = n_embd // n_head if n_embd and n_head else None
    head_dim = r.uint("attention.key_length", 1, MAX_WIDTH, default=default_dim)
    value_dim = r.uint("attention.value_length", 1, MAX_WIDTH, default=default_dim)
    r.float("attention.layer_norm_rms_epsilon", 0.0, 1.0)
    conv_kernel = r.uint("ssm.conv_kernel", 1, 64)
    state = r.uint("ssm.state_size", 1, MAX_WIDTH)
    k_heads = r.uint("ssm.group_count", 1, MAX_WIDTH)
    v_heads = r.uint("ssm.time_step_rank", 1, MAX_WIDTH)
    inner = r.uint("ssm.inner_size", 1, MAX_WIDTH)
    recurrent = _layer_types(r, n_layer) if n_layer else None
    if head_dim and value_dim and head_dim != value_dim:
        r.bad(f"{prefix}.attention.key_length {head_dim} != value_length {value_dim} (llama.cpp's qwen35 asserts equality)")
    if n_head and n_head_kv and n_head % n_head_kv:
        r.bad(f"{prefix}.attention.head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    if v_heads and k_heads and v_heads % k_heads:
        r.bad(f"{prefix}.ssm.time_step_rank {v_heads} is not a multiple of ssm.group_count {k_heads}")
    if inner and v_heads and state and inner != v_heads * state:
        r.bad(f"{prefix}.ssm.inner_size {inner} != time_step_rank {v_heads} x state_size {state}")
    if head_dim:
        _rope(r, head_dim)
    tokens = h.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens) if isinstance(tokens, list) else 0
    values = (n_vocab, n_embd, n_ff, n_layer, n_head, n_head_kv, head_dim, recurrent, conv_kernel, k_heads, v_heads, state)
    if any(not v for v in values):
        return None, r.problems
    shape = C.BackboneShape(
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_ff=n_ff,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        recurrent=recurrent,
        conv_kernel=conv_kernel,
        k_heads=k_heads,
        v_heads=v_heads,
        linear_head_dim=state,
        tied="output.weight" not in h.tensors,
    )
    return shape, r.problems


# --- Tensors ----------------------------------------------------------------------------------------
def _same_dims(t: TensorInfo, shape: tuple[int, ...]) -> bool:
    """llama.cpp's rule: the expected ggml dims, any further dims 1."""
    want = tuple(reversed(shape))
    return len(t.dims) >= len(want) and t.dims[: len(want)] == want and all(d == 1 for d in t.dims[len(want) :])


def _optional(name: str, t: TensorInfo, shape: C.BackboneShape, tensors: dict[str, TensorInfo]) -> bool:
    """q/k/v biases of full-attention layers: llama.cpp's qwen35 loader takes them when present."""
    m = _OPTIONAL_BIAS.match(name)
    if not m or int(m[1]) >= shape.n_layer or shape.recurrent[int(m[1])]:
        return False
    weight = tensors.get(f"blk.{m[1]}.attn_{m[2]}.weight")
    return weight is not None and len(t.dims) == 1 and t.dims[0] == weight.dims[-1]


def _first(names: list[str], n: int = 1) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def check_backbone(h: Header, shape: C.BackboneShape) -> tuple[list[Problem], int]:
    """Every tensor llama.cpp's qwen35 loader asks for, with the shapes the hyperparameters imply."""
    expected = C.backbone_tensor_shapes(shape)
    tensors = h.tensors
    missing = [n for n in expected if n not in tensors]
    wrong = [n for n, want in expected.items() if n in tensors and not _same_dims(tensors[n], want)]
    extra = [
        n for n, t in tensors.items() if not C.is_head_tensor(n) and n not in expected and not _optional(n, t, shape, tensors)
    ]
    problems = []
    if missing:
        problems.append(
            Problem(
                "backbone",
                f"{len(missing)} of the {len(expected)} backbone tensors llama.cpp asks for are missing: {_first(missing)}",
            )
        )
    if wrong:
        n = wrong[0]
        problems.append(
            Problem(
                "backbone",
                f"backbone tensor {n} has shape {list(tensors[n].shape)}, the hyperparameters imply {list(expected[n])}"
                + (f" ({len(wrong) - 1} more tensors differ)" if len(wrong) > 1 else ""),
            )
        )
    if extra:
        problems.append(Problem("backbone", f"llama.cpp's qwen35 loader refuses tensors it does not create: {_first(extra)}"))
    return problems, len(expected)


def head_config(h: Header, n_embd: int | None) -> tuple[C.HeadConfig | None, list[Problem]]:
    """The head's config as llama.cpp's Clef loader reads it: counts from clef.decision.* (UINT32), widths
    from tensor shapes (decision.proj_memory: width, dec.blk.0.ffn_up: feedforward), bounded before any
    shape is derived."""
    problems = []
    counts: dict[str, int] = {}
    keys = {"routing_layers": C.KEY_ROUTING_BLOCKS, "layers": C.KEY_JOINT_BLOCKS, "heads": C.KEY_HEAD_COUNT}
    for name, key in keys.items():
        f = h.fields.get(key)
        low, high = (1, 4096) if name == "heads" else (0, MAX_HEAD_LAYERS)
        if f is None:
            problems.append(Problem("head", f"{key} is missing"))
        elif f.type != VT.UINT32:  # llama.cpp reads it as a uint32 and refuses another type
            problems.append(Problem("head", f"{key} is stored as {f.type.name}, not UINT32"))
        elif not low <= f.value <= high:
            problems.append(Problem("head", f"{key} = {f.value} is outside [{low}, {high}]"))
        else:
            counts[name] = f.value
    eps = h.fields.get(C.KEY_HEAD_NORM_EPS)
    if eps is None or eps.type != VT.FLOAT32 or not 0 < eps.value < 1:
        message = f"{C.KEY_HEAD_NORM_EPS} (the head's LayerNorm epsilon) is missing or not a FLOAT32 in (0, 1)"
        problems.append(Problem("head", message))
    widths = {}
    for name, tensor in (("width", "decision.proj_memory.weight"), ("feedforward", "dec.blk.0.ffn_up.weight")):
        t = h.tensors.get(tensor)
        if t is None or len(t.dims) != 2 or not 1 <= t.dims[1] <= MAX_WIDTH:
            problems.append(Problem("head", f"{tensor}, whose rows give the head's {name}, is missing or not 2-D"))
        else:
            widths[name] = t.dims[1]
    if problems or n_embd is None:
        return None, problems
    config = C.HeadConfig(hidden_size=n_embd, **widths, **counts)
    if config.width % config.heads:
        message = f"the head's width {config.width} is not a multiple of {C.KEY_HEAD_COUNT} = {config.heads}"
        return None, [Problem("head", message)]
    return config, []


def _same_head_dims(name: str, t: TensorInfo, shape: tuple[int, ...]) -> bool:
    # llama-quantize writes decision.scorer_out.weight, (W, 1), back as 1-D (W); llama.cpp reads both.
    return _same_dims(t, shape) or (name == "decision.scorer_out.weight" and t.dims == (shape[1],))


def check_head(h: Header, config: C.HeadConfig) -> tuple[list[Problem], int]:
    """Every head tensor llama.cpp's Clef loader asks for, with the shape the config implies."""
    expected = C.head_tensor_shapes(config)
    present = {n: t for n, t in h.tensors.items() if C.is_head_tensor(n)}
    problems = []
    missing = [n for n in expected if n not in present]
    if missing:
        formula = f"20 + 18*{config.routing_layers} + 26*{config.layers}"
        reference = C.reference_tensor_count(config.routing_layers, config.layers)
        problems.append(
            Problem(
                "head",
                f"{len(expected) - len(missing)} of the {len(expected)} head tensors ({formula}, holding the {reference} "
                f"of joint_head.safetensors) are present; missing: {_first(missing)}",
            )
        )
    wrong = [n for n, want in expected.items() if n in present and not _same_head_dims(n, present[n], want)]
    if wrong:
        n = wrong[0]
        problems.append(
            Problem(
                "head",
                f"head tensor {n} has shape {list(present[n].shape)}, the head implies {list(expected[n])}: "
                "a head of another width, or of another backbone"
                + (f" ({len(wrong) - 1} more tensors differ)" if len(wrong) > 1 else ""),
            )
        )
    extra = [n for n in present if n not in expected]
    if extra:
        problems.append(Problem("head", f"head tensors llama.cpp's Clef loader does not create: {_first(extra)}"))
    return problems, len(expected)


@cache
def _dequantizable(qtype: GT) -> bool:
    """Whether gguf-py dequantizes `qtype` (--deep decodes quantized tensors with it)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(size, dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def check_types(h: Header) -> list[Problem]:
    """Tensor types stock llama.cpp runs (the backbone, and the native head's ggml graph alike)."""
    problems = []
    for name, t in h.tensors.items():
        if C.is_head_tensor(name) and t.type not in HEAD_TYPES:
            problems.append(Problem("types", f"head tensor {name} is {t.type.name}, which the head does not run"))
        elif t.type not in BACKBONE_TYPES:
            problems.append(Problem("types", f"tensor {name} is {t.type.name}, which llama.cpp does not run as a weight"))
        elif name.endswith(C.F32_ONLY_SUFFIXES) and t.type != GT.F32:
            problems.append(Problem("types", f"tensor {name} is {t.type.name}; llama.cpp needs it in F32"))
        elif (len(t.dims) == 1 or name.endswith((".bias", "norm.weight"))) and t.type != GT.F32:  # ggml_add / ggml_mul operands
            message = f"tensor {name} is {t.type.name}; llama.cpp adds and multiplies 1-D tensors in F32 only (ggml aborts)"
            problems.append(Problem("types", message))
    if len(problems) > 1:  # one type problem usually repeats over many tensors: name the first, count the rest
        problems[1:] = [Problem("types", f"{len(problems) - 1} more tensors have types that cannot run")]
    return problems


# --- Tokenizer and decision metadata ----------------------------------------------------------------
def _string_array(h: Header, key: str) -> list[str] | None:
    f = h.fields.get(key)
    return f.value if f is not None and f.type == VT.ARRAY and f.item_type == VT.STRING else None


def check_tokenizer(h: Header) -> list[Problem]:
    """llama.cpp's BPE vocabulary (tokens, types, merges) and the special tokens the prompt template uses."""
    bad = []
    if h.get("tokenizer.ggml.model") != "gpt2":
        bad.append(f"tokenizer.ggml.model is {h.get('tokenizer.ggml.model')!r}, not 'gpt2' (byte-level BPE)")
    if h.get("tokenizer.ggml.pre") != C.BACKBONE_ARCH:
        bad.append(f"tokenizer.ggml.pre is {h.get('tokenizer.ggml.pre')!r}, not 'qwen35': prompts would tokenize differently")
    tokens = _string_array(h, "tokenizer.ggml.tokens")
    if not tokens:
        return [Problem("tokenizer", m) for m in [*bad, "tokenizer.ggml.tokens is missing or not a list of strings"]]
    types_field = h.fields.get("tokenizer.ggml.token_type")
    types = types_field.value if types_field is not None and types_field.item_type == VT.INT32 else None
    if types is None or len(types) != len(tokens):
        bad.append(f"tokenizer.ggml.token_type must be {len(tokens)} INT32 values, one per token")
        types = None
    elif min(types) < 1 or max(types) > max(gguf.TokenType):
        bad.append("tokenizer.ggml.token_type holds values that are not token types")
    merges = _string_array(h, "tokenizer.ggml.merges")
    if not merges:
        bad.append("tokenizer.ggml.merges is missing or empty: llama.cpp refuses a BPE vocabulary without merges")
    elif min(map(str.find, merges, repeat(" "), repeat(1))) < 0:  # str.find(m, " ", 1) over ~250k merges, in C
        bad.append("tokenizer.ggml.merges holds entries that are not two tokens separated by a space")
    # llama.cpp renames an empty token i to "[EMPTY_i]" and asserts (aborts) when two tokens share a text.
    if len(set(t or f"[EMPTY_{i}]" for i, t in enumerate(tokens))) != len(tokens):
        bad.append("tokenizer.ggml.tokens holds the same token twice (llama.cpp reads an empty token i as [EMPTY_i])")
    for key in (k for k in h.fields if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")):
        f = h.fields[key]
        if f.type != VT.UINT32 or not 0 <= f.value < len(tokens):
            bad.append(f"{key} = {f.value!r} is not a UINT32 token id below {len(tokens)}")
    bad += _template_tokens(tokens, types)
    return [Problem("tokenizer", m) for m in bad]


def _template_tokens(tokens: list[str], types: list[int] | None) -> list[str]:
    ids = {t: tokens.index(t) for t in C.TEMPLATE_SPECIAL_TOKENS if t in tokens}
    missing = [t for t in C.TEMPLATE_SPECIAL_TOKENS if t not in ids]
    if missing:
        return [f"the vocabulary lacks the prompt template's special tokens {', '.join(missing)}"]
    plain = [t for t, i in ids.items() if types is not None and types[i] not in _SPECIAL_TOKEN_TYPES]
    if plain:
        return [
            f"the prompt template's special tokens {', '.join(plain)} are not CONTROL or USER_DEFINED tokens: "
            "llama.cpp would split them"
        ]
    return []


def check_decision_metadata(h: Header) -> list[Problem]:
    """The decision contract: architecture, decision type, and a systemone template the runtime renders."""
    bad = []
    for key, want in {"general.architecture": C.ARCH, C.KEY_DECISION_TYPE: C.DECISION_TYPE}.items():
        if h.get(key) != want:
            bad.append(f"{key} is {h.get(key)!r}; a Clef decision model has {want!r}")
    if h.get(C.KEY_NORMALIZER, "NFC") not in ("NFC", "none"):
        bad.append(f"{C.KEY_NORMALIZER} is {h.get(C.KEY_NORMALIZER)!r}, not 'NFC' or 'none'")
    text = h.get(C.KEY_TEMPLATE)
    if not isinstance(text, str):
        bad.append(f"{C.KEY_TEMPLATE} (the prompt) is missing")
    else:
        try:
            PromptTemplate(text)
        except ModelFileError as e:
            bad.append(str(e))
    return [Problem("decision", m) for m in bad]


def old_layout(h: Header) -> bool:
    """A file in clef-gguf 0.1.0's own layout (decision type joint_schema, head.* tensors)."""
    return h.get(C.KEY_DECISION_TYPE) == OLD_DECISION_TYPE or any(n.startswith(OLD_HEAD_PREFIX) for n in h.tensors)


# --- Judging a parsed header --------------------------------------------------------------------------
@dataclass
class _Findings:
    problems: list[Problem] = field(default_factory=list)
    counts: Counts = Counts()
    notes: list[str] = field(default_factory=list)
    decision: bool = False  # the file claims to be a decision model


def _judge_header(h: Header, file_size: int) -> _Findings:
    tensors = h.tensors
    n_head = sum(C.is_head_tensor(n) for n in tensors)
    arch = h.get("general.architecture")
    found = _Findings(decision=arch == C.ARCH or C.KEY_DECISION_TYPE in h.fields or n_head > 0)
    found.problems += check_layout(h, file_size)
    tokens = h.get("tokenizer.ggml.tokens")
    counts = {"tensors": len(tensors), "backbone": len(tensors) - n_head, "head": n_head}
    counts["vocab"] = len(tokens) if isinstance(tokens, list) else 0
    if arch not in (C.ARCH, C.BACKBONE_ARCH) and not found.decision:
        found.counts = Counts(**counts)
        return found
    if found.decision and old_layout(h):
        found.problems.append(Problem("layout", OLD_LAYOUT_MESSAGE))
        found.counts = Counts(**counts)
        return found
    prefix = C.ARCH if arch == C.ARCH else C.BACKBONE_ARCH
    shape, problems = backbone_shape(h, prefix)
    found.problems += problems
    if shape is not None:
        problems, counts["backbone_expected"] = check_backbone(h, shape)
        found.problems += problems
    found.problems += check_tokenizer(h)
    found.problems += check_types(h)
    if found.decision:
        found.problems += check_decision_metadata(h)
        config, problems = head_config(h, shape.n_embd if shape else None)
        found.problems += problems
        if config is not None:
            problems, counts["head_expected"] = check_head(h, config)
            found.problems += problems
        found.notes += _notes(h)
    found.counts = Counts(**counts)
    return found


def _notes(h: Header) -> list[str]:
    notes = []
    digest = h.get(C.KEY_REFERENCE_SHA256)
    if digest is not None and digest != C.REFERENCE_SHA256:
        notes.append(f"converted from a joint_schema_model.py with sha256 {digest!r}, not the one this version implements")
    return notes


def _verdict(found: _Findings) -> Verdict:
    if any(p.corrupt for p in found.problems):
        return Verdict.CORRUPT
    if not found.decision:
        return Verdict.NOT_A_DECISION_MODEL
    return Verdict.INCOMPLETE if found.problems else Verdict.COMPLETE


def _type_summary(h: Header) -> dict[str, int]:
    types: dict[str, int] = {}
    for t in h.tensors.values():
        types[t.type.name] = types.get(t.type.name, 0) + 1
    return types


def _summary(verdict: Verdict, found: _Findings, h: Header | None, source: str) -> str:
    c, problems = found.counts, found.problems
    if verdict is Verdict.CORRUPT:
        first = next(p for p in problems if p.corrupt)
        return f"corrupt or unreadable: {first.message}"
    if verdict is Verdict.INCOMPLETE:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        return f"incomplete or inconsistent Clef file: {problems[0].message}{more}"
    if verdict is Verdict.COMPLETE:
        backbone_types = sorted({t.type.name for n, t in h.tensors.items() if not C.is_head_tensor(n)}) if h else []
        return (
            f"complete Clef decision model: {c.backbone} backbone tensors ({'/'.join(backbone_types)}) + "
            f"{c.head} head tensors, {c.vocab} tokens"
        )
    return _not_a_decision_model(found, h, source)


def _not_a_decision_model(found: _Findings, h: Header | None, source: str) -> str:
    arch = h.get("general.architecture") if h else None
    if arch != C.BACKBONE_ARCH:
        return (
            f"a GGUF of architecture {arch!r} with {found.counts.tensors} tensors, not a Clef decision model "
            f"(no {C.KEY_DECISION_TYPE}, no head tensors)"
        )
    name, routing, layers = RELEASED_HEAD
    c = found.counts
    what = (
        "this file can generate text but cannot make decisions"
        if not found.problems
        else f"this file cannot make decisions, and its backbone has problems: {found.problems[0].message}"
    )
    remedy = (
        f"Add the head with `clef-gguf graft {Path(source).name} RELEASE -o OUT.gguf` (RELEASE: the Clef release, "
        "e.g. cloudflare/Clef-flash), or convert the release again with `clef-gguf convert`"
    )
    n_head, n_reference = C.head_tensor_count(routing, layers), C.reference_tensor_count(routing, layers)
    return (
        f"{c.backbone} backbone tensors, 0 of the {n_head} head tensors of {name} (the {n_reference} of "
        f"joint_head.safetensors): {what}. {remedy}"
    )


def printable(text: str, limit: int = 600) -> str:
    """One line of bounded length: messages quote keys, names and values read from the file, which may hold anything."""
    if text.isprintable() and len(text) <= limit:
        return text
    clean = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[: limit + 1])
    return clean[:limit] + ("..." if len(clean) > limit or len(text) > limit else "")


def _report(source: str, found: _Findings, h: Header | None, file_size: int | None, started: float, **extra: Any) -> Report:
    verdict = _verdict(found)
    arch = h.get("general.architecture") if h else None
    return Report(
        source=source,
        verdict=verdict,
        summary=printable(_summary(verdict, found, h, source), limit=1000),
        problems=tuple(Problem(p.check, printable(p.message), p.corrupt) for p in found.problems),
        counts=found.counts,
        architecture=printable(arch, limit=100) if isinstance(arch, str) else None,
        file_size=file_size,
        header_size=h.data_offset if h else None,
        tensor_types=_type_summary(h) if h else {},
        notes=tuple(printable(n) for n in found.notes),
        seconds=round(time.perf_counter() - started, 4),
        **extra,
    )


# --- Deep checks --------------------------------------------------------------------------------------
_CHUNK_BYTES = 8 << 20


# No trained weight comes near this: products of such values overflow float32 (3e38 gave Inf scores).
MAX_WEIGHT = 1e20


def _values(raw: np.ndarray, qtype: GT) -> np.ndarray | None:
    """`raw` (whole blocks of `qtype`) as float32; None when gguf-py cannot decode it."""
    if qtype == GT.F32:
        return raw.view(np.float32)
    if qtype == GT.F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == GT.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if not _dequantizable(qtype):
        return None
    with np.errstate(all="ignore"):  # a NaN scale is a finding, not a warning on stderr
        return gguf.quants.dequantize(raw, qtype)


def check_data(f: GGUFFile) -> tuple[list[Problem], list[str]]:
    """Reads every tensor: NaN, Inf or overflowing values, and matrices of zeros (a sparse or interrupted download).

    Vectors may be all zeros (biases often are), matrices may not.
    """
    problems, skipped = [], []
    for name, t in f.header.tensors.items():
        _, type_size = gguf.GGML_QUANT_SIZES[t.type]
        step = max(type_size, _CHUNK_BYTES // type_size * type_size)
        data = f.tensor_bytes(name)
        bad, zeros, unknown = None, True, False
        for start in range(0, t.n_bytes, step):
            chunk = data[start : start + step]
            zeros = zeros and not chunk.any()
            values = _values(chunk, t.type)
            if values is None:
                unknown = True
                continue
            with np.errstate(all="ignore"):
                if not np.isfinite(values).all():
                    bad = "holds NaN or Inf values"
                elif np.abs(values).max(initial=0) > MAX_WEIGHT:
                    bad = f"holds values of magnitude {float(np.abs(values).max()):.3g}, which overflow float32 arithmetic"
            if bad:
                break
        if bad:
            problems.append(_corrupt("data", f"tensor {name} {bad}"))
        elif zeros and len(t.dims) > 1 and t.dims[1] > 1:
            problems.append(_corrupt("data", f"tensor {name} is all zeros: a sparse or interrupted download?"))
        if unknown:
            skipped.append(name)
    notes = (
        [f"--deep could not decode {len(skipped)} tensors of types gguf-py does not read (their values unchecked)"]
        if skipped
        else []
    )
    return problems, notes


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# --- Entry points -----------------------------------------------------------------------------------
def _normalize_sha256(sha256: str | None) -> str | None:
    if sha256 is None:
        return None
    if not re.fullmatch(r"[0-9a-fA-F]{64}", sha256.strip()):
        raise ValueError(f"--sha256 must be 64 hex digits, not {sha256!r}")
    return sha256.strip().lower()


def _open_map(path: Path) -> tuple[mmap.mmap | None, int, list[Problem]]:
    try:
        with path.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                return None, 0, [_corrupt("source", EMPTY)]
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), size, []
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return None, 0, [_corrupt("source", f"cannot read {path}: {reason}")]


def _judge_local(path: Path, deep: bool, sha256: str | None, started: float) -> tuple[Report, GGUFFile | None]:
    mapped, size, problems = _open_map(path)
    if mapped is None:
        return _report(str(path), _Findings(problems=problems), None, None, started), None
    view = memoryview(mapped)[: min(size, MAX_HEADER_BYTES)]  # parsing never looks past the limit
    try:
        header, problems, _ = parse_prefix(view, size)
    finally:
        view.release()
    if header is None:
        mapped.close()
        return _report(str(path), _Findings(problems=problems), None, size, started), None
    found = _judge_header(header, size)
    f = GGUFFile(path, mapped, header)
    extra: dict[str, Any] = {"deep": deep}
    if deep and not any(p.check == "layout" for p in found.problems):
        problems, notes = check_data(f)
        found.problems += problems
        found.notes += notes
    if sha256 is not None:
        extra["sha256"] = actual = file_sha256(path)
        if actual != sha256:
            found.problems.append(
                _corrupt("sha256", f"sha256 is {actual}, expected {sha256}: the file is damaged or another file")
            )
    return _report(str(path), found, header, size, started, **extra), f


def _fetch_header(reader: Any) -> tuple[Header | None, list[Problem]]:
    """Fetch a growing prefix until the header parses: each fetch at least doubles it, up to MAX_HEADER_BYTES."""
    buf = reader.read(0, FIRST_FETCH)
    for _ in range(MAX_FETCHES):
        header, problems, more = parse_prefix(buf, reader.size or len(buf))
        if more is None:
            return header, problems
        chunk = reader.read(len(buf), more)
        if not chunk:
            break
        buf += chunk
    return None, [_corrupt("source", f"the server sent no more than {len(buf)} bytes of the header")]


def validate_remote(reader: Any) -> Report:
    """Header-only validation through `reader`: remote.RangeReader, or anything with `source`,
    `size` (known after the first read), `bytes_read` and `read(start, end) -> bytes`."""
    started = time.perf_counter()
    try:
        header, problems = _fetch_header(reader)
    except ModelFileError as e:
        return _report(reader.source, _Findings(problems=[_corrupt("source", str(e))]), None, None, started)
    extra = {"bytes_read": reader.bytes_read}
    if header is None:
        return _report(reader.source, _Findings(problems=problems), None, reader.size, started, **extra)
    found = _judge_header(header, reader.size or 0)
    return _report(reader.source, found, header, reader.size, started, **extra)


def validate(source: str | os.PathLike[str], deep: bool = False, sha256: str | None = None) -> Report:
    """Judge a GGUF file: a local path, `REPO_ID[@REVISION]:FILENAME` on the Hub, or an http(s) URL.

    Never raises for what the file holds: the Report says it. Header-only unless `deep`
    (reads every tensor) or `sha256` (hashes the file), which need a local file.
    """
    from .remote import RangeReader, is_remote

    started = time.perf_counter()
    expected = _normalize_sha256(sha256)
    text = os.fspath(source)
    if is_remote(text) and not Path(text).exists():
        if deep or expected:
            raise ValueError("--deep and --sha256 read the whole file: download it, then validate the local copy")
        return validate_remote(RangeReader(text))
    report, f = _judge_local(Path(text), deep, expected, started)
    if f is not None:
        f.close()
    return report


def open_validated(path: str | os.PathLike[str]) -> GGUFFile:
    """Map a GGUF file for the runtime after a header-only validation; raise validate's error unless complete."""
    report, f = _judge_local(Path(path), deep=False, sha256=None, started=time.perf_counter())
    if not report.ok:
        if f is not None:
            f.close()
        report.raise_for_verdict()
    assert f is not None
    return f

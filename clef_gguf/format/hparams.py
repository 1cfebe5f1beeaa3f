"""A Clef (or qwen35) file's hyperparameters, read once, the way llama.cpp reads them.

The one reader of them: validate reports its problems, and graft, plan, the views and
the runtime build from its BackboneShape and HeadConfig. Types, defaults and checks are
llama.cpp's (its qwen35 and Clef loaders): a value llama.cpp would refuse is a problem
here, and one it derives (recurrent layers from full_attention_interval) is derived here.
An mmproj's (the vision tower's) keys too, as the vendored clip.cpp reads them (read_vision_hparams).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gguf import GGUFValueType as VT
from gguf import Keys

from ..errors import IncompleteModelError
from . import contract as C
from . import vision as V
from .header import Field, Header

# Limits no real model comes near: a count or width beyond them is a corrupt or hostile file.
MAX_LAYERS = 512  # LLAMA_MAX_LAYERS
MAX_WIDTH = 1 << 20  # any width, head count or vocabulary-sized dimension
MAX_HEAD_LAYERS = 64
MAX_HEAD_COUNT = 4096


class _Reader:
    """Reads `<prefix>.<suffix>` keys with llama.cpp's types and defaults; collects what is wrong."""

    def __init__(self, h: Header, prefix: str) -> None:
        self.h, self.prefix = h, prefix
        self.problems: list[str] = []

    def bad(self, message: str) -> None:
        self.problems.append(message)

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


def read_backbone_shape(h: Header, prefix: str) -> tuple[C.BackboneShape | None, list[str]]:
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
    tokens = h.get(Keys.Tokenizer.LIST)
    n_vocab = len(tokens) if isinstance(tokens, list) else 0
    # The shape's fields, each of which must be usable (none missing, none zero).
    values = {"n_vocab": n_vocab, "n_embd": n_embd, "n_ff": n_ff, "n_layer": n_layer, "n_head": n_head, "n_head_kv": n_head_kv}
    values |= {"head_dim": head_dim, "recurrent": recurrent, "conv_kernel": conv_kernel, "k_heads": k_heads, "v_heads": v_heads}
    values["linear_head_dim"] = state
    if any(not v for v in values.values()):
        return None, r.problems
    return C.BackboneShape(**values, tied=C.OUTPUT not in h.tensors), r.problems


def read_head_config(h: Header, n_embd: int | None) -> tuple[C.HeadConfig | None, list[str]]:
    """The head's config as llama.cpp's Clef loader reads it: counts from clef.decision.* (UINT32), widths
    from tensor shapes (contract.HEAD_WIDTH_TENSORS), bounded before any shape is derived."""
    problems = []
    counts: dict[str, int] = {}
    keys = {"routing_layers": C.KEY_ROUTING_BLOCKS, "layers": C.KEY_JOINT_BLOCKS, "heads": C.KEY_HEAD_COUNT}
    for name, key in keys.items():
        f = h.fields.get(key)
        low, high = (1, MAX_HEAD_COUNT) if name == "heads" else (0, MAX_HEAD_LAYERS)
        if f is None:
            problems.append(f"{key} is missing")
        elif f.type != VT.UINT32:  # llama.cpp reads it as a uint32 and refuses another type
            problems.append(f"{key} is stored as {f.type.name}, not UINT32")
        elif not low <= f.value <= high:
            problems.append(f"{key} = {f.value} is outside [{low}, {high}]")
        else:
            counts[name] = f.value
    eps = h.fields.get(C.KEY_HEAD_NORM_EPS)
    if eps is None or eps.type != VT.FLOAT32 or not 0 < eps.value < 1:
        message = f"{C.KEY_HEAD_NORM_EPS} (the head's LayerNorm epsilon) is missing or not a FLOAT32 in (0, 1)"
        problems.append(message)
    widths = {}
    for name, tensor in C.HEAD_WIDTH_TENSORS.items():
        t = h.tensors.get(tensor)
        if t is None or len(t.dims) != 2 or not 1 <= t.dims[1] <= MAX_WIDTH:
            problems.append(f"{tensor}, whose rows give the head's {name}, is missing or not 2-D")
        else:
            widths[name] = t.dims[1]
    if problems or n_embd is None:
        return None, problems
    config = C.HeadConfig(hidden_size=n_embd, **widths, **counts, norm_eps=float(eps.value))
    if config.width % config.heads:
        message = f"the head's width {config.width} is not a multiple of {C.KEY_HEAD_COUNT} = {config.heads}"
        return None, [message]
    return config, []


def prefix_of(h: Header) -> str:
    """The key prefix of the backbone's hyperparameters: clef.* in a Clef file, qwen35.* in a backbone-only one."""
    return C.ARCH if h.get(Keys.General.ARCHITECTURE) == C.ARCH else C.BACKBONE_ARCH


def context_length(h: Header) -> int:
    """The training context (`<prefix>.context_length`), as the shape's reader checks it."""
    r = _Reader(h, prefix_of(h))
    value = r.uint("context_length", 1, 1 << 24)
    if value is None:
        raise IncompleteModelError(r.problems[0])
    return value


def backbone_shape(h: Header, what: str = "the file") -> C.BackboneShape:
    """The backbone's shape, or IncompleteModelError naming the first problem (validate lists them all)."""
    shape, problems = read_backbone_shape(h, prefix_of(h))
    if shape is None or problems:
        raise IncompleteModelError(f"{what}: {problems[0] if problems else 'no usable backbone hyperparameters'}")
    return shape


def head_config(h: Header, what: str = "the file") -> C.HeadConfig:
    """The head's config, or IncompleteModelError naming the first problem."""
    config, problems = read_head_config(h, backbone_shape(h, what).n_embd)
    if config is None:
        raise IncompleteModelError(f"{what}: {problems[0]}")
    return config


# --- An mmproj (the vision tower, format/vision.py) ----------------------------------------------------
MAX_IMAGE_SIZE = 8192  # clip.cpp refuses larger (clip.cpp:2047-2050)
MAX_PATCH_SIZE = 65535


@dataclass(frozen=True)
class VisionDescription:
    """What the runtime needs to know of a validated mmproj (none of it parsed again)."""

    projector: str
    shape: V.VisionShape
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    min_pixels: int | None  # clef-gguf's keys (format/vision.CLEF_KEYS); None in a file of llama.cpp's converter
    max_pixels: int | None

    @property
    def embedding_width(self) -> int:
        """The width of the image embeddings clip.cpp hands the text model (clip_n_mmproj_embd)."""
        return self.shape.out_width


INT32_MAX = (1 << 31) - 1  # clip.cpp reads the pixel limits into ints
MAX_NORMALIZED_PIXEL = 1e4


def _float_triple(r: _Reader, key: str) -> tuple[float, ...] | None:
    f = r.h.fields.get(key)
    if f is None or f.type != VT.ARRAY or f.item_type != VT.FLOAT32 or len(f.value) < 3:
        r.bad(f"{key} must be an array of at least 3 FLOAT32 values (clip.cpp refuses anything else)")
        return None
    values = tuple(float(v) for v in f.value[:3])
    if not all(math.isfinite(v) for v in values):
        r.bad(f"{key} = {list(values)} is not finite")
        return None
    return values


def _pixel_limits(r: _Reader) -> tuple[int | None, int | None]:
    low = r.uint("image_min_pixels", 1, INT32_MAX, default=0) or None
    high = r.uint("image_max_pixels", 1, INT32_MAX, default=0) or None
    if (low is None) != (high is None):
        r.bad(f"{V.KEY_IMAGE_MIN_PIXELS} and {V.KEY_IMAGE_MAX_PIXELS} come together: only one is set")
        return None, None
    if low is not None and high is not None and low > high:
        r.bad(f"{V.KEY_IMAGE_MIN_PIXELS} {low} exceeds {V.KEY_IMAGE_MAX_PIXELS} {high}")
        return None, None
    return low, high


def read_vision_hparams(h: Header) -> tuple[VisionDescription | None, list[str]]:
    """An mmproj's qwen3vl_merger keys as the vendored clip.cpp reads them (types, ranges, what its graph
    asserts); the description when all are usable, else the problems (check/mmproj.py reports them)."""
    r = _Reader(h, "clip.vision")
    n_embd = r.uint("embedding_length", 1, MAX_WIDTH)
    n_head = r.uint("attention.head_count", 1, MAX_WIDTH)
    n_ff = r.uint("feed_forward_length", 1, MAX_WIDTH)
    n_layer = r.uint("block_count", 1, MAX_LAYERS)
    projection = r.uint("projection_dim", 1, MAX_WIDTH)
    image_size = r.uint("image_size", 1, MAX_IMAGE_SIZE)
    patch = r.uint("patch_size", 1, MAX_PATCH_SIZE)
    r.float("attention.layer_norm_epsilon", 0.0, 1.0)
    merge = r.uint("spatial_merge_size", 1, MAX_PATCH_SIZE, default=V.MERGE_SIZE)
    if merge is not None and merge != V.MERGE_SIZE:
        r.bad(f"{V.KEY_SPATIAL_MERGE_SIZE} is {merge}: llama.cpp's qwen3vl graph merges 2 x 2 patches, whatever the key says")
    if n_embd and n_head:
        if n_embd % n_head:
            r.bad(f"{V.KEY_EMBEDDING_LENGTH} {n_embd} is not a multiple of {V.KEY_HEAD_COUNT} {n_head}")
        elif (n_embd // n_head) % 4:
            # Its M-RoPE gives each head d_head/4 dims per section and asserts n_dims == d_head/2: an abort otherwise.
            r.bad(f"the attention heads are {n_embd // n_head} wide, not a multiple of 4 (llama.cpp's qwen3vl rope aborts)")
    gelu = h.fields.get(V.KEY_USE_GELU)
    if gelu is None or gelu.type != VT.BOOL or gelu.value is not True:
        shown = "missing" if gelu is None else f"{gelu.value!r} ({gelu.type.name})"
        r.bad(f"{V.KEY_USE_GELU} is {shown}, not true: clip.cpp would run another activation than the tower's GELU")
    elif h.get(V.KEY_USE_SILU) is True:
        r.bad(f"{V.KEY_USE_GELU} and {V.KEY_USE_SILU} are both true (clip.cpp refuses the file)")
    mean, std = _float_triple(r, V.KEY_IMAGE_MEAN), _float_triple(r, V.KEY_IMAGE_STD)
    if std is not None and min(abs(v) for v in std) == 0:
        r.bad(f"{V.KEY_IMAGE_STD} = {list(std)}: pixels are divided by it")
        std = None
    elif mean is not None and std is not None:
        # A pixel in [0, 1] becomes (x - mean) / std: far beyond a few thousand, the tower's activations overflow
        # (F16 on a device) and every image's answer is NaN. Real towers: |mean| < 1, std about 0.25 to 0.5.
        largest = max(max(abs(m), abs(1 - m)) / abs(d) for m, d in zip(mean, std, strict=True))
        if largest > MAX_NORMALIZED_PIXEL:
            r.bad(f"{V.KEY_IMAGE_MEAN} {list(mean)} and {V.KEY_IMAGE_STD} {list(std)} make pixels as large as {largest:.3g}")
    low, high = _pixel_limits(r)
    if high is not None and patch is not None:
        # The runtime hands mtmd its limits in whole tokens (ceil), and clip.cpp multiplies them back in an int32.
        per_token = V.pixels_per_token(patch)
        largest = INT32_MAX // per_token * per_token
        if high > largest:
            message = f"{V.KEY_IMAGE_MAX_PIXELS} {high} is over {largest}: llama.cpp counts it in tokens of {per_token} pixels"
            r.bad(f"{message}, in an int32")
    positions = h.tensors.get(V.POSITION_EMBD)
    merger_out = h.tensors.get(V.MERGER_OUT_BIAS)
    values = (n_embd, n_head, n_ff, n_layer, projection, image_size, patch, mean, std)
    if r.problems or any(v is None for v in values) or positions is None or merger_out is None or len(positions.dims) != 2:
        return None, r.problems
    shape = V.VisionShape(
        n_embd=n_embd,
        n_ff=n_ff,
        n_layer=n_layer,
        n_head=n_head,
        patch_size=patch,
        n_positions=positions.dims[1],
        out_width=merger_out.dims[0],
    )
    return VisionDescription(V.PROJECTOR, shape, image_size, mean, std, low, high), []

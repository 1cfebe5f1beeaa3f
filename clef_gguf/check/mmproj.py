"""Is a GGUF file a vision tower (mmproj) that llama.cpp's libmtmd loads for a Clef model? And is it this model's?

An mmproj is recognized by `general.architecture == "clip"`. It is checked as the vendored clip.cpp
of llama-cpp-python 0.3.36 reads a `qwen3vl_merger` file (format/vision.py): the keys it requires,
with the types it reads them as (gguf_get_val_* asserts the type: a wrong one aborts the process,
it is no error), the values its loader refuses or its qwen3vl graph asserts on, and every tensor
that graph uses, with the shape the keys imply. Verdicts and exit codes are validate's:

    complete              0  an mmproj of Qwen3.5's tower that clip.cpp can run
    corrupt               5  unreadable, truncated, bad offsets; --deep: NaN, Inf, zeros
    not_a_decision_model  6  a clip file of another projector (not Qwen3.5's vision tower)
    incomplete            7  a qwen3vl_merger file with missing or mismatched keys or tensors

A model and its mmproj are paired in check/pair.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType as VT

from ..format import contract as C
from ..format import vision as V
from ..format.header import Header
from ..format.hparams import MAX_LAYERS, MAX_WIDTH, _Reader
from .layout import check_layout
from .report import Counts, Findings, Problem, Verdict
from .tensors import _first, _same_dims

CHECK = "mmproj"
MAX_IMAGE_SIZE = 8192  # clip.cpp refuses larger (clip.cpp:2047-2050)
MAX_PATCH_SIZE = 65535
# clip.cpp reads these for every vision projector when present, each with one type (a wrong one aborts).
OPTIONAL_KEY_TYPES = {
    "clip.vision.attention.head_dim": VT.UINT32,
    "clip.vision.attention.head_count_kv": VT.UINT32,
    "clip.minicpmv_version": VT.INT32,
    "clip.minicpmv_query_num": VT.UINT32,
    "clip.vision.mm_patch_merge_type": VT.STRING,
    "clip.vision.n_wa_pattern": VT.UINT32,
    V.KEY_USE_SILU: VT.BOOL,
    V.KEY_HAS_AUDIO: VT.BOOL,
    "clip.has_gen_audio_encoder": VT.BOOL,
    V.KEY_NAME: VT.STRING,
    "general.description": VT.STRING,
}
# What clip.cpp runs the tower's tensors in: the converter's types (F32 vectors and positions; the patch kernel
# F32 or F16, ggml's im2col writes no other type); matrices in any type ggml's matrix product reads.
VECTOR_TYPES = frozenset({GT.F32})
PATCH_TYPES = frozenset({GT.F32, GT.F16})


def is_mmproj(h: Header) -> bool:
    return h.get(V.KEY_ARCH) == V.ARCH


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


def _projector(h: Header) -> tuple[str | None, list[Problem]]:
    for key in (V.KEY_PROJECTOR, V.KEY_VISION_PROJECTOR):  # clip.cpp's order
        f = h.fields.get(key)
        if f is None:
            continue
        if f.type != VT.STRING:
            return None, [Problem(CHECK, f"{key} is stored as {f.type.name}; clip.cpp reads it as STRING (and aborts)")]
        return f.value, []
    return None, [Problem(CHECK, f"{V.KEY_PROJECTOR} is missing: clip.cpp cannot tell which projector this file holds")]


def _encoders(h: Header) -> list[Problem]:
    problems = []
    for key, want in ((V.KEY_HAS_VISION, True), (V.KEY_HAS_AUDIO, False)):
        f = h.fields.get(key)
        if f is not None and f.type != VT.BOOL:
            problems.append(Problem(CHECK, f"{key} is stored as {f.type.name}; clip.cpp reads it as BOOL (and aborts)"))
        elif bool(f.value if f is not None else False) != want:
            what = "clip.cpp loads no vision encoder without it" if want else "Clef's mmproj holds a vision tower only"
            problems.append(Problem(CHECK, f"{key} is {'missing' if f is None else f.value}, not {want}: {what}"))
    return problems


def _optional_types(h: Header) -> list[Problem]:
    return [
        Problem(CHECK, f"{key} is stored as {h.fields[key].type.name}; clip.cpp reads it as {want.name} (and aborts)")
        for key, want in OPTIONAL_KEY_TYPES.items()
        if key in h.fields and h.fields[key].type != want
    ]


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
    low = r.uint("image_min_pixels", 1, (1 << 31) - 1, default=0) or None
    high = r.uint("image_max_pixels", 1, (1 << 31) - 1, default=0) or None
    if (low is None) != (high is None):
        r.bad(f"{V.KEY_IMAGE_MIN_PIXELS} and {V.KEY_IMAGE_MAX_PIXELS} come together: only one is set")
        return None, None
    if low is not None and high is not None and low > high:
        r.bad(f"{V.KEY_IMAGE_MIN_PIXELS} {low} exceeds {V.KEY_IMAGE_MAX_PIXELS} {high}")
        return None, None
    return low, high


def vision_keys(h: Header) -> tuple[VisionDescription | None, list[Problem]]:
    """The qwen3vl_merger keys as clip.cpp reads them (types, ranges); the description when all are usable."""
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
    low, high = _pixel_limits(r)
    positions = h.tensors.get(V.POSITION_EMBD)
    merger_out = h.tensors.get(V.MERGER_OUT_BIAS)
    values = (n_embd, n_head, n_ff, n_layer, projection, image_size, patch, mean, std)
    if r.problems or any(v is None for v in values) or positions is None or merger_out is None or len(positions.dims) != 2:
        return None, [Problem(CHECK, m) for m in r.problems]
    shape = V.VisionShape(
        n_embd=n_embd,
        n_ff=n_ff,
        n_layer=n_layer,
        n_head=n_head,
        patch_size=patch,
        n_positions=positions.dims[1],
        out_width=merger_out.dims[0],
    )
    description = VisionDescription(V.PROJECTOR, shape, image_size, mean, std, low, high)
    return description, []


def _type_problems(h: Header) -> list[Problem]:
    bad = []
    for name, t in h.tensors.items():
        if name in V.PATCH_EMBEDDINGS:
            allowed = PATCH_TYPES
        elif len(t.dims) == 1 or name == V.POSITION_EMBD:
            allowed = VECTOR_TYPES
        else:
            allowed = C.WEIGHT_TYPES
        if t.type not in allowed:
            bad.append(f"{name} ({t.type.name}, clip.cpp runs it in {'/'.join(sorted(a.name for a in allowed))})")
    return [Problem(CHECK, f"tensor types clip.cpp cannot run: {_first(bad)}")] if bad else []


def vision_tensors(h: Header, d: VisionDescription) -> list[Problem]:
    """Every tensor the qwen3vl graph uses, with the shapes the keys imply; what it asserts is absent, absent."""
    expected = V.vision_tensor_shapes(d.shape)
    tensors = h.tensors
    bad: list[str] = []
    missing = [n for n in expected if n not in tensors]
    if missing:
        bad.append(f"{len(missing)} of the {len(expected)} vision tower tensors are missing: {_first(missing)}")
    wrong = [n for n, want in expected.items() if n in tensors and not _same_dims(tensors[n], want)]
    if wrong:
        n = wrong[0]
        more = f" ({len(wrong) - 1} more tensors differ)" if len(wrong) > 1 else ""
        bad.append(f"tensor {n} has shape {list(tensors[n].shape)}, the keys imply {list(expected[n])}{more}")
    if not V.is_square(d.shape.n_positions):
        bad.append(f"{V.POSITION_EMBD} holds {d.shape.n_positions} positions, not a square grid (clip.cpp aborts)")
    deepstack = [n for n in tensors if n.startswith("v.deepstack.")]
    if deepstack:
        bad.append(f"deepstack tensors ({_first(deepstack)}) widen the image embeddings beyond a Qwen3.5 backbone's")
    if "v.class_embd" in tensors:
        bad.append("v.class_embd is present: llama.cpp's qwen3vl graph asserts it is not (and aborts)")
    declared = h.get(V.KEY_PROJECTION_DIM)
    if d.shape.out_width != declared:
        bad.append(f"{V.KEY_PROJECTION_DIM} is {declared}, but {V.MERGER_OUT_BIAS} makes {d.shape.out_width}-wide embeddings")
    return [Problem(CHECK, m) for m in bad] + _type_problems(h)


def judge_mmproj(h: Header, file_size: int) -> Findings:
    """validate's findings for a clip file (validate.judge_header hands them over)."""
    found = Findings(counts=Counts(tensors=len(h.tensors)), summarize=summary)
    found.problems += check_layout(h, file_size)
    projector, problems = _projector(h)
    found.problems += problems + _encoders(h) + _optional_types(h)
    # A clip file of another projector is not Clef's tower (verdict 6); one whose projector cannot be read is
    # an incomplete file (7), of whatever it was meant to be.
    found.decision = projector in (V.PROJECTOR, None)
    if projector != V.PROJECTOR:
        if projector is not None:
            found.notes.append(f"projector {projector!r}")
        return found
    description, problems = vision_keys(h)
    found.problems += problems
    if description is not None:
        found.problems += vision_tensors(h, description)
    elif not problems:
        found.problems.append(Problem(CHECK, f"{V.POSITION_EMBD} or {V.MERGER_OUT_BIAS} is missing or mis-shaped"))
    if description is not None and description.min_pixels is None:
        found.notes.append(
            f"no image pixel limits ({V.KEY_IMAGE_MIN_PIXELS}, {V.KEY_IMAGE_MAX_PIXELS}: llama.cpp's converter writes none); "
            "llama.cpp's own for Qwen-VL apply, 8 to 4096 image tokens, unless the runtime is told the release's"
        )
    return found


def describe_mmproj(h: Header) -> VisionDescription | None:
    """The description of an mmproj that validates (None otherwise)."""
    description, problems = vision_keys(h)
    return description if description is not None and not problems else None


def summary(verdict: Verdict, found: Findings, h: Header | None) -> str:
    """The one line validate prints for a clip file."""
    problems = found.problems
    if verdict is Verdict.CORRUPT:
        return f"corrupt or unreadable: {next(p for p in problems if p.corrupt).message}"
    if verdict is Verdict.NOT_A_DECISION_MODEL:
        what = found.notes[0]
        return (
            f"an mmproj of {what}, not of Clef's vision tower (projector {V.PROJECTOR!r}, Qwen3.5's): "
            "convert the Clef release with `clef-gguf convert` to get its mmproj"
            + (f"; it also has problems: {problems[0].message}" if problems else "")
        )
    if verdict is Verdict.INCOMPLETE:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        return f"incomplete or inconsistent mmproj: {problems[0].message}{more}"
    assert h is not None
    d = describe_mmproj(h)
    assert d is not None
    types = "/".join(sorted({t.type.name for t in h.tensors.values()}))
    s = d.shape
    return (
        f"complete mmproj ({V.PROJECTOR}): {len(h.tensors)} tensors ({types}), a {s.n_layer}-block vision tower "
        f"{s.n_embd} wide, {s.patch_size}-pixel patches, image embeddings {d.embedding_width} wide"
    )

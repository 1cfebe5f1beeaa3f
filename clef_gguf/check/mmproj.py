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

from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType as VT
from gguf import Keys

from ..format import contract as C
from ..format import vision as V
from ..format.header import Header
from ..format.hparams import VisionDescription, read_vision_hparams
from .layout import check_layout
from .report import Counts, Findings, Problem, Verdict
from .tensors import _first, _same_dims

CHECK = "mmproj"
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
    Keys.General.NAME: VT.STRING,
    Keys.General.DESCRIPTION: VT.STRING,
}
# What clip.cpp runs the tower's tensors in: the converter's types (F32 vectors and positions; the patch kernel
# F32 or F16, ggml's im2col writes no other type); matrices in any type ggml's matrix product reads.
VECTOR_TYPES = frozenset({GT.F32})
PATCH_TYPES = frozenset({GT.F32, GT.F16})


def is_mmproj(h: Header) -> bool:
    return h.get(Keys.General.ARCHITECTURE) == V.ARCH


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


def vision_keys(h: Header) -> tuple[VisionDescription | None, list[Problem]]:
    """The qwen3vl_merger keys as clip.cpp reads them (format/hparams.py); the description when all are usable."""
    description, problems = read_vision_hparams(h)
    return description, [Problem(CHECK, m) for m in problems]


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
    # Blocks past the key's count are loaded by nobody: clip.cpp would run the first n_layer and answer otherwise.
    blocks = {int(n.split(".")[2]) for n in tensors if n.startswith("v.blk.") and n.split(".")[2].isdigit()}
    beyond = sorted(blocks - set(range(d.shape.n_layer)))
    if beyond:
        n = d.shape.n_layer
        bad.append(
            f"{len(beyond)} vision blocks past {V.KEY_BLOCK_COUNT} {n} have tensors (v.blk.{beyond[0]}.*): "
            f"clip.cpp would run only the first {n} blocks of the tower"
        )
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

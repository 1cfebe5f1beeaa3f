"""validate MODEL --mmproj MMPROJ: both files validated, then whether the mmproj is this model's vision tower.

What mtmd_init_from_file compares (the image embeddings' width, clip_n_mmproj_embd, against the text
model's), and what an image prompt needs of the model (the tokens that bracket each image). Then, by content,
which release's tower it is: a model file convert wrote records the fingerprint of its release's tower
(format/lineage.KEY_SOURCE_VISION), and the mmproj's own tensors are fingerprinted (format/vision.tower_fingerprint),
so that another release's tower of the same width is refused whatever its keys say. A model file without that key
(llama.cpp's converter writes none) is paired by the width alone, and the basis says so.
"""

from __future__ import annotations

import os
from dataclasses import replace

from gguf import Keys

from ..errors import IncompleteModelError, ModelFileError, NotADecisionModelError
from ..format import lineage as L
from ..format import vision as V
from ..format.header import GGUFFile, Header
from ..format.hparams import VisionDescription, backbone_shape
from .mmproj import describe_mmproj, is_mmproj
from .report import PairReport, Problem, Report, Verdict
from .validate import judge_source


def _vision_tokens(model: Header) -> list[str]:
    tokens = model.get(Keys.Tokenizer.LIST)
    present = set(tokens) if isinstance(tokens, list) else set()
    return [t for t in V.VISION_TOKENS if t not in present]


def check_pairing(model: Header, mmproj: Header) -> list[Problem]:
    """What mtmd_init_from_file compares (the embeddings' width) and what an image prompt needs of the model."""
    d = describe_mmproj(mmproj)
    if d is None:
        return [Problem("pairing", "the mmproj does not validate, so it cannot be paired")]
    problems = []
    n_embd = backbone_shape(model, "the model").n_embd
    if n_embd != d.embedding_width:
        problems.append(
            Problem(
                "pairing",
                f"the mmproj's image embeddings are {d.embedding_width} wide, the model's hidden size is {n_embd}: "
                "not this model's vision tower (mtmd refuses the pair)",
            )
        )
    missing = _vision_tokens(model)
    if missing:
        problems.append(Problem("pairing", f"the model's vocabulary lacks {', '.join(missing)}, which bracket every image"))
    return problems


def mmproj_fingerprint(mmproj: GGUFFile) -> str:
    """vision.tower_fingerprint of an mmproj that validates (its fingerprint tensors are F32: check/mmproj.py)."""
    tensors = mmproj.header.tensors.items()
    return V.tower_fingerprint(
        (name, t.shape, mmproj.tensor_bytes(name).view("<f4")) for name, t in tensors if V.is_fingerprint_tensor(name, t.shape)
    )


def check_lineage(model: Header, mmproj: GGUFFile | None) -> tuple[list[Problem], str]:
    """Whether `mmproj` (None: a remote file, whose tensors are not read) holds the tower of the release `model` was
    converted from: why not, or on what ground it does."""
    recorded = model.get(L.KEY_SOURCE_VISION)
    if not L.is_digest(recorded):
        return [], (
            f"the model records no vision tower fingerprint ({L.KEY_SOURCE_VISION}: llama.cpp's converter writes none), "
            "so only the width was compared: another release's tower of that width is not told from its own"
        )
    if mmproj is None:
        return [], "the mmproj is not local: its tensors were not read, so only the width was compared"
    found = mmproj_fingerprint(mmproj)
    if found != recorded:
        why = (
            f"the mmproj is another release's vision tower: its tensors' fingerprint is {found[:12]}..., the model's "
            f"release's tower is {recorded[:12]}... ({L.KEY_SOURCE_VISION})"
        )
        return [Problem("pairing", why)], ""
    return [], f"the vision tower of the model's release (its tensors' fingerprint {found[:12]}...)"


def _lineage_of_local(model: Header, mmproj: str | os.PathLike[str]) -> tuple[list[Problem], str]:
    if not os.path.exists(mmproj):  # (a Hub or URL source: read remotely, header only)
        return check_lineage(model, None)
    f = GGUFFile.open(mmproj)
    try:
        return check_lineage(model, f)
    finally:
        f.close()


def validate_pair(model: str | os.PathLike[str], mmproj: str | os.PathLike[str], *, deep: bool = False) -> PairReport:
    """Validate a model, an mmproj, and their pairing (each source local, on the Hub or a URL, as validate takes)."""
    model_report, model_header = judge_source(model, deep=deep)
    mmproj_report, mmproj_header = judge_source(mmproj, deep=deep)
    problems: list[Problem] = []
    if model_header is not None and is_mmproj(model_header) and model_report.verdict is not Verdict.CORRUPT:
        model_report = _wrong_kind(model_report, "a vision tower (mmproj), not a Clef model: give the model first")
    if mmproj_header is not None and not is_mmproj(mmproj_header) and mmproj_report.verdict is not Verdict.CORRUPT:
        arch = mmproj_header.get(Keys.General.ARCHITECTURE)
        mmproj_report = _wrong_kind(
            mmproj_report,
            f"a GGUF of architecture {arch!r}, not an mmproj (a vision tower has {Keys.General.ARCHITECTURE} {V.ARCH!r})",
        )
    basis = ""
    if model_report.ok and mmproj_report.ok and model_header is not None and mmproj_header is not None:
        problems += check_pairing(model_header, mmproj_header)
        if not problems:
            problems, basis = _lineage_of_local(model_header, mmproj)
    fits = f"model and mmproj belong together: {basis}; the image embeddings are as wide as the backbone's hidden size"
    names = ("model", "mmproj")
    misfit = "model and mmproj do not belong together"
    return PairReport(names, model_report, mmproj_report, tuple(problems), fits, misfit, basis or None)


def _wrong_kind(report: Report, summary_line: str) -> Report:
    """A sound file in the other slot of the pair: verdict 6, whatever it is on its own."""
    return replace(report, verdict=Verdict.NOT_A_DECISION_MODEL, summary=summary_line)


def open_vision(model: Header, mmproj: str | os.PathLike[str]) -> VisionDescription:
    """The description of a local mmproj for the runtime, after a header-only validation and the pairing
    check with this model's header; raises validate's error (or IncompleteModelError for a bad pair)."""
    if not os.path.exists(mmproj):  # (judge_source would read a URL remotely: libmtmd needs a local file)
        raise ModelFileError(f"{mmproj}: no such mmproj file")
    report, header = judge_source(mmproj)
    if header is not None and not is_mmproj(header) and report.verdict is not Verdict.CORRUPT:
        raise NotADecisionModelError(
            f"{mmproj}: a GGUF of architecture {header.get(Keys.General.ARCHITECTURE)!r}, not an mmproj (a vision tower)"
        )
    report.raise_for_verdict()
    assert header is not None
    problems = check_pairing(model, header) or _lineage_of_local(model, mmproj)[0]
    if problems:
        raise IncompleteModelError(f"{mmproj} is not this model's vision tower: {problems[0].message}")
    description = describe_mmproj(header)
    assert description is not None  # it validated
    return description

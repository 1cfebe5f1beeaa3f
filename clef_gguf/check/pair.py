"""validate MODEL --mmproj MMPROJ: both files validated, then whether the mmproj is this model's vision tower.

What mtmd_init_from_file compares (the image embeddings' width, clip_n_mmproj_embd, against the text
model's), and what an image prompt needs of the model (the tokens that bracket each image).
"""

from __future__ import annotations

import os
from dataclasses import replace

from gguf import Keys

from ..errors import IncompleteModelError, ModelFileError, NotADecisionModelError
from ..format import vision as V
from ..format.header import Header
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
    if model_report.ok and mmproj_report.ok and model_header is not None and mmproj_header is not None:
        problems += check_pairing(model_header, mmproj_header)
    fits = "model and mmproj belong together: the image embeddings are as wide as the backbone's hidden size"
    names = ("model", "mmproj")
    return PairReport(names, model_report, mmproj_report, tuple(problems), fits, "model and mmproj do not belong together")


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
    problems = check_pairing(model, header)
    if problems:
        raise IncompleteModelError(f"{mmproj} is not this model's vision tower: {problems[0].message}")
    description = describe_mmproj(header)
    assert description is not None  # it validated
    return description

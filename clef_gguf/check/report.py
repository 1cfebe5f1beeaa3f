"""validate's report: the verdict, the problems found, and the one-line summary a person reads."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from gguf import Keys

from ..errors import CorruptModelError, ExitCode, IncompleteModelError, ModelFileError, NotADecisionModelError, printable
from ..format import contract as C
from ..format.header import Header
from ..format.template import PromptTemplate

# The released head design (joint_head_config.json of Clef-flash): 20 + 18*6 + 26*3 = 206 GGUF tensors,
# holding the 22 + 14*6 + 18*3 = 160 of joint_head.safetensors.
RELEASED_HEAD = ("Clef-flash", 6, 3)


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
    temperatures: dict[str, float] = field(default_factory=dict)  # clef.decision.temperature.<name>: the valid ones
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
        return ExitCode.OK if self.ok else _ERRORS[self.verdict].exit_code

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


@dataclass(frozen=True)
class PairReport:
    """Two files validated, and whether they belong together: validate MODEL --mmproj MMPROJ (check/pair.py),
    validate BASE --adapter FILE (check/adapter_pair.py). `names` name the two in the summary and the JSON."""

    names: tuple[str, str]  # ("model", "mmproj"), ("base", "adapter")
    first: Report
    second: Report
    problems: tuple[Problem, ...]  # of the pairing (none when either file does not validate: see its report)
    fits: str  # the summary when they belong together
    misfit: str  # the summary's start when they do not
    basis: str | None = None  # on what ground they belong together (an adapter's: lineage keys or content); None: none

    @property
    def exit_code(self) -> int:
        for code in (self.first.exit_code, self.second.exit_code):
            if code:
                return code
        return IncompleteModelError.exit_code if self.problems else ExitCode.OK

    @property
    def ok(self) -> bool:
        return self.exit_code == ExitCode.OK

    @property
    def summary(self) -> str:
        if not self.first.ok or not self.second.ok:
            name = self.names[0] if not self.first.ok else self.names[1]
            return f"the pair was not compared: the {name} does not validate"
        if self.problems:
            more = f" (and {len(self.problems) - 1} more problems)" if len(self.problems) > 1 else ""
            return f"{self.misfit}: {self.problems[0].message}{more}"
        return self.fits

    def to_dict(self) -> dict[str, Any]:
        pairing = {"summary": self.summary, "problems": [p.message for p in self.problems]}
        return {
            self.names[0]: self.first.to_dict(),
            self.names[1]: self.second.to_dict(),
            "pairing": pairing if self.basis is None else {**pairing, "basis": self.basis},
            "exit_code": self.exit_code,
        }


def corrupt(check: str, message: str) -> Problem:
    return Problem(check, message, corrupt=True)


@dataclass
class Findings:
    problems: list[Problem] = field(default_factory=list)
    counts: Counts = Counts()
    notes: list[str] = field(default_factory=list)
    decision: bool = False  # the file claims to be a decision model
    # What the checks read, for the runtime's description of a complete file.
    shape: C.BackboneShape | None = None
    head: C.HeadConfig | None = None
    template: PromptTemplate | None = None
    temperatures: dict[str, float] = field(default_factory=dict)
    # A file of another kind (an mmproj, check/mmproj.py) has a summary of its own.
    summarize: Callable[[Verdict, Findings, Header | None], str] | None = None


def _verdict(found: Findings) -> Verdict:
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


def _summary(verdict: Verdict, found: Findings, h: Header | None, source: str) -> str:
    if found.summarize is not None:
        return found.summarize(verdict, found, h)
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


def _not_a_decision_model(found: Findings, h: Header | None, source: str) -> str:
    arch = h.get(Keys.General.ARCHITECTURE) if h else None
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


def make_report(source: str, found: Findings, h: Header | None, file_size: int | None, started: float, **extra: Any) -> Report:
    verdict = _verdict(found)
    arch = h.get(Keys.General.ARCHITECTURE) if h else None
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
        temperatures={printable(k, limit=100): v for k, v in found.temperatures.items()},
        notes=tuple(printable(n) for n in found.notes),
        seconds=round(time.perf_counter() - started, 4),
        **extra,
    )

"""validate BASE --adapter FILE: both files validated, then whether the adapter was trained over this base.

The base's identity is format/adapter.model_fingerprint (its norms, the same in every quantization of one release);
then what llama.cpp's adapter loader checks (src/llama-adapter.cpp:333-371: every pair's model tensor exists, lora_a's
ne[0] is the weight's ne[0], lora_b's ne[1] its ne[1]) and what clef-gguf's head needs (the head's shapes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import AdapterBaseError, SettingsError
from ..format import adapter as A
from ..format import contract as C
from ..format.header import GGUFFile, Header
from .adapter import adapter_head_config, is_adapter, lora_pairs
from .report import Problem, Report, Verdict
from .validate import judge_source

CHECK = "pairing"


def adapter_problems(base: GGUFFile, adapter: Header) -> list[Problem]:
    """Why `adapter` (a header that validates) cannot be applied to `base` (a model file that validates); [] if it can."""
    theirs, ours = adapter.get(A.KEY_BASE_FINGERPRINT), A.model_fingerprint(base)
    if theirs != ours:
        return [Problem(CHECK, f"the adapter was trained over another base (fingerprint {theirs}; this base's is {ours})")]
    problems = []
    tensors = base.header.tensors
    pairs, _ = lora_pairs(adapter)
    for target, (a, b) in pairs.items():
        w = tensors.get(target)
        if w is None:
            problems.append(Problem(CHECK, f"the adapter adapts {target}, which the base does not have"))
        elif len(w.shape) != 2 or a[1] != w.shape[1] or b[0] != w.shape[0]:
            problems.append(
                Problem(CHECK, f"{target} is {list(w.shape)} in the base; its lora_a {list(a)} x lora_b {list(b)} do not fit")
            )
    config, _ = adapter_head_config(adapter)
    for name, t in adapter.tensors.items():
        if C.is_head_tensor(name):
            w = tensors.get(name)
            if w is None or w.shape != t.shape:
                found = list(w.shape) if w is not None else "absent"
                problems.append(Problem(CHECK, f"head tensor {name} is {list(t.shape)} in the adapter, {found} in the base"))
    width = tensors.get(C.HEAD_WIDTH_TENSORS["width"])
    if config is not None and width is not None and width.shape[0] != config.width:
        problems.append(Problem(CHECK, f"the adapter's head is {config.width} wide, the base's {width.shape[0]}"))
    return problems


def require_adapter(base: GGUFFile, adapter: Header, source: str) -> None:
    """Raise AdapterBaseError (exit 7) unless the adapter fits the base: what the runtime calls before applying it."""
    problems = adapter_problems(base, adapter)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise AdapterBaseError(f"{source} does not fit the base {base.path.name}: {problems[0].message}{more}")


@dataclass(frozen=True)
class AdapterPairReport:
    base: Report
    adapter: Report
    problems: tuple[Problem, ...]

    @property
    def exit_code(self) -> int:
        for code in (self.base.exit_code, self.adapter.exit_code):
            if code:
                return code
        return AdapterBaseError.exit_code if self.problems else 0

    @property
    def summary(self) -> str:
        if not self.base.ok or not self.adapter.ok:
            return "the pair was not compared: " + ("the base" if not self.base.ok else "the adapter") + " does not validate"
        if self.problems:
            more = f" (and {len(self.problems) - 1} more problems)" if len(self.problems) > 1 else ""
            return f"the adapter does not fit this base: {self.problems[0].message}{more}"
        return "the adapter fits this base: the same base fingerprint, every LoRA pair and head tensor of the base's shapes"

    def to_dict(self) -> dict[str, Any]:
        return {
            "base": self.base.to_dict(),
            "adapter": self.adapter.to_dict(),
            "pairing": {"summary": self.summary, "problems": [p.message for p in self.problems]},
            "exit_code": self.exit_code,
        }


def validate_adapter_pair(
    base: str | os.PathLike[str], adapter: str | os.PathLike[str], *, deep: bool = False
) -> AdapterPairReport:
    """Validate a base model file, an adapter file, and whether the adapter was trained over that base (local files:
    the base's fingerprint reads its norms)."""
    for path in (base, adapter):
        if not Path(path).is_file():
            raise SettingsError(f"{path}: no such file (--adapter pairs two local files)")
    base_report, base_header = judge_source(base, deep=deep)
    adapter_report, adapter_header = judge_source(adapter, deep=deep)
    if base_header is not None and is_adapter(base_header) and base_report.verdict is not Verdict.CORRUPT:
        base_report = replace(
            base_report, verdict=Verdict.NOT_A_DECISION_MODEL, summary="an adapter, not a base: give the base first"
        )
    if adapter_header is not None and not is_adapter(adapter_header) and adapter_report.verdict is not Verdict.CORRUPT:
        adapter_report = replace(
            adapter_report,
            verdict=Verdict.NOT_A_DECISION_MODEL,
            summary=f"not an adapter file (no {A.KEY_GENERAL_TYPE} = adapter)",
        )
    problems: list[Problem] = []
    if base_report.ok and adapter_report.ok and adapter_header is not None:
        f = GGUFFile.open(base)
        try:
            problems = adapter_problems(f, adapter_header)
        finally:
            f.close()
    return AdapterPairReport(base_report, adapter_report, tuple(problems))

"""validate BASE --adapter FILE: both files validated, then whether the adapter was trained over this base.

The base's identity is format/adapter.model_fingerprint (its norms, the same in every quantization of one release),
which tells one release from another but not a base from its fine-tunes (a LoRA changes no norm): format/lineage.py
does. The keys conversions write (the release's weights digest, merged files marked) may refuse a pair early; the
content check of the adapter's base sample then runs whatever they say, since keys can be copied (a tool that copies
its base's keys into a merged fine-tune writes the base's digest): keys never accept a pair alone. Then what
llama.cpp's adapter loader checks (src/llama-adapter.cpp:333-371: every pair's model tensor exists, lora_a's ne[0] is
the weight's ne[0], lora_b's ne[1] its ne[1]) and what clef-gguf's head needs (the head's shapes).
"""

from __future__ import annotations

import os
from dataclasses import replace

from ..errors import AdapterBaseError, SettingsError
from ..format import adapter as A
from ..format import contract as C
from ..format import lineage as L
from ..format.header import GGUFFile, Header
from .adapter import adapter_head_config, is_adapter, lora_pairs
from .report import PairReport, Problem, Verdict
from .validate import judge_source

CHECK = "pairing"


def _by_keys(base: Header, adapter: Header) -> tuple[list[Problem], str]:
    """What the lineage keys (format/lineage.py) say: why they refuse the pair, or else (no problem) the release they
    name, '' where they name none. They can refuse, never accept alone: a tool that copies its base's keys into a
    merged fine-tune writes the base's digest and no merged mark, so the content check runs after them whatever
    they say."""
    theirs, ours = adapter.get(L.KEY_BASE_DIGEST), base.get(L.KEY_SOURCE_DIGEST)
    merged, parent = base.get(L.KEY_SOURCE_MERGED) is True, base.get(L.KEY_SOURCE_BASE_DIGEST)
    if L.is_digest(theirs) and L.is_digest(ours):
        if theirs == ours:
            return [], f"the release it was trained over ({L.KEY_SOURCE_DIGEST} {_short(ours)})"
        if merged and parent == theirs:
            why = (
                f"the base is a fine-tune merged into the release this adapter was trained over ({L.KEY_SOURCE_MERGED}): "
                "the adapter would apply over another fine-tune (its own LoRA twice, if the file is its merged "
                "conversion); give the release's own conversion"
            )
        elif merged and L.is_digest(parent):
            why = f"the base is a merged fine-tune ({L.KEY_SOURCE_MERGED}) of another release than the adapter's"
        elif merged:
            why = (
                f"the base is a merged fine-tune ({L.KEY_SOURCE_MERGED}: a folder clef-finetune merge wrote), not the "
                "release the adapter was trained over; give the release's own conversion"
            )
        else:
            why = f"the adapter was trained over another release (weights digest {_short(theirs)}; this base's is {_short(ours)})"
        return [Problem(CHECK, why)], ""
    if merged:
        return [
            Problem(
                CHECK,
                f"the base is a merged fine-tune ({L.KEY_SOURCE_MERGED}), and the adapter records no {L.KEY_BASE_DIGEST} to "
                "show it was trained over that one (written by an older clef-gguf): convert the adapter again, or give "
                "the release's own conversion",
            )
        ], ""
    return [], ""


def _by_content(base: GGUFFile, adapter: Header, keys: str) -> tuple[list[Problem], str]:
    """The content check of format/lineage.py: how much of the adapter's update the base's weights hold. `keys`: the
    release the lineage keys name ('' for none), which the basis states beside what the content says."""
    ground = keys or "the same norms fingerprint"
    sample = L.read_sample(adapter)
    if sample is None:
        return [Problem(CHECK, f"the adapter's base sample ({L.SAMPLE_PREFIX}*) is damaged: its keys disagree")], ""
    if not sample:
        return [], (
            f"{ground} only: the adapter holds no base sample (an older clef-gguf wrote it), so a merged fine-tune is "
            "not told from its base"
        )
    share = L.sample_share(base, sample)
    if share is None:
        return [], f"{ground}; the content check found no sampled row it could read"
    measured = f"{share.value:.3f} ± {share.error:.3f} of the adapter's update over {share.n} values"
    if share.merged and share.value > 0:
        forged = f" whose keys ({L.KEY_SOURCE_DIGEST}) name the release the adapter was trained over" if keys else ""
        why = (
            f"the base's weights hold the adapter's own update already ({measured}; its base holds 0, its merged "
            f"conversion 1): a merged fine-tune{forged}, over which the LoRA would apply twice; give the release's own "
            "conversion"
        )
        return [Problem(CHECK, why)], ""
    if share.merged:
        return [Problem(CHECK, f"the base's weights are not the adapter's base: they differ from it by {measured}")], ""
    if not share.conclusive:
        return [], f"{ground}; the content check cannot tell at this quantization ({measured})"
    if keys:
        return [], f"{keys} and none of the adapter's update in the weights (content check: {measured})"
    return [], f"the same norms fingerprint and none of the adapter's update in the weights (content check: {measured})"


def _short(digest: str) -> str:
    return digest[:12] + "..."


def judge_pair(base: GGUFFile, adapter: Header) -> tuple[list[Problem], str]:
    """Why `adapter` (a header that validates) cannot be applied to `base` (a model file that validates), and on
    what ground it fits where it does: the norms, then the lineage keys (which may refuse), then the content check
    (which runs whatever the keys say)."""
    theirs, ours = adapter.get(A.KEY_BASE_FINGERPRINT), A.model_fingerprint(base)
    if theirs != ours:
        return [Problem(CHECK, f"the adapter was trained over another base (fingerprint {theirs}; this base's is {ours})")], ""
    problems, keys = _by_keys(base.header, adapter)
    problems, basis = (problems, "") if problems else _by_content(base, adapter, keys)
    return problems + _shape_problems(base, adapter), basis


def adapter_problems(base: GGUFFile, adapter: Header) -> list[Problem]:
    """Why `adapter` (a header that validates) cannot be applied to `base` (a model file that validates); [] if it can."""
    return judge_pair(base, adapter)[0]


def _shape_problems(base: GGUFFile, adapter: Header) -> list[Problem]:
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


def validate_adapter_pair(
    base: str | os.PathLike[str], adapter: str | os.PathLike[str], *, deep: bool = False
) -> PairReport:
    """Validate a base model file, an adapter file, and whether the adapter was trained over that base (local files:
    the base's fingerprint reads its norms)."""
    for path in (base, adapter):
        if not os.path.exists(path):  # (a FIFO, a folder: judge_source says what it is, exit 5)
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
    basis = ""
    if base_report.ok and adapter_report.ok and adapter_header is not None:
        f = GGUFFile.open(base)
        try:
            problems, basis = judge_pair(f, adapter_header)
        finally:
            f.close()
    fits = f"the adapter fits this base: {basis}; every LoRA pair and head tensor of the base's shapes"
    names = ("base", "adapter")
    return PairReport(names, base_report, adapter_report, tuple(problems), fits, "the adapter does not fit this base", basis)

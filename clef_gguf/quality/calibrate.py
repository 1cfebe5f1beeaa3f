"""`clef-gguf calibrate MODEL DATA.jsonl -o OUT.gguf`: llama.cpp's softmax temperatures fitted on labelled data.

The scores are computed once (the dataset mode); each temperature is then a one-dimensional search: the NLL of
softmax(s / T) at the labels is convex in 1/T, so a golden-section search over 1/T finds its minimum.

Which keys are fitted:
- `<type>` for each question type with at least MIN_QUESTIONS labelled questions: on all of them;
- `<type>.<bucket>` for each option-count bucket (temperatures.TEMPERATURE_BUCKETS) with at least MIN_BUCKET_QUESTIONS,
  when the type's data spans more than one bucket: a bucket's key is looked up first, so it is fitted on its own.
With fewer questions a temperature mostly fits noise: the key is not written, and the type keeps 1 (or the
file's key). OUT is MODEL with its temperature keys of the fitted types replaced (rekey: tensor data unchanged).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..check.validate import validate
from ..conversion.rekey import rekey
from ..conversion.writer import check_output
from ..errors import RequestError, SettingsError
from ..format import contract as C
from ..format import temperatures as T
from ..runtime.catalog import adapter_temperatures
from ..settings import MAX_LINE_BYTES, ModelSpec
from .labelled import duplicates
from .metrics import DEFAULT_TARGET_PRECISIONS, Row, block
from .scoring import Progress, score_path

MIN_QUESTIONS = 20
MIN_BUCKET_QUESTIONS = 100
BETA_RANGE = (0.02, 20.0)  # 1 / T: temperatures from 0.05 to 50
GOLDEN = (math.sqrt(5) - 1) / 2


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def fit_temperature(rows: Sequence[Row], tolerance: float = 1e-5) -> float:
    """The temperature that minimizes the rows' NLL (convex in 1/T): a golden-section search over 1/T in BETA_RANGE."""
    by_size: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for size in {len(r.option_ids) for r in rows}:
        same = [r for r in rows if len(r.option_ids) == size]
        by_size[size] = (np.stack([r.logits for r in same]).astype(np.float64), np.array([r.target for r in same]))

    def loss(beta: float) -> float:
        total = 0.0
        for logits, targets in by_size.values():
            total -= float(_log_softmax(logits * beta)[np.arange(len(targets)), targets].sum())
        return total

    low, high = BETA_RANGE
    a, b = low, high
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc, fd = loss(c), loss(d)
    while b - a > tolerance * (abs(c) + abs(d)):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = loss(d)
    return 1.0 / ((a + b) / 2)


def holdout(rows: Sequence[Row], fraction: float) -> tuple[list[Row], list[Row]]:
    """(fit, held out): whole records held out, chosen by a digest of the record's id (deterministic, any order)."""
    if fraction <= 0:
        return list(rows), []

    def held(record_id: Any) -> bool:
        digest = hashlib.sha256(repr(record_id).encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < fraction

    return [r for r in rows if not held(r.record_id)], [r for r in rows if held(r.record_id)]


def groups(rows: Sequence[Row]) -> dict[str, list[Row]]:
    """The rows each fitted key is fitted on (see the module's docstring)."""
    out: dict[str, list[Row]] = {}
    for qtype in sorted({r.type for r in rows}):
        of_type = [r for r in rows if r.type == qtype]
        if len(of_type) < MIN_QUESTIONS:
            continue
        out[qtype] = of_type
        buckets: dict[str, list[Row]] = {}
        for r in of_type:
            buckets.setdefault(T.temperature_bucket(len(r.option_ids)), []).append(r)
        if len(buckets) > 1:
            out |= {f"{qtype}.{b}": v for b, v in sorted(buckets.items()) if len(v) >= MIN_BUCKET_QUESTIONS}
    return out


@dataclass(frozen=True)
class Fit:
    temperatures: dict[str, float]  # the fitted names and values
    before: dict[str, Any]  # metrics blocks at the file's temperatures: {"fit": ..., "holdout": ...}
    after: dict[str, Any]
    counts: dict[str, int]  # labelled questions each key was fitted on


def tempered(rows: Sequence[Row], temperatures: dict[str, float]) -> list[Row]:
    """The rows with their probabilities at these temperatures (llama.cpp's lookup)."""
    out = []
    for r in rows:
        assert r.logits is not None
        t = T.temperature_of(temperatures, r.type, len(r.option_ids))
        p = np.exp(_log_softmax(r.logits.astype(np.float64) / t))
        out.append(Row(r.record_id, r.question_id, r.type, r.option_ids, p, r.target, r.logits))
    return out


def calibrate_rows(
    rows: Sequence[Row],
    current: dict[str, float],
    fraction: float = 0.0,
    target_precisions: Sequence[float] = DEFAULT_TARGET_PRECISIONS,
) -> Fit:
    """Fit the temperatures on the rows not held out; the metrics before (the file's temperatures) and after (the
    file's, with the fitted types' keys replaced), on both parts."""
    fit_rows, held = holdout(rows, fraction)
    fitted_on = groups(fit_rows)
    fitted = {name: fit_temperature(v) for name, v in fitted_on.items()}
    types = {name.split(".")[0] for name in fitted}
    after_keys = {n: t for n, t in current.items() if n.split(".")[0] not in types} | fitted
    parts = {"fit": fit_rows, "holdout": held}
    before = {k: block(tempered(v, current), target_precisions) for k, v in parts.items() if v}
    after = {k: block(tempered(v, after_keys), target_precisions) for k, v in parts.items() if v}
    return Fit(after_keys, before, after, {name: len(v) for name, v in fitted_on.items()})


def calibrate(
    spec: ModelSpec,
    data: str | Path,
    out: str | Path,
    *,
    holdout_fraction: float = 0.0,
    force: bool = False,
    target_precisions: Sequence[float] = DEFAULT_TARGET_PRECISIONS,
    progress: Progress | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> dict[str, Any]:
    """Fit the temperatures of the model `spec` declares on the labelled file `data` and write the model with them to
    `out` (rekey: its tensor data byte for byte). Raises RequestError when no type has enough labelled questions.
    With the spec's pinned `adapter` (an adapter file over the model), the fine-tune's temperatures are fitted and
    `out` is a copy of the adapter file with them (the base is left as it is)."""
    if not (math.isfinite(holdout_fraction) and 0.0 <= holdout_fraction < 1.0):  # (nan passes no comparison)
        raise SettingsError(f"the held-out share must be a number in [0, 1), not {holdout_fraction}")
    # Before the data is decided (minutes, on a real model): OUT is none of the inputs, DATA included.
    model, adapter = spec.path, spec.adapter_set.adapter
    check_output(Path(out), force, inputs=[model, data, spec.options.mmproj, adapter])
    run = score_path(spec, data, stage="calibrate", progress=progress, max_line_bytes=max_line_bytes)
    # (the load refused a file whose keys are invalid); an adapter without keys of its own answers with its base's
    current = (adapter_temperatures(adapter) if adapter is not None else {}) or dict(validate(model).temperatures)
    fit = calibrate_rows(run.rows(), current, holdout_fraction, target_precisions)
    if not fit.counts:
        raise RequestError(_too_few(str(data), run.rows(), holdout_fraction))
    keys = {C.KEY_TEMPERATURE_PREFIX + name: value for name, value in fit.temperatures.items()}
    rekey(adapter or model, out, keys, drop_prefix=C.KEY_TEMPERATURE_PREFIX, force=force, progress=progress)
    return {
        "model": str(model),
        "adapter": None if adapter is None else str(adapter),  # (the fine-tune fitted, whose copy `out` is)
        "out": str(out),
        "eval": str(data),
        "temperatures": fit.temperatures,
        "fitted_on": fit.counts,
        "before": fit.before,
        "after": fit.after,
        "errors": run.errors,
        "duplicates": duplicates(d.record for d in run.decided),
    }


def _too_few(data: str, rows: Sequence[Row], fraction: float) -> str:
    """Why no temperature was fitted: the labelled questions of each type, and what the holdout took of them."""
    fit_rows, held = holdout(rows, fraction)
    most = max((sum(r.type == t for r in fit_rows) for t in {r.type for r in fit_rows}), default=0)
    text = f"{data}: no question type has {MIN_QUESTIONS} labelled questions to fit a temperature on"
    text += f" (the most of one type: {most}"
    if fraction:
        return text + f", after --holdout {fraction:g} held out {len(held)} of the {len(rows)}): lower --holdout, or label more"
    return text + "): label more"


def _at_bound(temperature: float) -> bool:
    return any(math.isclose(1.0 / temperature, b, rel_tol=1e-3) for b in BETA_RANGE)


def report_markdown(result: dict[str, Any]) -> str:
    lines = ["| temperature | value | labelled questions |", "|---|---:|---:|"]
    for name, value in result["temperatures"].items():
        edge = (
            " (the search's bound: the scores tell the labels apart almost not at all, or perfectly)" if _at_bound(value) else ""
        )
        lines.append(f"| {C.KEY_TEMPERATURE_PREFIX}{name} | {value:.4f}{edge} | {result['fitted_on'].get(name, 'kept')} |")
    lines += ["", "| questions | n | nll before | nll after | ece before | ece after | auto-decide @ target before / after |"]
    lines.append("|---|---:|---:|---:|---:|---:|---|")
    for part, before in result["before"].items():
        after = result["after"][part]
        coverage = "; ".join(
            f"{tp}: {before['auto_decide'][tp]['coverage']:.3f} / {after['auto_decide'][tp]['coverage']:.3f}"
            for tp in before["auto_decide"]
        )
        lines.append(
            f"| {'fitted on' if part == 'fit' else 'held out'} | {before['n']} | {before['nll']:.4f} | {after['nll']:.4f} | "
            f"{before['ece']:.4f} | {after['ece']:.4f} | {coverage} |"
        )
    found = result.get("duplicates") or {}
    if found.get("contradictory_ids"):
        lines += ["", f"Warning: {found['contradictory_ids']} ids carry contradictory labels; the fit learnt their disagreement:"]
        lines += [f"- {w}" for w in found["warnings"]]
    return "\n".join(lines) + "\n"

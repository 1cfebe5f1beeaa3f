"""The decision metrics, with clef-finetune 0.1.0's definitions and names (its metrics.py), so that its
`tuned_metrics.json` and `clef-gguf eval --json` can be diffed.

Per question id and overall, over labelled questions:
- accuracy: the top option (the first maximum) is the label;
- macro_f1: the mean F1 over the options that occur as a label or a prediction; only where every row has
  the same number of options;
- nll: the mean of -log max(p_label, 1e-12);
- brier: the sum over options of (p - onehot)^2, averaged over rows;
- ece: top-label expected calibration error over 10 equal-width confidence bins;
- auto_decide[target]: the largest share of rows whose top probability clears a threshold while the precision on
  them stays >= target; thresholds only between distinct confidences. No threshold: coverage 0, threshold None.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..settings import DEFAULT_TARGET_PRECISIONS

ECE_BINS = 10


@dataclass(frozen=True)
class Row:
    """One labelled question decided: clef-finetune's prediction row (its tuned_predictions.jsonl columns)."""

    record_id: Any
    question_id: str
    type: str
    option_ids: tuple[str, ...]
    probs: np.ndarray  # unrounded, in option_ids' order
    target: int  # the label's index in option_ids
    logits: np.ndarray | None = None  # the scores before the temperature and the softmax (not in predictions.jsonl)

    @property
    def predicted(self) -> int:
        return int(np.argmax(self.probs))

    def as_dict(self) -> dict[str, Any]:
        return {
            "record_id": self.record_id,
            "question_id": self.question_id,
            "type": self.type,
            "option_ids": list(self.option_ids),
            "probs": [float(p) for p in self.probs],
            "target": self.target,
        }


def macro_f1(preds: Sequence[int], targets: Sequence[int], n_classes: int) -> float:
    f1s = []
    for c in range(n_classes):
        tp = sum(p == c and t == c for p, t in zip(preds, targets, strict=True))
        fp = sum(p == c and t != c for p, t in zip(preds, targets, strict=True))
        fn = sum(p != c and t == c for p, t in zip(preds, targets, strict=True))
        if tp + fp + fn:
            f1s.append(2 * tp / (2 * tp + fp + fn))
    return sum(f1s) / len(f1s) if f1s else float("nan")


def reliability(confidences: Sequence[float], correct: Sequence[bool], n_bins: int = ECE_BINS) -> list[dict[str, float]]:
    """The equal-width confidence bins: for each non-empty one, its range, count, mean confidence and accuracy (what
    ece sums, and what the reliability diagram draws)."""
    bins: list[list[tuple[float, bool]]] = [[] for _ in range(n_bins)]
    for conf, ok in zip(confidences, correct, strict=True):
        bins[min(int(conf * n_bins), n_bins - 1)].append((conf, ok))
    return [
        {
            "low": i / n_bins,
            "high": (i + 1) / n_bins,
            "n": len(b),
            "confidence": sum(c for c, _ in b) / len(b),
            "accuracy": sum(ok for _, ok in b) / len(b),
        }
        for i, b in enumerate(bins)
        if b
    ]


def ece(confidences: Sequence[float], correct: Sequence[bool], n_bins: int = ECE_BINS) -> float:
    n = len(confidences)
    return sum(b["n"] / n * abs(b["confidence"] - b["accuracy"]) for b in reliability(confidences, correct, n_bins))


def coverage_at_precision(confidences: Sequence[float], correct: Sequence[bool], target_precision: float) -> dict[str, Any]:
    pairs = sorted(zip(confidences, correct, strict=True), key=lambda x: -x[0])
    n = len(pairs)
    best: dict[str, Any] = {
        "coverage": 0.0,
        "threshold": None,
        "precision": None,
        "n_auto": 0,
        "n": n,
        "target_precision": target_precision,
    }
    hits = 0
    for i, (conf, ok) in enumerate(pairs, 1):
        hits += bool(ok)
        if i < n and pairs[i][0] == conf:  # cut only between distinct confidences
            continue
        if hits / i >= target_precision:
            best = {**best, "coverage": i / n, "threshold": conf, "precision": hits / i, "n_auto": i}
    return best


def block(rows: Sequence[Row], target_precisions: Sequence[float] = DEFAULT_TARGET_PRECISIONS) -> dict[str, Any]:
    """The metrics of a set of rows (clef-finetune's summarize block)."""
    preds = [r.predicted for r in rows]
    targets = [r.target for r in rows]
    confidences = [float(r.probs.max()) for r in rows]
    correct = [p == t for p, t in zip(preds, targets, strict=True)]
    out: dict[str, Any] = {
        "n": len(rows),
        "accuracy": sum(correct) / len(rows),
        "nll": sum(-math.log(max(float(r.probs[r.target]), 1e-12)) for r in rows) / len(rows),
        "brier": sum(float(((r.probs - np.eye(len(r.probs))[r.target]) ** 2).sum()) for r in rows) / len(rows),
        "ece": ece(confidences, correct),
    }
    if len({len(r.probs) for r in rows}) == 1:
        out["macro_f1"] = macro_f1(preds, targets, len(rows[0].probs))
    out["auto_decide"] = {f"{tp:g}": coverage_at_precision(confidences, correct, tp) for tp in target_precisions}
    return out


def summarize(rows: Sequence[Row], target_precisions: Sequence[float] = DEFAULT_TARGET_PRECISIONS) -> dict[str, Any]:
    """{"overall": block of every row, "per_question": {question id: block}}, as clef-finetune's summarize."""
    by_question: dict[str, list[Row]] = {}
    for r in rows:
        by_question.setdefault(r.question_id, []).append(r)
    return {
        "overall": block(rows, target_precisions) if rows else {},
        "per_question": {q: block(v, target_precisions) for q, v in by_question.items()},
    }

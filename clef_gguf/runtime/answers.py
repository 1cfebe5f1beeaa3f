"""Per-option logits -> the SystemOne response body.

Values are rounded to 4 decimals as the reference does. `confidence` follows
TypeSafe's documented formulas (the reference returns the top probability instead):
choice (p_max - 1/n) / (1 - 1/n); score 1 - sum p_i |i - mode| / the same spread for
a uniform distribution. Both are clamped to [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ModelOutputError
from .prompt import EncodedPrompt, EncodedQuestion

DECIMALS = 4


def probabilities(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """The softmax of the scores divided by the temperature, in float64 (as llama-server: exp((s - max) / t))."""
    z = np.asarray(logits, dtype=np.float64)
    e = np.exp((z - z.max()) / temperature)
    return e / e.sum()


def choice_confidence(p: np.ndarray) -> float:
    n = len(p)
    return float((p.max() - 1.0 / n) / (1.0 - 1.0 / n))


def score_confidence(p: np.ndarray) -> float:
    n = len(p)
    levels = np.arange(n)
    spread = float(p @ np.abs(levels - int(p.argmax())))
    uniform_spread = float(np.abs(levels - (n - 1) / 2).sum() / n)
    return 1.0 - spread / uniform_spread


def _round(x: float) -> float:
    return round(min(max(float(x), 0.0), 1.0), DECIMALS)


def answer(question: EncodedQuestion, p: np.ndarray) -> dict[str, Any]:
    q = question.question
    by_option = {option_id: float(pi) for (option_id, _), pi in zip(q.options, p, strict=True)}
    if q.type == "noul":
        return {"type": "noul", "noul": _round(by_option["true"])}
    if q.type == "choice":
        # Listed in the request's order (the prompt lists them sorted); the first maximum wins.
        names = q.listed
        best = max(names, key=by_option.__getitem__)
        return {
            "type": "choice",
            "choice": best,
            "confidence": _round(choice_confidence(p)),
            "probabilities": {name: _round(by_option[name]) for name in names},
        }
    levels = [str(i) for i in range(len(q.options))]
    return {
        "type": "score",
        "score": round(float(np.arange(len(p)) @ p), DECIMALS),
        "confidence": _round(score_confidence(p)),
        "legend": dict(zip(levels, q.levels, strict=True)),
        "probabilities": {level: _round(by_option[level]) for level in levels},
    }


@dataclass(frozen=True)
class Scores:
    """A prompt decided, before its response is written: each question's option probabilities, unrounded, in its
    options' order (the order the prompt lists them: choice options sorted by id), and the tokens the state cache gave."""

    probabilities: list[np.ndarray]
    cached_tokens: int
    questions: tuple[str, ...]  # the question ids, in the request's order
    options: tuple[tuple[str, ...], ...]  # each question's option ids, in its probabilities' order
    logits: list[np.ndarray]  # each question's scores, before the temperature and the softmax (what calibrate fits)

    def by_question(self) -> dict[str, tuple[tuple[str, ...], np.ndarray, np.ndarray]]:
        """{question id: (option ids, probabilities, scores)}."""
        return dict(zip(self.questions, zip(self.options, self.probabilities, self.logits, strict=True), strict=True))


@dataclass(frozen=True)
class Answer:
    """A prompt decided (runtime/decider.py's Decider.decide): its response body, and its Scores, the cached tokens
    among them (what the server's timing header and metrics, the dataset mode's counts and the quality tools read)."""

    body: dict[str, Any]
    scores: Scores

    @property
    def cached_tokens(self) -> int:
        return self.scores.cached_tokens


def question_probabilities(model_name: str, logits: list[np.ndarray], temperatures: list[float]) -> list[np.ndarray]:
    """Each question's option probabilities (float64, unrounded) from its scores and its softmax temperature (the
    file's clef.decision.temperature.* keys: temperatures.temperature_of); ModelOutputError if a score is not finite."""
    if not all(np.isfinite(z).all() for z in logits):  # JSON has no NaN: never answer with one
        raise ModelOutputError(
            f"{model_name}: the model's scores are not finite (NaN or Inf); its weights are broken "
            "(`clef-gguf validate --deep` names the tensor)"
        )
    return [probabilities(z, t) for z, t in zip(logits, temperatures, strict=True)]


def answered_as(prompt: EncodedPrompt, model_name: str) -> str:
    """The answer's `model`: the model that answered it. An adapter's name (the one the request used, or the pinned
    adapter's whatever the request named); for the base, the name the request used (a client's own alias, in `lora`
    or `model`), else the file's."""
    ref, named = prompt.model, prompt.request.named
    if ref is not None and ref.entry.source is not None:
        return ref.name
    return named if named is not None else model_name


def response(prompt: EncodedPrompt, model_name: str, probs: list[np.ndarray], cached_tokens: int = 0) -> dict[str, Any]:
    """The response body from each question's probabilities (question_probabilities). usage.input_tokens counts
    every prompt token; input_tokens_details.cached_tokens (OpenAI's name for the same extension) those whose
    backbone state came from the state cache."""
    return {
        "model": answered_as(prompt, model_name),
        "answers": {q.question.id: answer(q, p) for q, p in zip(prompt.questions, probs, strict=True)},
        "usage": {
            "input_tokens": len(prompt.tokens),
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": 0,
        },
    }

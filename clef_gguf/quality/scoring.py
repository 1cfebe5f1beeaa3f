"""A model over a labelled file: every record decided through the dataset mode (its batches, its state cache),
keeping each question's unrounded probabilities. What `eval`, `compare` and `calibrate` measure."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import RequestError
from ..runtime.dataset import decide_outcomes
from ..runtime.dataset_file import count_records
from ..runtime.model import ClefModel
from ..settings import MAX_LINE_BYTES, ModelSpec
from .labelled import BadLine, Labelled, read_labelled
from .metrics import Row

Progress = Callable[[str, int, int | None, str], None]  # (stage, records done, records in all when known, "")


@dataclass(frozen=True)
class Answered:
    """A question decided: its type, option ids, probabilities (unrounded) and scores (before the temperature)."""

    type: str
    options: tuple[str, ...]
    probs: np.ndarray
    logits: np.ndarray


@dataclass(frozen=True)
class Decided:
    """A record and what the model made of it, {question id: Answered}, or its error."""

    record: Labelled
    questions: dict[str, Answered]
    error: str | None = None


@dataclass
class Run:
    """One model over one file."""

    model: str
    data: str
    adapter: str | None = None  # the fine-tune over `model` that answered (decide/eval --adapter FILE), as named
    decided: list[Decided] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)  # lines that are not labelled records
    tokens: int = 0
    seconds: float = 0.0

    @property
    def errors(self) -> list[str]:
        """Every line that counts in no metric, with why: a bad line, or a request the model refused."""
        lines = [(b.line, m) for b in self.bad for m in b.messages()]
        lines += [(d.record.line, f"line {d.record.line} ({d.record.id}): {d.error}") for d in self.decided if d.error]
        return [m for _, m in sorted(lines, key=lambda x: x[0])]

    @property
    def label(self) -> str:
        """The model as the reports name it: the file, and the adapter over it."""
        return self.model if self.adapter is None else f"{self.model} with the adapter {self.adapter}"

    def rows(self) -> list[Row]:
        """One Row per labelled question of every decided record, in file order."""
        rows = []
        for d in self.decided:
            if d.error is not None:
                continue
            for qid, label in d.record.labels.items():
                q = d.questions[qid]
                rows.append(Row(d.record.id, qid, q.type, q.options, q.probs, q.options.index(label), q.logits))
        return rows

    def timing(self) -> dict[str, Any]:
        n = len(self.decided)
        return {
            "records": n,
            "seconds": round(self.seconds, 3),
            "records_per_s": round(n / self.seconds, 2) if self.seconds else 0.0,
        }


def adapter_of(spec: ModelSpec) -> str | None:
    """The pinned adapter (--adapter FILE) that answers every request of a run, as named."""
    adapter = spec.adapter_set.adapter
    return None if adapter is None else str(adapter)


def score_path(
    spec: ModelSpec,
    data: str | Path,
    *,
    stage: str,
    require_labels: bool = True,
    progress: Progress | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> Run:
    """score_file with the model `spec` declares loaded for the run, then closed."""
    with ClefModel(spec) as loaded:
        return score_file(
            loaded, data, require_labels=require_labels, progress=progress, stage=stage, max_line_bytes=max_line_bytes
        )


def score_file(
    model: ClefModel,
    data: str | Path,
    *,
    require_labels: bool = True,
    progress: Progress | None = None,
    stage: str = "decide",
    max_line_bytes: int = MAX_LINE_BYTES,
) -> Run:
    """Decide every labelled record of `data` ("-": stdin; image paths relative to its folder, stdin's to the working
    directory); bad lines, and lines over max_line_bytes (unread), are kept, not fatal."""
    path = Path(data)
    stdin = str(data) == "-"
    try:
        total = None if stdin else count_records(path)
        file = nullcontext(sys.stdin.buffer) if stdin else open(path, "rb")  # noqa: SIM115 (closed once read)
    except OSError as e:
        raise RequestError(f"cannot read {path}: {e.strerror or e}") from None
    run = Run(str(model.path), str(path), adapter_of(model.spec))
    started = time.perf_counter()

    def items() -> Iterator[Labelled | BadLine]:
        with file as lines:
            try:
                yield from read_labelled(lines, require_labels=require_labels, max_line_bytes=max_line_bytes)
            except OSError as e:  # (the records read before are decided first: decide_outcomes)
                raise RequestError(f"cannot read {path}: {e.strerror or e}") from None

    def each() -> None:
        if progress:
            progress(stage, len(run.decided) + len(run.bad), total, "")

    score_records(model, items(), run, base=Path.cwd() if stdin else path.resolve().parent, each=each)
    run.seconds = time.perf_counter() - started
    return run


def score_records(
    model: ClefModel,
    items: Iterable[Labelled | BadLine],
    run: Run,
    *,
    base: Path,
    each: Callable[[], None] | None = None,
) -> None:
    """Decide the labelled records of `items` into `run.decided`, each with its outcome, and keep the bad lines in
    `run.bad` as they are read (score_file, and a Ray worker's part of the file: scoring_ray.py)."""

    def requests() -> Iterator[tuple[Labelled, dict[str, Any]]]:
        for item in items:
            if isinstance(item, BadLine):
                run.bad.append(item)
            else:
                yield item, item.request

    for record, outcome in decide_outcomes(model, requests(), base=base):
        if outcome.scores is None:
            run.decided.append(Decided(record, {}, outcome.reason or "not decided"))
        else:
            types = {qid: q["type"] for qid, q in record.request["questions"].items()}
            questions = {qid: Answered(types[qid], *answered) for qid, answered in outcome.scores.by_question().items()}
            run.decided.append(Decided(record, questions))
            run.tokens += outcome.tokens
        if each:
            each()

"""`clef-gguf eval MODEL DATA --ray`: scoring.score_path on Ray Data, beside the local scoring.

The input is cut into parts and decided by a pool of actors exactly as `decide --ray` does (runtime/dataset_ray.py:
the same cluster, actors, part reading and errors); each actor's job here is eval's (ScorePart: its part's labelled
records decided into a scoring.Run), and the driver adds the parts' Runs up in input order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import RequestError
from ..runtime.dataset_ray import RayData, actor_pool, actors_for, mapped, parts
from ..runtime.model import ClefModel
from ..runtime.reader import Record, count_records, read_records
from ..settings import MAX_LINE_BYTES, ModelSpec
from .labelled import labelled_records
from .scoring import Progress, Run, adapter_of, score_records


@dataclass(frozen=True)
class ScorePart:
    """eval's job: a part's labelled records decided into a Run (its bad lines kept), as score_file decides them."""

    max_line_bytes: int
    base: str  # the input's folder: image paths are relative to it

    def __call__(self, model: ClefModel, records: Iterator[Record]) -> Run:
        run = Run("", "")
        score_records(model, labelled_records(records, max_line_bytes=self.max_line_bytes), run, base=Path(self.base))
        return run


def score_on_ray(address: str | None, workers: int | None) -> Callable[..., Run]:
    """scoring.score_path on a Ray cluster (evaluate's `score`): the same Run, its records decided by actors."""

    def score(
        spec: ModelSpec, data: str | Path, *, stage: str, progress: Progress | None = None, max_line_bytes: int = MAX_LINE_BYTES
    ) -> Run:
        return _score(spec, str(data), RayData(address, workers), stage, progress, max_line_bytes)

    return score


def _score(spec: ModelSpec, data: str, settings: RayData, stage: str, progress: Progress | None, max_line_bytes: int) -> Run:
    actors, _ = actors_for(spec, data)
    run = Run(str(spec.path), str(Path(data)), adapter_of(spec))
    total, started = count_records(Path(data)), time.perf_counter()
    try:
        with open(data, "rb") as file:
            cut = parts(file, read_records(file, max_line_bytes), 1, settings.part_records)
    except OSError as e:
        raise RequestError(f"cannot read {data}: {e.strerror or e}") from None
    if not cut:  # (no request: evaluate says so)
        return run
    job = ScorePart(max_line_bytes, str(Path(actors.source).parent))
    with actor_pool(settings, actors, len(cut)) as workers:
        for part in mapped(actors, job, cut, workers):
            run.bad += part.bad
            run.decided += part.decided
            run.tokens += part.tokens
            if progress:
                progress(stage, len(run.decided) + len(run.bad), total, "")
    run.seconds = time.perf_counter() - started
    return run

"""`clef-gguf decide MODEL DATA.jsonl -o OUT --ray` and `clef-gguf eval MODEL DATA --ray`: the dataset mode on Ray Data.

The driver (this process) reads the input once with the dataset mode's reader (runtime/reader.read_records: its
line numbers, line cap and byte order mark rule), checks OUT for --resume exactly as the local mode does
(runtime/dataset_file.answers_file: the same lock, the same checks, the same model_sha256), and cuts the rest of the
file into parts of `part_records` requests: (byte offset, first line number, requests). The parts are a Ray Dataset
(ray.data.from_items) mapped by a pool of actors (map_batches, ActorPoolStrategy), each holding one loaded ClefModel
(the CLI's load options, --adapter included). An actor reads its part from its offset with the same reader and
decides it as the local mode does (dataset_file.answered_records: the model's batches, its state cache, with
--sort-by-state a part's requests grouped by state), into answer lines made by the local mode's answer_line. Ray
Data gives the parts back in input order (preserve_order) and the driver writes their lines with the local mode's
writer (write_line): the same bytes (but `cached_tokens`, which says what each actor's cache held), the same fsync
rule, --resume either way.

The model, --mmproj, --adapter, the input and its image files must be at the same path on every node that runs an
actor: each actor opens them there. An actor that cannot load the model stops the run with its reason; one whose file
is another model (another identity) than the driver's stops it too.

Faults: Ray Data restarts an actor whose process dies and runs its part again (an actor pool's max_restarts=-1 and
max_task_retries=-1): no request is lost, and none is written twice, since a part's lines are written once it comes
back whole. A signal stops the run with OUT's lines whole (`--resume` continues it, with or without --ray); a local
cluster is stopped with it. Memory: the driver holds an (offset, line, count) triple per part (4k for a million
lines at 256 a part) and the parts Ray Data holds in flight.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import IO, Any

import numpy as np
import ray
from ray.exceptions import RayError

from ..check.validate import open_validated
from ..errors import ClefError, DeploymentError, ModelFileError, RequestError, SettingsError
from ..quality.labelled import labelled_records
from ..quality.scoring import Progress as ScoreProgress
from ..quality.scoring import Run, score_records
from ..runtime.catalog import adapter_file_identity
from ..runtime.dataset_file import Progress, Summary, answer_line, answered_records, answers_file, tally, write_line
from ..runtime.model import load as load_model
from ..runtime.reader import Record, count_records, read_records
from ..settings import MAX_LINE_BYTES, FileOptions, LoadOptions
from .ray_local import imported_from_here, join, probe, remove_session

PART_RECORDS = 256  # requests an actor decides at a time (the local mode's --sort-by-state window)
IN_FLIGHT_PER_ACTOR = 2  # parts queued on an actor: the next one ready when it finishes one, few lost to a crash


@dataclass(frozen=True)
class RayData:
    """Where and with what the dataset runs: `--ray`'s options, and how each actor loads the model."""

    address: str | None = None  # None: a local cluster, started and stopped here (on loopback: ray_local.py)
    workers: int | None = None  # actors (None: the cluster's CPUs, each actor taking n_threads of them)
    load: LoadOptions = field(default_factory=LoadOptions)  # each actor's load()
    part_records: int = PART_RECORDS
    adapter: str | Path | None = None  # the fine-tune that answers every request (decide's and eval's --adapter)

    @property
    def threads(self) -> int:
        return self.load.n_threads or 1  # (as `serve --ray`'s replicas: one llama.cpp thread unless told)


@dataclass(frozen=True)
class _Model:
    """What the driver knows of the model without loading it: what --resume checks (protocols.FileModel)."""

    path: Path
    identity: str
    header_digest: str


def _model_identity(model: Path, adapter: str | Path | None) -> _Model:
    validated = open_validated(model)  # a file that is no Clef model is refused here, with validate's message
    try:
        identity, digest = validated.file.identity(), validated.file.digest()
        if adapter is not None:  # read once and checked against its base as a load checks it, before any Ray process
            try:  # (the head-less check is each actor's load's, which knows whether the base's head was asked for)
                identity = adapter_file_identity(validated.file, identity, Path(adapter), base_head=True)
            except OSError as e:
                raise ModelFileError(f"--adapter {adapter}: cannot read ({e.strerror or e})") from None
    finally:
        validated.close()
    return _Model(model, identity, digest)


class _PartDecider:
    """A Ray Data actor: one loaded model, deciding parts of the input file (`mode` "decide": answer lines; "score":
    eval's per-question probabilities)."""

    def __init__(
        self,
        *,
        model: str,
        load: LoadOptions,
        adapter: str | None,
        source: str,
        identity: str,
        mode: str,
        options: dict[str, Any],
    ) -> None:
        try:
            self.model = load_model(model, adapter=adapter, **load.kwargs())
        except ClefError as e:
            # The same type (its exit code) with where it happened: the driver raises it as it is (_mapped).
            raise same_error(e, f"a Ray worker on {ray.util.get_node_ip_address()} cannot load the model: {e}") from None
        if self.model.identity != identity:
            node = ray.util.get_node_ip_address()
            raise ModelFileError(f"{model} on the Ray node {node} is another model than the driver's: put the same file there")
        self.source, self.mode, self.options = source, mode, options

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        offset, first, count = (int(batch[k][0]) for k in ("offset", "line", "count"))
        limit = self.options["max_line_bytes"]
        with open(self.source, "rb") as file:
            file.seek(offset)
            records = islice(read_records(file, limit, first), count)
            result = self._decide(records) if self.mode == "decide" else self._score(records)
        return {"payload": np.array([pickle.dumps(result, protocol=5)], dtype=object)}

    def _decide(self, records: Iterator[Any]) -> tuple[list[bytes], list[tuple[bool, int, bool]]]:
        o = self.options
        answered = answered_records(
            self.model,
            records,
            max_line_bytes=o["max_line_bytes"],
            sort_by_state=o["sort_by_state"],
            base=Path(o["base"]),
            anywhere=o["anywhere"],
        )
        lines, tallies = [], []
        for record, outcome in answered:
            lines.append(answer_line(record, outcome, self.model.identity))
            tallies.append(tally(outcome))
        return lines, tallies

    def _score(self, records: Iterator[Any]) -> Run:
        run = Run("", "")
        items = labelled_records(records, max_line_bytes=self.options["max_line_bytes"])
        score_records(self.model, items, run, base=Path(self.options["base"]))
        return run


@contextmanager
def _cluster(address: str | None, cpus: int) -> Iterator[None]:
    """Connected to the Ray cluster at `address`, or to a local one started here and stopped after (on loopback, as
    `serve --ray`'s: ray_local.py); a process already connected (a test, a notebook) stays as it is."""
    if ray.is_initialized():
        yield
        return
    with imported_from_here():  # (Ray puts the driver's working directory first on its workers' sys.path)
        if address is None:
            context = join(None, num_cpus=cpus, include_dashboard=False, log_to_driver=False)
            session: Path | None = Path(context.address_info["session_dir"])
        else:
            session = None
            join(address, log_to_driver=False)  # (bounded: no cluster there is a SettingsError in seconds)
    try:
        yield
    finally:
        ray.shutdown(wait_for_processes=session is not None)
        if session is not None:
            remove_session(session)


def _parts(file: IO[bytes], records: Iterator[Record], first_line: int, size: int) -> list[dict[str, int]]:
    """The rest of the input (`records`, read from `file`), in parts of `size` requests: where each starts (offset,
    line) and its count."""
    parts = []
    offset, line, count = file.tell(), first_line, 0
    for record in records:
        count += 1
        if count == size:
            parts.append({"offset": offset, "line": line, "count": count})
            offset, line, count = file.tell(), record.line + 1, 0  # (the reader stops right after a record's line)
    if count:
        parts.append({"offset": offset, "line": line, "count": count})
    return parts


def _workers(settings: RayData) -> int:
    if settings.workers is not None:
        return settings.workers
    return max(1, int(ray.cluster_resources().get("CPU", 1) // settings.threads))


def _mapped(parts: list[dict[str, int]], settings: RayData, workers: int, **constructor: Any) -> Iterator[Any]:
    """Each part's result, in input order, from a pool of `workers` actors (_PartDecider(**constructor))."""
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False  # (the CLI's own bar says it)
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    dataset = ray.data.from_items(parts, override_num_blocks=len(parts)).map_batches(
        _PartDecider,
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=IN_FLIGHT_PER_ACTOR),
        num_cpus=settings.threads,
        fn_constructor_kwargs=constructor,
    )
    try:
        for row in dataset.iter_rows():
            yield pickle.loads(row["payload"])
    except Exception as e:  # Ray's wrappers (RayTaskError, Ray Data's UserCodeException, ...) of a worker's error
        typed = clef_cause(e)
        if typed is not None:  # an actor's own typed error: its one line and exit code, as the local mode's
            raise typed from None
        if isinstance(e, RayError):
            raise DeploymentError(f"the run on Ray stopped: {_reason(e)}") from None
        raise


def same_error(error: ClefError, message: str) -> ClefError:
    """`error`'s type with `message` (a ModelFileError where that type is not built from a message alone)."""
    try:
        return type(error)(message)
    except TypeError:
        return ModelFileError(message)


def clef_cause(error: BaseException) -> ClefError | None:
    """The ClefError a Ray error wraps (its `cause`, or the exceptions it was raised from), None if none."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ClefError) and not isinstance(e, RayError):  # (a RayTaskError may subclass its cause's type)
            return e
        cause = getattr(e, "cause", None)
        todo += [cause if isinstance(cause, BaseException) else None, e.__cause__, e.__context__]
    return None


def _reason(error: RayError) -> str:
    """Ray's error in one line: a worker's own error (the last line of its traceback) when there is one."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    mine = [line for line in lines if "Error:" in line and "clef_gguf" not in line]
    return (mine[-1] if mine else lines[-1] if lines else type(error).__name__).strip()


def _paths(model: Path, source: str, settings: RayData) -> dict[str, Any]:
    """The actors' model, load options, adapter and input, with absolute paths, as every node sees them; stdin
    refused (the actors read the file themselves)."""
    if source == "-":
        raise SettingsError("--ray reads the input file on every node: give a file, not - (stdin)")
    if not Path(source).is_file():
        raise SettingsError(f"--ray reads {source} on every node: it must be a regular file")
    mmproj, adapter = (path and str(Path(path).resolve()) for path in (settings.load.mmproj, settings.adapter))
    load = replace(settings.load, mmproj=mmproj, n_threads=settings.threads)
    return {"model": str(model.resolve()), "load": load, "adapter": adapter, "source": str(Path(source).resolve())}


def decide_file_on_ray(
    model: Path,
    source: str,
    out: str,
    settings: RayData,
    options: FileOptions | None = None,
    progress: Progress | None = None,
) -> Summary:
    """runtime.dataset_file.decide_file on a Ray cluster, with the same `options`: the same answers file (sort_by_state:
    each part's requests decided grouped by state, in windows of 256 as the local mode's)."""
    o = options or FileOptions()
    constructor = _paths(model, source, settings)
    known = _model_identity(Path(constructor["model"]), constructor["adapter"])
    if settings.address is not None and not ray.is_initialized():
        probe(settings.address)  # no cluster there: refused before OUT is created (join probes again, then connects)
    with answers_file(known, source, out, resume=o.resume, force=o.force, max_line_bytes=o.max_line_bytes) as run:
        summary = run.summary
        parts = _parts(run.input, run.records, run.next_line, settings.part_records)
        if progress:
            progress(summary, run.total)
        if not parts:
            return summary
        part = {"max_line_bytes": o.max_line_bytes, "base": str(Path(source).resolve().parent), "anywhere": o.images_anywhere}
        part["sort_by_state"] = o.sort_by_state
        with _cluster(settings.address, _local_cpus(settings)):
            summary.workers = workers = min(_workers(settings), len(parts))  # (an actor with no part would load for nothing)
            constructor["identity"] = known.identity
            for lines, tallies in _mapped(parts, settings, workers, **constructor, mode="decide", options=part):
                for line, counted in zip(lines, tallies, strict=True):
                    write_line(run.output, out, line, counted, summary)
                if progress:
                    progress(summary, run.total)
    return summary


def _local_cpus(settings: RayData) -> int:
    """A local cluster's CPUs: the machine's, or as many as the actors reserve (never a pool left waiting)."""
    return max(os.cpu_count() or 1, (settings.workers or 1) * settings.threads)


def score_on_ray(address: str | None, workers: int | None) -> Callable[..., Run]:
    """quality.scoring.score_path on a Ray cluster (evaluate's `score`): the same Run, its records decided by actors."""

    def score(
        model: str | Path,
        data: str | Path,
        *,
        stage: str,
        progress: ScoreProgress | None = None,
        max_line_bytes: int = MAX_LINE_BYTES,
        **load: Any,
    ) -> Run:
        adapter = load.pop("adapter", None)
        settings = RayData(address, workers, LoadOptions(**load), adapter=adapter)
        return _score(Path(model), str(data), settings, stage, progress, max_line_bytes)

    return score


def _score(model: Path, data: str, settings: RayData, stage: str, progress: ScoreProgress | None, max_line_bytes: int) -> Run:
    constructor = _paths(model, data, settings)
    known = _model_identity(Path(constructor["model"]), constructor["adapter"])
    run, total, started = Run(str(model), str(Path(data))), count_records(Path(data)), time.perf_counter()
    try:
        with open(data, "rb") as file:
            parts = _parts(file, read_records(file, max_line_bytes), 1, settings.part_records)
    except OSError as e:
        raise RequestError(f"cannot read {data}: {e.strerror or e}") from None
    options = {"max_line_bytes": max_line_bytes, "base": str(Path(data).resolve().parent)}
    if not parts:  # (no request: evaluate says so)
        return run
    with _cluster(settings.address, _local_cpus(settings)):
        constructor["identity"] = known.identity
        workers = min(_workers(settings), len(parts))
        for part in _mapped(parts, settings, workers, **constructor, mode="score", options=options):
            run.bad += part.bad
            run.decided += part.decided
            run.tokens += part.tokens
            if progress:
                progress(stage, len(run.decided) + len(run.bad), total, "")
    run.seconds = time.perf_counter() - started
    return run

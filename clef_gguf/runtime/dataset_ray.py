"""`clef-gguf decide MODEL DATA.jsonl -o OUT --ray`: the dataset mode on Ray Data, beside its local half (dataset_file.py).

The driver (this process) reads the input once with the dataset mode's reader (reader.read_records: its line numbers,
line cap and byte order mark rule), checks OUT for --resume exactly as the local mode does (dataset_file.answers_file:
the same lock, the same checks, the same model_sha256), and cuts the rest of the file into parts of `part_records`
requests: (byte offset, first line number, requests). The parts are a Ray Dataset (ray.data.from_items) mapped by a
pool of actors (map_batches, ActorPoolStrategy), each holding one ClefModel built from the CLI's ModelSpec (its load
options, and --adapter: the spec's pinned adapter). An actor reads its part from its offset with the same reader and
runs its job on it: decide's (DecidePart: dataset_file.answered_records, the model's batches, its state cache, with
--sort-by-state a part's requests grouped by state, into answer lines made by the local mode's answer_line), or
eval's (quality/scoring_ray.py, which maps its parts here too). Ray Data gives the parts back in input order
(preserve_order) and the driver writes their lines with the local mode's writer (write_line): the same bytes (but
`cached_tokens`, which says what each actor's cache held), the same fsync rule, --resume either way.

The model, --mmproj, --adapter, the input and its image files must be at the same path on every node that runs an
actor: each actor opens them there. An actor that cannot load the model stops the run with its reason; one whose file
is another model (another identity) than the driver's stops it too.

Faults: Ray Data restarts an actor whose process dies and runs its part again (an actor pool's max_restarts=-1 and
max_task_retries=-1): no request is lost, and none is written twice, since a part's lines are written once it comes
back whole. A signal stops the run with OUT's lines whole (`--resume` continues it, with or without --ray); a local
cluster is stopped with it (ray_local.cluster). Memory: the driver holds an (offset, line, count) triple per part (4k
for a million lines at 256 a part) and the parts Ray Data holds in flight.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import ray
from ray.exceptions import RayError

from ..check.validate import open_validated
from ..errors import ClefError, CorruptModelError, DeploymentError, ModelFileError, SettingsError
from ..settings import FileOptions, ModelSpec
from .catalog import adapter_file_identity
from .dataset_file import Progress, Summary, Tally, answer_line, answered_records, answers_file, tally, write_line
from .model import ClefModel
from .ray_local import cluster, probe
from .reader import Record, read_records

PART_RECORDS = 256  # requests an actor decides at a time (the local mode's --sort-by-state window)
IN_FLIGHT_PER_ACTOR = 2  # parts queued on an actor: the next one ready when it finishes one, few lost to a crash


@dataclass(frozen=True)
class RayData:
    """Where the dataset runs: `--ray`'s options (what each actor builds is the ModelSpec's)."""

    address: str | None = None  # None: a local cluster, started and stopped here (on loopback: ray_local.py)
    workers: int | None = None  # actors (None: the cluster's CPUs, each actor taking its model's n_threads of them)
    part_records: int = PART_RECORDS


@dataclass(frozen=True)
class _Model:
    """What the driver knows of the model without loading it: what --resume checks (protocols.FileModel)."""

    path: Path
    identity: str
    header_digest: str


@dataclass(frozen=True)
class Actors:
    """What each actor builds and reads, with absolute paths as every node sees them (ModelSpec.placed), and the
    identity its model must have (the driver's)."""

    spec: ModelSpec  # its n_threads set: the CPUs Ray reserves for each actor
    source: str
    identity: str

    @property
    def threads(self) -> int:
        return self.spec.options.n_threads or 1


class PartJob(Protocol):
    """What an actor does with its part's records (picklable: handed to every actor)."""

    @property
    def max_line_bytes(self) -> int: ...

    def __call__(self, model: ClefModel, records: Iterator[Record]) -> Any: ...


@dataclass(frozen=True)
class DecidePart:
    """decide's job: a part's answer lines and what each counts, as the local mode writes them with `options`."""

    options: FileOptions
    base: str  # the input's folder: image paths are relative to it

    @property
    def max_line_bytes(self) -> int:
        return self.options.max_line_bytes

    def __call__(self, model: ClefModel, records: Iterator[Record]) -> tuple[list[bytes], list[Tally]]:
        o = self.options
        grouped = {"sort_by_state": o.sort_by_state, "base": Path(self.base), "anywhere": o.images_anywhere}
        lines, tallies = [], []
        for record, outcome in answered_records(model, records, max_line_bytes=o.max_line_bytes, **grouped):
            lines.append(answer_line(record, outcome, model.identity))
            tallies.append(tally(outcome))
        return lines, tallies


def _model_identity(spec: ModelSpec) -> _Model:
    model, adapter, base_head = Path(spec.path), spec.adapter_set.adapter, spec.adapter_set.base_head
    validated = open_validated(model)  # a file that is no Clef model is refused here, with validate's message
    try:
        identity, digest = validated.file.identity(), validated.file.digest()
        if adapter is not None:  # read once and checked against its base as a load checks it, before any Ray process
            try:
                identity = adapter_file_identity(validated.file, identity, Path(adapter), base_head=base_head)
            except OSError as e:  # (the message and exit code of the load's own: catalog_versions.Versions.first)
                raise CorruptModelError(f"{adapter}: cannot read ({e.strerror or e})") from None
    finally:
        validated.close()
    return _Model(model, identity, digest)


class _PartActor:
    """A Ray Data actor: one loaded model, running a job on parts of the input file."""

    def __init__(self, *, actors: Actors, job: PartJob) -> None:
        try:
            self.model = ClefModel(actors.spec)
        except ClefError as e:
            # The same type (its exit code) with where it happened: the driver raises it as it is (mapped).
            raise same_error(e, f"a Ray worker on {ray.util.get_node_ip_address()} cannot load the model: {e}") from None
        if self.model.identity != actors.identity:
            where = f"{actors.spec.path} on the Ray node {ray.util.get_node_ip_address()}"
            raise ModelFileError(f"{where} is another model than the driver's: put the same file there")
        self.source, self.job = actors.source, job

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        offset, first, count = (int(batch[k][0]) for k in ("offset", "line", "count"))
        with open(self.source, "rb") as file:
            file.seek(offset)
            result = self.job(self.model, islice(read_records(file, self.job.max_line_bytes, first), count))
        return {"payload": np.array([pickle.dumps(result, protocol=5)], dtype=object)}


def parts(file: IO[bytes], records: Iterator[Record], first_line: int, size: int) -> list[dict[str, int]]:
    """The rest of the input (`records`, read from `file`), in parts of `size` requests: where each starts (offset,
    line) and its count."""
    found = []
    offset, line, count = file.tell(), first_line, 0
    for record in records:
        count += 1
        if count == size:
            found.append({"offset": offset, "line": line, "count": count})
            offset, line, count = file.tell(), record.line + 1, 0  # (the reader stops right after a record's line)
    if count:
        found.append({"offset": offset, "line": line, "count": count})
    return found


@contextmanager
def actor_pool(settings: RayData, actors: Actors, parts: int) -> Iterator[int]:
    """On the cluster (ray_local.cluster: settings.address, or a local one for the time of the run, with as many CPUs as
    the machine's or as the actors reserve: never a pool left waiting): the actors to start, settings.workers or as
    many as the cluster's CPUs hold, never more than the parts (an actor with no part would load for nothing)."""
    cpus = max(os.cpu_count() or 1, (settings.workers or 1) * actors.threads)
    with cluster(settings.address, log_to_driver=False, num_cpus=cpus):
        fits = max(1, int(ray.cluster_resources().get("CPU", 1) // actors.threads))
        yield min(fits if settings.workers is None else settings.workers, parts)


def mapped(actors: Actors, job: PartJob, parts: list[dict[str, int]], workers: int) -> Iterator[Any]:
    """Each part's result (job's), in input order, from a pool of `workers` actors."""
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False  # (the CLI's own bar says it)
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    dataset = ray.data.from_items(parts, override_num_blocks=len(parts)).map_batches(
        _PartActor,
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=workers, max_tasks_in_flight_per_actor=IN_FLIGHT_PER_ACTOR),
        num_cpus=actors.threads,
        fn_constructor_kwargs={"actors": actors, "job": job},
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


def actors_for(spec: ModelSpec, source: str) -> tuple[Actors, _Model]:
    """The actors' spec and input, with absolute paths, as every node sees them, one llama.cpp thread each unless the
    spec says (as `serve --ray`'s replicas), and the model as the driver knows it (read here, the pinned adapter
    checked against its base, before any Ray process); stdin refused (the actors read the file themselves)."""
    if source == "-":
        raise SettingsError("--ray reads the input file on every node: give a file, not - (stdin)")
    if not Path(source).is_file():
        raise SettingsError(f"--ray reads {source} on every node: it must be a regular file")
    placed = spec.placed()
    placed = replace(placed, options=replace(placed.options, n_threads=placed.options.n_threads or 1))
    known = _model_identity(placed)
    return Actors(placed, str(Path(source).resolve()), known.identity), known


def decide_file_on_ray(
    spec: ModelSpec,
    source: str,
    out: str,
    settings: RayData,
    options: FileOptions | None = None,
    progress: Progress | None = None,
) -> Summary:
    """runtime.dataset_file.decide_file on a Ray cluster, the model `spec` declares on each actor, with the same
    `options`: the same answers file (sort_by_state: each part's requests decided grouped by state, in windows of 256
    as the local mode's)."""
    o = options or FileOptions()
    actors, known = actors_for(spec, source)
    if settings.address is not None and not ray.is_initialized():
        probe(settings.address)  # no cluster there: refused before OUT is created (join probes again, then connects)
    with answers_file(known, source, out, resume=o.resume, force=o.force, max_line_bytes=o.max_line_bytes) as run:
        summary = run.summary
        cut = parts(run.input, run.records, run.next_line, settings.part_records)
        if progress:
            progress(summary, run.total)
        if not cut:
            return summary
        job = DecidePart(o, str(Path(actors.source).parent))
        with actor_pool(settings, actors, len(cut)) as workers:
            summary.workers = workers
            for lines, tallies in mapped(actors, job, cut, workers):
                for line, counted in zip(lines, tallies, strict=True):
                    write_line(run.output, out, line, counted, summary)
                if progress:
                    progress(summary, run.total)
    return summary

"""Per-adapter metrics: what a decider's observer (runtime/loaded.AdapterObserver) is told, counted by adapter, and
the series /metrics shows of them; on Ray, each replica's counts reach the ingress's /metrics with its decisions.

An adapter's label is the name requests use (the name of the request whose batch caused the event: one file under two
names is loaded once, under the first name asked). The first ServeSettings.metrics_adapter_cap names a process serves
(decides, loads, or has a source deliver) get a label of their own; those after share OTHER, so that a folder of many
files, or a busy one, cannot grow the series without bound. A name never served (one a source refused or failed to
deliver, a junk name of an allowed namespace) never takes a label: its events count under OTHER, so that a stream of
names that do not exist cannot crowd the adapters that do out of their labels. So a first use's disk-cache misses,
before its delivery, count under OTHER too; its lookups after, under its own.

With adapter sources (runtime/sources.py) the same labels count what the sources' observer is told: each look in the
disk cache for a name a source fetches (a disk lookup; a hit, when it was there), each first-use fetch's and
conversion's seconds, and each failed fetch by its error's row (a bounded set: errors.py's table). A fetch counts under
the name of the request that started it; the others that waited for it count lookups only.

A lookup is a batch (or a step of a prompt decided in steps: each applies its adapter again) that needed the adapter
in memory; a hit, one that found it loaded. A lookup that missed is a load, unless the load failed: so loads equal
lookups less hits, and resident versions equal loads less evictions and retirements.

On Ray (ray_serve.py) a replica's counts travel with its decisions: each Decision carries the replica's Snapshot when
its counts changed since the last it sent (every event happens inside a decision, so the newest snapshot has them
all), and the ingress keeps each replica's newest (ReplicaFigures), labelled `replica`. A replica that stopped keeps
its last figures there, as counters of a series that ended, until REPLICAS_KEPT replicas were heard from since.
"""

from __future__ import annotations

import copy
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ..errors import ClefError
from ..runtime.sources import SourceObserver

OTHER = "_other"  # (no adapter's name: names begin with a letter or a digit, catalog_names.py)
# From a small adapter's load off a warm page cache (milliseconds) to a large one's from a slow disk.
REPLICAS_KEPT = 256  # replicas whose counts the Ray ingress shows
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# From a small adapter file off a near mirror to a large checkpoint's download or conversion on a busy machine.
FETCH_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Figures:
    """One label's counts."""

    lookups: int = 0
    hits: int = 0
    loads: int = 0
    evictions: int = 0
    retirements: int = 0
    resident: int = 0  # versions loaded now
    resident_bytes: int = 0
    load_seconds: float = 0.0  # the sum of the loads' seconds
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))  # per bucket, +Inf last
    disk_lookups: int = 0  # (a source's: runtime/sources.SourceObserver's events)
    disk_hits: int = 0
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    fetch_buckets: list[int] = field(default_factory=lambda: [0] * (len(FETCH_BUCKETS) + 1))
    conversion_seconds: float = 0.0
    conversion_buckets: list[int] = field(default_factory=lambda: [0] * (len(FETCH_BUCKETS) + 1))
    failures: dict[str, int] = field(default_factory=dict)  # by the error's row (errors.py's Problem.name, lower case)


@dataclass(frozen=True)
class Snapshot:
    """A process's counts at one moment (what a replica sends the ingress): by label, and the versions loaded."""

    generation: int  # grows with every event: the newest of two snapshots of one process has the larger
    figures: dict[str, Figures]
    resident: frozenset[str] = frozenset()  # identities loaded now (/v1/models' state)


class Labels:
    """The label each adapter name counts under, the one place that decides it: its own for the first `cap` names
    served, OTHER for those after and for a name not served; thread-safe. A process's per-adapter series and its
    decided requests' `model` label (metrics.py) share one, so that a name is labelled alike in every series and none
    can grow them without bound."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._own: set[str] = set()  # the names with a label of their own

    def __call__(self, name: str) -> str:
        """(a served name: decided, loaded or delivered) Its label, taking one of its own while the cap allows."""
        with self._lock:
            if name in self._own:
                return name
            if len(self._own) < self.cap:
                self._own.add(name)
                return name
            return OTHER

    def held(self, name: str) -> str | None:
        """(a name not served yet) Its own label if it has one already, else None: it takes none."""
        with self._lock:
            return name if name in self._own else None


class AdapterCounts(SourceObserver):
    """The observer a server hands its model (ClefModel(spec, observer, source_observer)): the decider's events
    (runtime/loaded.AdapterObserver's, not imported here: it loads llama.cpp, which the app never does) and the adapter
    sources', counted by label; thread-safe."""

    def __init__(self, cap: int) -> None:
        self.label = Labels(cap)
        self._lock = threading.Lock()
        self._figures: dict[str, Figures] = {}
        self.generation = 0

    def _of(self, name: str, served: bool = True) -> Figures:
        """(Under the lock) The figures `name` counts under: a served name's label (Labels); a name not served yet, its
        own label if it holds one, else OTHER's. The generation moved on (an event is being counted)."""
        self.generation += 1
        return self._figures.setdefault(self.label(name) if served else self.label.held(name) or OTHER, Figures())

    def used(self, name: str, resident: bool) -> None:
        with self._lock:
            figures = self._of(name)
            figures.lookups += 1
            figures.hits += resident

    def loaded(self, name: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            figures = self._of(name)
            figures.loads += 1
            figures.resident += 1
            figures.resident_bytes += nbytes
            figures.load_seconds += seconds
            figures.load_buckets[bisect_left(LOAD_BUCKETS, seconds)] += 1

    def evicted(self, name: str, nbytes: int) -> None:
        with self._lock:
            figures = self._unloaded(name, nbytes)
            figures.evictions += 1

    def retired(self, name: str, nbytes: int) -> None:
        with self._lock:
            figures = self._unloaded(name, nbytes)
            figures.retirements += 1

    def looked_up(self, name: str, hit: bool) -> None:
        with self._lock:
            figures = self._of(name, served=hit)  # (a hit: delivered before, a name that exists)
            figures.disk_lookups += 1
            figures.disk_hits += hit

    def fetched(self, name: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            figures = self._of(name)
            figures.fetched_bytes += nbytes
            figures.fetch_seconds += seconds
            figures.fetch_buckets[bisect_left(FETCH_BUCKETS, seconds)] += 1

    def converted(self, name: str, seconds: float) -> None:
        with self._lock:
            figures = self._of(name)
            figures.conversion_seconds += seconds
            figures.conversion_buckets[bisect_left(FETCH_BUCKETS, seconds)] += 1

    def failed(self, name: str, error: ClefError) -> None:
        with self._lock:
            figures, reason = self._of(name, served=False), error.problem.name.lower()
            figures.failures[reason] = figures.failures.get(reason, 0) + 1

    def _unloaded(self, name: str, nbytes: int) -> Figures:
        figures = self._of(name)
        figures.resident -= 1
        figures.resident_bytes -= nbytes
        return figures

    def snapshot(self, resident: frozenset[str] = frozenset()) -> Snapshot:
        """The counts now (copies), with the identities loaded now."""
        with self._lock:
            figures = {label: copy.deepcopy(f) for label, f in self._figures.items()}
            return Snapshot(self.generation, figures, resident)


class ReplicaFigures:
    """The ingress's view of the replicas' counts: each replica's newest snapshot (Decision.adapters), for the
    REPLICAS_KEPT replicas heard from last (autoscaling's churn cannot grow the series without bound)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: OrderedDict[str, Snapshot] = OrderedDict()  # the replica heard from last, last

    def take(self, replica: str, snapshot: Snapshot) -> None:
        """A replica's snapshot, kept unless one it sent later arrived first."""
        with self._lock:
            kept = self._replicas.get(replica)
            if kept is None or kept.generation < snapshot.generation:
                self._replicas[replica] = snapshot
            self._replicas.move_to_end(replica)
            while len(self._replicas) > REPLICAS_KEPT:
                self._replicas.popitem(last=False)

    def labelled(self) -> list[tuple[dict[str, str], Snapshot]]:
        with self._lock:
            return [({"replica": replica}, snapshot) for replica, snapshot in sorted(self._replicas.items())]

    def resident(self) -> frozenset[str]:
        """The identities loaded on any replica."""
        with self._lock:
            return frozenset().union(*(s.resident for s in self._replicas.values()))


Labelled = Callable[[], Iterable[tuple[dict[str, str], Snapshot]]]  # each process's snapshot, with its own labels


@dataclass(frozen=True)
class _Series:
    name: str
    help: str
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily]
    read: Callable[[Figures], float]


_COUNTER, _GAUGE = CounterMetricFamily, GaugeMetricFamily
SERIES = (
    _Series("clef_adapter_lookups", "Batches that needed the adapter in memory.", _COUNTER, lambda f: f.lookups),
    _Series("clef_adapter_memory_hits", "Of those, the batches that found it loaded.", _COUNTER, lambda f: f.hits),
    _Series("clef_adapter_loads", "Loads of the adapter (its LoRA and head) into the model.", _COUNTER, lambda f: f.loads),
    _Series("clef_adapter_evictions", "Unloads to make room (--max-adapters, --adapter-memory)", _COUNTER, lambda f: f.evictions),
    _Series("clef_adapter_retirements", "Unloads of a version whose file was replaced.", _COUNTER, lambda f: f.retirements),
    _Series("clef_adapter_resident", "Versions of the adapter loaded now.", _GAUGE, lambda f: f.resident),
    _Series("clef_adapter_resident_bytes", "Bytes of its loaded versions (LoRA and head).", _GAUGE, lambda f: f.resident_bytes),
)
SOURCE_SERIES = (  # (shown once a source was asked for a name: a server with no --adapter-source has none)
    _Series("clef_adapter_disk_lookups", "Looks in the disk cache for a source's name.", _COUNTER, lambda f: f.disk_lookups),
    _Series("clef_adapter_disk_hits", "Of those, the looks that found it there.", _COUNTER, lambda f: f.disk_hits),
    _Series("clef_adapter_fetched_bytes", "Bytes its source delivered (first uses).", _COUNTER, lambda f: f.fetched_bytes),
)


@dataclass(frozen=True)
class AdapterView:
    """What the app shows of the adapters: the snapshots /metrics shows (each with its own labels: a replica's), the
    identities loaded now (/v1/models' states), and the label of an adapter's name (None: the app's own Labels)."""

    labelled: Labelled
    resident: Callable[[], frozenset[str]]
    label: Callable[[str], str] | None = None


def local_view(counts: AdapterCounts | None, resident: Callable[[], frozenset[str]]) -> AdapterView:
    """The view of one process's model: its counts (None: not counted) and its loaded versions."""
    if counts is None:
        return AdapterView(lambda: [], resident)
    return AdapterView(lambda: [({}, counts.snapshot())], resident, counts.label)


class AdapterCollector:
    """The per-adapter series of every snapshot `read` gives, for a registry (prometheus_client's custom collector)."""

    def __init__(self, read: Labelled) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        labelled = [(labels, label, f) for labels, snapshot in self._read() for label, f in sorted(snapshot.figures.items())]
        if not labelled:
            return  # (no adapter used yet, or none served: no empty families)
        names = ["adapter", *sorted({key for labels, _, _ in labelled for key in labels})]
        rows = [([label, *(labels[key] for key in names[1:])], f) for labels, label, f in labelled]
        sourced = any(f.disk_lookups or f.failures for _, f in rows)
        for series in (*SERIES, *(SOURCE_SERIES if sourced else ())):
            family = series.kind(series.name, series.help, labels=names)
            for values, f in rows:
                family.add_metric(values, series.read(f))
            yield family
        yield _histogram("clef_adapter_load_seconds", "Seconds an adapter's load took.", names, LOAD_BUCKETS, rows, "load")
        if not sourced:
            return
        yield _histogram("clef_adapter_fetch_seconds", "Seconds a first use's fetch took.", names, FETCH_BUCKETS, rows, "fetch")
        converted = "Seconds a fetched checkpoint's conversion took."
        yield _histogram("clef_adapter_conversion_seconds", converted, names, FETCH_BUCKETS, rows, "conversion")
        failed = "Fetches refused or failed, by their error's row."
        failures = CounterMetricFamily("clef_adapter_fetch_failures", failed, labels=[*names, "reason"])
        for values, f in rows:
            for reason, count in sorted(f.failures.items()):
                failures.add_metric([*values, reason], count)
        yield failures


def _histogram(
    name: str, text: str, names: list[str], bounds: tuple[float, ...], rows: list[tuple[list[str], Figures]], what: str
) -> HistogramMetricFamily:
    """A histogram family of each row's `what`_buckets (per bucket, +Inf last) and `what`_seconds (their sum)."""
    family = HistogramMetricFamily(name, text, labels=names)
    for values, f in rows:
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, bounds), "+Inf"), getattr(f, f"{what}_buckets"), strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric(values, buckets, getattr(f, f"{what}_seconds"))
    return family

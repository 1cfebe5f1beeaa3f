"""Seen per adapter (server/adapter_metrics.py): a scrape after a scripted workload shows each adapter's exact lookups,
in-memory hits, loads, evictions and resident versions; names past --metrics-adapter-cap share `_other`; /v1/models
says of each model whether it is resident, on disk or refused (and why). The same on `serve --ray`, every replica's
counts on the ingress's scrape, is tests/test_adapter_refusals.py's (on the session's Ray cluster).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import served
from peft_adapters import peft_adapter
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from clef_gguf.errors import AdapterTooLargeError, SourceUnavailableError
from clef_gguf.server.adapter_metrics import LOAD_BUCKETS, OTHER, AdapterCollector, AdapterCounts, ReplicaFigures

TIMEOUT = httpx.Timeout(300.0)
SHORT = {"state": "s", "questions": {"q": {"type": "noul"}}}
COUNTED = ("lookups", "memory_hits", "loads", "evictions", "retirements")


def adapter_figures(scraped: str) -> dict[str, dict[str, float]]:
    """Each adapter label's figures in a scrape: its counters (lookups, ...), resident, resident_bytes, load_count."""
    figures: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(scraped):
        for s in family.samples:
            if not s.name.startswith("clef_adapter_") or "le" in s.labels:
                continue
            what = s.name.removeprefix("clef_adapter_").removesuffix("_total").replace("load_seconds_count", "load_count")
            figures.setdefault(s.labels["adapter"], {})[what] = s.value
    return figures


def states(client: httpx.Client) -> dict[str, dict]:
    response = client.get("/v1/models")
    assert response.status_code == 200, response.text
    return {m["name"]: m for m in response.json()["models"]}


@pytest.fixture(scope="module")
def folder(ws, tmp_path_factory) -> Path:
    """Three fine-tunes of the fixture release (NAME.adapter.gguf) and a file that is no GGUF."""
    root = tmp_path_factory.mktemp("tunes")
    for seed, name in enumerate(("one", "two", "three")):
        peft_adapter(ws.release("untied_f32"), root, name, seed=seed)
    (root / "broken.adapter.gguf").write_text("this is no GGUF file\n" * 20)
    return root


@pytest.fixture(scope="module")
def client(ws, folder) -> Iterator[httpx.Client]:
    """`clef-gguf serve` over the folder: one adapter loaded at a time, labels of their own for the first two names."""
    args = ("--ctx", "4096", "--max-adapters", "1", "--metrics-adapter-cap", "2", "--adapter-dir", str(folder))
    with served(ws.gguf("untied_f32", "f32"), *args) as (url, _), httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        yield c


@pytest.mark.slow
def test_a_scrape_after_a_scripted_workload_shows_each_adapters_exact_counts(client, folder):
    assert "clef_adapter_" not in client.get("/metrics").text  # no series before an adapter is used
    listed = states(client)
    assert {n: listed[n]["state"] for n in ("one", "two", "three", "broken")} == {
        "one": "on_disk",
        "two": "on_disk",
        "three": "on_disk",
        "broken": "refused",
    }
    assert "broken.adapter.gguf" in listed["broken"]["reason"] and str(folder) not in listed["broken"]["reason"]
    assert listed["jev-latest"]["state"] == "resident"
    # --max-adapters 1: each switch evicts the one loaded. "three" comes third: past the cap of 2, it counts as _other.
    for name in ("one", "one", "two", "one", None, "two", "three"):
        response = client.post("/v1/systemone", json={**SHORT, "model": name} if name else SHORT)
        assert response.status_code == 200, (name, response.text)
    figures = adapter_figures(client.get("/metrics").text)
    want = {
        "one": dict(lookups=3, memory_hits=1, loads=2, evictions=2, retirements=0, resident=0, load_count=2),
        "two": dict(lookups=2, memory_hits=0, loads=2, evictions=2, retirements=0, resident=0, load_count=2),
        OTHER: dict(lookups=1, memory_hits=0, loads=1, evictions=0, retirements=0, resident=1, load_count=1),
    }
    assert {label: {k: f[k] for k in want[OTHER]} for label, f in figures.items()} == want
    assert figures["one"]["resident_bytes"] == figures["two"]["resident_bytes"] == 0
    assert figures[OTHER]["resident_bytes"] > 0 and figures[OTHER]["load_seconds_sum"] > 0
    listed = states(client)
    assert {n: listed[n]["state"] for n in ("one", "two", "three")} == {"one": "on_disk", "two": "on_disk", "three": "resident"}


@pytest.mark.slow
def test_the_decided_series_label_adapters_as_the_adapter_series_do_and_never_a_refused_name(client):
    """Every series with a `model` label (clef_decision_seconds, clef_prompt_tokens, ...) labels an adapter's name as the
    clef_adapter_* series do: the first --metrics-adapter-cap (2) names their own, later ones `_other`; a name refused
    (a broken file) or unknown is never decided, so never a label."""
    base = states(client)
    for name in ("one", "two", "three", "one", "three"):
        response = client.post("/v1/systemone", json={**SHORT, "model": name})
        assert response.status_code == 200, (name, response.text)
    for name in ("broken", "nope", "two/x"):
        assert client.post("/v1/systemone", json={**SHORT, "model": name}).status_code in (404, 422), name
    scraped = list(text_string_to_metric_families(client.get("/metrics").text))
    models = {s.labels["model"] for f in scraped for s in f.samples if "model" in s.labels}
    base_name = next(name for name, m in base.items() if m["description"].startswith("Clef decision model"))
    assert models == {base_name, "one", "two", OTHER}
    adapters = {s.labels["adapter"] for f in scraped for s in f.samples if "adapter" in s.labels}
    assert adapters == {"one", "two", OTHER}  # (the same names, labelled by the one Labels)
    decided = {
        s.labels["model"]: s.value
        for f in scraped
        for s in f.samples
        if s.name == "clef_decision_seconds_count" and s.labels["phase"] == "compute"
    }
    assert decided[OTHER] >= 2 and decided["one"] >= 2 and decided["two"] >= 1


def test_names_past_the_cap_share_one_label_and_loads_fall_in_their_buckets():
    """The observer alone (what the decider tells it): the first `cap` names keep their labels; an unload is counted
    under the label its name has; a load's seconds go to the first bucket at or above them."""
    counts = AdapterCounts(cap=1)
    counts.used("a", False)
    counts.loaded("a", LOAD_BUCKETS[0], 10)
    for name in ("b", "c"):
        counts.used(name, False)
        counts.loaded(name, LOAD_BUCKETS[2] + 1e-6, 5)
    counts.evicted("c", 5)
    counts.used("a", True)
    snapshot = counts.snapshot(frozenset({"id"}))
    a, other = snapshot.figures["a"], snapshot.figures[OTHER]
    assert set(snapshot.figures) == {"a", OTHER} and snapshot.resident == {"id"} and snapshot.generation == 8
    assert (a.lookups, a.hits, a.loads, a.resident, a.resident_bytes) == (2, 1, 1, 1, 10)
    assert (other.lookups, other.loads, other.evictions, other.resident, other.resident_bytes) == (2, 2, 1, 1, 5)
    assert a.load_buckets[0] == 1 and other.load_buckets[3] == 2 and sum(other.load_buckets) == 2


def test_the_ingress_keeps_each_replicas_newest_counts_whatever_order_they_arrive_in(monkeypatch):
    """A replica's decisions may come back out of order: its snapshot with the larger generation is the one kept; the
    resident versions are those of any replica; past REPLICAS_KEPT replicas, the one heard from least recently goes."""
    from clef_gguf.server import adapter_metrics
    from clef_gguf.server.adapter_metrics import ReplicaFigures

    counts = AdapterCounts(cap=4)
    counts.used("a", False)
    counts.loaded("a", 0.1, 7)
    older = counts.snapshot(frozenset({"x"}))
    counts.used("a", True)
    newer = counts.snapshot(frozenset({"x"}))
    figures = ReplicaFigures()
    figures.take("r1", newer)
    figures.take("r1", older)  # (arrived late)
    figures.take("r2", AdapterCounts(cap=4).snapshot(frozenset({"y"})))
    assert [(labels, s.figures["a"].lookups if "a" in s.figures else 0) for labels, s in figures.labelled()] == [
        ({"replica": "r1"}, 2),
        ({"replica": "r2"}, 0),
    ]
    assert figures.resident() == {"x", "y"}
    monkeypatch.setattr(adapter_metrics, "REPLICAS_KEPT", 2)
    figures.take("r1", newer)
    figures.take("r3", older)
    assert [labels["replica"] for labels, _ in figures.labelled()] == ["r1", "r3"]


def test_the_sources_events_count_by_label_and_reach_a_scrape_through_a_replicas_snapshot():
    """A replica's source events (runtime/sources.SourceObserver's) travel in its snapshot (pickled, as Ray sends it) to
    the ingress's series, under the cap, each failure by its error's row; a later event leaves a snapshot as it was."""
    counts = AdapterCounts(1)
    counts.looked_up("acme/a", False)
    counts.fetched("acme/a", 0.3, 1000)
    counts.converted("acme/a", 2.0)
    counts.looked_up("acme/a", True)
    counts.looked_up("acme/b", False)  # past the cap: OTHER
    counts.failed("acme/b", SourceUnavailableError("the Hub cannot be reached"))
    counts.failed("acme/b", AdapterTooLargeError("too large", "model"))
    snapshot = pickle.loads(pickle.dumps(counts.snapshot()))
    counts.fetched("acme/a", 0.3, 1000)
    counts.failed("acme/a", SourceUnavailableError("later"))
    figures = ReplicaFigures()
    figures.take("r1", snapshot)
    scraped = exposition(AdapterCollector(figures.labelled))
    families = text_string_to_metric_families(scraped)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    a, other = (("adapter", "acme/a"), ("replica", "r1")), (("adapter", OTHER), ("replica", "r1"))
    # (acme/a's first miss, before its delivery, is OTHER's: a name takes a label once it exists)
    assert samples[("clef_adapter_disk_lookups_total", a)] == 1 and samples[("clef_adapter_disk_hits_total", a)] == 1
    assert samples[("clef_adapter_fetched_bytes_total", a)] == 1000 and samples[("clef_adapter_fetch_seconds_count", a)] == 1
    assert samples[("clef_adapter_fetch_seconds_bucket", (*a[:1], ("le", "0.25"), *a[1:]))] == 0
    assert samples[("clef_adapter_fetch_seconds_bucket", (*a[:1], ("le", "0.5"), *a[1:]))] == 1
    assert samples[("clef_adapter_conversion_seconds_sum", a)] == 2.0
    failures = {k[1]: v for k, v in samples.items() if k[0] == "clef_adapter_fetch_failures_total"}
    by_reason = {(*other[:1], ("reason", reason), *other[1:]): 1 for reason in ("adapter_too_large", "source_unavailable")}
    assert failures == by_reason  # (the later failure of acme/a is not in the snapshot sent before it)
    assert (samples[("clef_adapter_disk_lookups_total", other)], samples[("clef_adapter_loads_total", other)]) == (2, 0)


def test_without_a_source_event_the_source_series_are_not_shown():
    counts = AdapterCounts(4)
    counts.used("one", False)
    counts.loaded("one", 0.01, 10)
    scraped = exposition(AdapterCollector(lambda: [({}, counts.snapshot())]))
    assert "clef_adapter_loads_total" in scraped and "disk" not in scraped and "fetch" not in scraped


def exposition(collector: AdapterCollector) -> str:
    """One collector's series as /metrics writes them."""
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_names_never_served_take_no_label():
    """A stream of names that do not exist (each a disk miss, then a failure) cannot take the labels: they count under
    OTHER, as a first use's misses before its delivery do, and an adapter delivered after them still gets its own;
    every event is counted once."""
    counts = AdapterCounts(2)
    for i in range(10):
        counts.looked_up(f"acme/junk{i}", False)
        counts.failed(f"acme/junk{i}", SourceUnavailableError("no such repository"))
    for _ in range(3):  # three requests waiting for one first use
        counts.looked_up("acme/real", False)
    counts.fetched("acme/real", 0.5, 100)
    counts.looked_up("acme/real", True)
    counts.looked_up("acme/real", False)  # (its file gone from the cache since: a miss, its own now)
    counts.failed("acme/real", SourceUnavailableError("a refresh that failed"))  # (delivered before: its own label)
    figures = counts.snapshot().figures
    assert sorted(figures) == [OTHER, "acme/real"]
    real, other = figures["acme/real"], figures[OTHER]
    assert (real.disk_lookups, real.disk_hits, real.fetched_bytes, real.failures) == (2, 1, 100, {"source_unavailable": 1})
    assert (other.disk_lookups, other.disk_hits, other.failures) == (13, 0, {"source_unavailable": 10})

"""A name that names no commit follows its branch (AdapterSet.adapter_refresh, runtime/sources.py's refresh): against
the Hub stand-in (clef_gguf/testing/hub.py, a push: a repository's files changed) and the real huggingface-hub
client, an entry older than the refresh period is looked up once at the Hub on its next use, a new commit fetched
while the version held answers, and nothing asked before the period, nor ever for a pinned commit; a Hub that is down
or slow at refresh time never fails, nor holds, a request."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import clef_gguf
from clef_gguf.cli.options import ServedFlags
from clef_gguf.data import DEMO_MODEL
from clef_gguf.runtime import sources as sources_module
from clef_gguf.runtime.adapter_cache import AdapterCache
from clef_gguf.runtime.catalog_sources import parse_source
from clef_gguf.runtime.relay_source import relayed
from clef_gguf.runtime.sources import AdapterSources, Bounds
from clef_gguf.testing.hub import Hub

OLD, NEW = b"GGUF" + b"\1" * 5000, b"GGUF" + b"\2" * 6000
REFRESH_S = 1.0
KEY = "hf://acme/tune@main/"


@pytest.fixture()
def hub(tmp_path, monkeypatch) -> Hub:
    stand_in = Hub(tmp_path / "hub")
    monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    (stand_in.repo("acme", "tune") / "tune.adapter.gguf").write_bytes(OLD)
    yield stand_in
    stand_in.gate.set()
    stand_in.close()


def _check(path: Path, name: str) -> None:
    """The base's check stands aside here: these tests are about which commit is held, not what it holds."""


def _sources(tmp_path: Path, refresh_s: float = REFRESH_S, **caps: int) -> AdapterSources:
    cache = AdapterCache(tmp_path / "cache", 1 << 30)
    return AdapterSources([parse_source("hf://acme")], cache, Bounds(1 << 20, 10.0, refresh_s=refresh_s, **caps), _check)


def _push(hub: Hub, data: bytes) -> None:
    (hub.repo("acme", "tune") / "tune.adapter.gguf").write_bytes(data)  # (the stand-in's sha follows the bytes)


def _until(done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _aged(sources: AdapterSources, key: str = KEY) -> None:
    """Wait until the entry of `key` is past the refresh period."""
    entry = sources.cache.get(key)
    assert entry is not None
    _until(lambda: time.time() - entry.checked >= sources.bounds.refresh_s, "the entry ages")


@pytest.mark.slow  # (the refresh period and a back-off pass)
def test_a_push_to_the_branch_is_served_after_the_refresh_period_not_before(hub, tmp_path):
    sources = _sources(tmp_path)
    path = sources.locate("acme/tune")
    assert path is not None and path.read_bytes() == OLD and hub.lookups["acme/tune"] == 0
    _push(hub, NEW)
    assert sources.locate("acme/tune").read_bytes() == OLD  # within the period: the version held, the Hub not asked
    assert hub.lookups["acme/tune"] == 0 and hub.downloads_of("acme", "tune") == 1
    _aged(sources)
    asked = len(hub.tokens)
    hub.gate.clear()  # the Hub holds its answers: eight uses at once, one lookup, none of them waiting for it
    seen: list[bytes] = []
    uses = [threading.Thread(target=lambda: seen.append(sources.locate("acme/tune").read_bytes())) for _ in range(8)]
    started = time.monotonic()
    for t in uses:
        t.start()
    for t in uses:
        t.join(30)
    assert seen == [OLD] * 8 and time.monotonic() - started < 5.0  # the version held answered each at once
    _until(lambda: len(hub.tokens) > asked, "the lookup reaches the Hub")
    hub.gate.set()
    _until(lambda: sources.locate("acme/tune").read_bytes() == NEW, "the new commit is served")
    assert hub.lookups["acme/tune"] == 1 and hub.downloads_of("acme", "tune") == 2
    entry = sources.cache.get(KEY)
    assert entry is not None and entry.revision == hub.sha("acme", "tune")
    assert sources.locate("acme/tune") == path and hub.lookups["acme/tune"] == 1  # (fresh again: not asked)
    _aged(sources)
    delivered = entry.checked
    sources.locate("acme/tune")  # the branch has not moved: one lookup, no download, the entry confirmed
    _until(lambda: sources.cache.get(KEY).checked > delivered, "the entry is confirmed")
    assert hub.lookups["acme/tune"] == 2 and hub.downloads_of("acme", "tune") == 2
    sources.close()


def test_a_pinned_commit_is_never_looked_up_again(hub, tmp_path):
    sources = _sources(tmp_path, refresh_s=0.2)
    pinned = f"acme/tune@{hub.sha('acme', 'tune')}"
    assert sources.locate(pinned).read_bytes() == OLD
    _push(hub, NEW)
    _aged(sources, f"hf://{pinned}/")
    for _ in range(3):
        assert sources.locate(pinned).read_bytes() == OLD
    time.sleep(0.3)  # (a look started would have reached the Hub: there is none to wait for)
    assert hub.lookups["acme/tune"] == 0 and hub.downloads_of("acme", "tune") == 1 and not sources._flights
    sources.close()


@pytest.mark.slow  # (the refresh period and a back-off pass)
def test_a_hub_down_at_refresh_time_keeps_the_version_held_answering(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(sources_module, "BACKOFF_S", 2.0)
    sources = _sources(tmp_path)
    assert sources.locate("acme/tune").read_bytes() == OLD
    _push(hub, NEW)
    down = Hub(tmp_path / "down")
    down.close()
    monkeypatch.setenv("HF_ENDPOINT", down.url)
    _aged(sources)
    assert sources.locate("acme/tune").read_bytes() == OLD  # the look fails on its thread, never the request
    _until(lambda: KEY in sources._failed, "the failed look is backed off")
    assert sources.locate("acme/tune").read_bytes() == OLD and not sources._flights  # (in its back-off: no look)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)  # the Hub back: asked again once the back-off is over
    _until(lambda: sources.locate("acme/tune").read_bytes() == NEW, "the new commit is served")
    assert hub.lookups["acme/tune"] == 1 and hub.downloads_of("acme", "tune") == 2 and KEY not in sources._failed
    sources.close()


def test_an_entry_s_age_is_kept_across_a_restart(hub, tmp_path):
    sources = _sources(tmp_path)
    assert sources.locate("acme/tune").read_bytes() == OLD
    sources.close()
    _push(hub, NEW)
    restarted = _sources(tmp_path, refresh_s=3600.0)  # a restart within the period: the entry held, nothing asked
    assert restarted.locate("acme/tune").read_bytes() == OLD and hub.lookups["acme/tune"] == 0
    restarted.close()
    restarted = _sources(tmp_path)
    _aged(restarted)
    restarted.locate("acme/tune")  # a restart past it (the fetch-once-forever of before): the branch followed
    _until(lambda: restarted.locate("acme/tune").read_bytes() == NEW, "the new commit is served after a restart")
    assert hub.lookups["acme/tune"] == 1
    restarted.close()
    never = _sources(tmp_path, refresh_s=0)  # 0: never looked up
    _push(hub, OLD)
    time.sleep(0.05)
    assert never.locate("acme/tune").read_bytes() == NEW and hub.lookups["acme/tune"] == 1 and not never._flights
    never.close()


def test_a_new_commit_another_process_kept_in_the_shared_cache_is_taken_up_not_fetched_again(hub, tmp_path):
    one, other = _sources(tmp_path), _sources(tmp_path)  # (a Ray node's replicas: one cache folder)
    assert one.locate("acme/tune").read_bytes() == OLD and other.locate("acme/tune").read_bytes() == OLD
    _push(hub, NEW)
    _aged(one)
    one.locate("acme/tune")
    _until(lambda: one.locate("acme/tune").read_bytes() == NEW, "the new commit is served")
    assert other.locate("acme/tune").read_bytes() == NEW and not other._flights  # its record read, not a tampering
    assert hub.downloads_of("acme", "tune") == 2 and hub.lookups["acme/tune"] == 1
    one.close()
    other.close()


def test_looks_count_against_the_new_fetches_a_minute(hub, tmp_path):
    sources = _sources(tmp_path, new_per_minute=1)
    assert sources.locate("acme/tune").read_bytes() == OLD  # (the minute's one fetch)
    _push(hub, NEW)
    _aged(sources)
    for _ in range(3):  # past the rate: no look now, and no refusal either: the version held answers
        assert sources.locate("acme/tune").read_bytes() == OLD
    assert hub.lookups["acme/tune"] == 0 and not sources._flights
    sources.close()


def test_the_caps_and_the_refresh_period_are_settings_of_load_and_serve(tmp_path):
    caps = {"adapter_fetches": 2, "adapter_fetch_rate": 7, "adapter_refresh": 5.0}
    with clef_gguf.load(DEMO_MODEL, adapter_sources=[str(tmp_path)], **caps) as model:
        bounds = model.catalog.sources.bounds
    assert (bounds.max_fetches, bounds.new_per_minute, bounds.refresh_s) == (2, 7, 5.0)
    served = ServedFlags(adapter_sources=[str(tmp_path)], **caps).spec(DEMO_MODEL).adapter_set  # (serve's flags)
    assert (served.adapter_fetches, served.adapter_fetch_rate, served.adapter_refresh) == (2, 7, 5.0)


def test_a_relayed_process_takes_the_other_process_s_new_version_when_asked_to_fetch_again(tmp_path):
    held = {"acme/tune": (OLD, "1" * 40)}  # what the other process (a Ray ingress) holds for each name
    cache, bounds = AdapterCache(tmp_path / "cache", 1 << 30), Bounds(1 << 20, 10.0, refresh_s=0.01)
    sources = AdapterSources(relayed([parse_source("hf://acme")], held.__getitem__), cache, bounds, _check)
    assert sources.locate("acme/tune").read_bytes() == OLD
    held["acme/tune"] = (NEW, "2" * 40)  # the other process followed the branch
    time.sleep(0.05)
    assert sources.locate("acme/tune").read_bytes() == OLD and not sources._flights  # (a relay has no revision to ask)
    assert sources.fetch_again("acme/tune").read_bytes() == NEW
    assert sources.cache.get(KEY).revision == "2" * 40 and sources.fetch_again("nobody/else") is None
    sources.close()

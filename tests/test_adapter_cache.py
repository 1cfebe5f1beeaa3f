"""The disk cache of fetched adapters (runtime/adapter_cache.py): least recently used removed past its bound, pinned
entries kept, verdicts kept across a restart, and a half-written entry (a crash) never taken for a whole one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clef_gguf.errors import AdapterBaseError, AdapterTooLargeError
from clef_gguf.runtime import adapter_cache, private_folder
from clef_gguf.runtime.adapter_cache import ADAPTER, RECORD, AdapterCache, verdict_of
from clef_gguf.runtime.catalog_sources import kept_names
from clef_gguf.runtime.hub_source import HubSource
from clef_gguf.runtime.sources import AdapterSources, Bounds


def _put(cache: AdapterCache, key: str, size: int) -> Path:
    with cache.staging() as stage:
        (stage / "f").write_bytes(b"x" * size)
        cached = cache.put(key, "rev-" + key, file=stage / "f")
    assert cached.path is not None
    return cached.path


def test_least_recently_used_goes_first_and_pinned_never(tmp_path):
    cache = AdapterCache(tmp_path, limit=300, pinned=lambda key: key == "pinned")
    _put(cache, "pinned", 100)
    _put(cache, "old", 100)
    _put(cache, "used", 100)
    assert cache.get("old") is not None and cache.get("used") is not None  # "used" is now the most recently used
    assert cache.get("pinned") is not None
    cache.get("used")
    _put(cache, "new", 100)  # 400 > 300: the least recently used unpinned one goes
    assert cache.keys() == ["new", "pinned", "used"]
    _put(cache, "newer", 250)  # 550: "used" then "new" go, "pinned" stays though it was used before them
    assert cache.keys() == ["newer", "pinned"]
    restarted = AdapterCache(tmp_path, limit=300)
    assert restarted.keys() == ["newer", "pinned"]
    found = restarted.get("newer")
    assert found is not None and found.path is not None and found.path.read_bytes() == b"x" * 250


def test_verdicts_are_kept_and_half_written_entries_are_not(tmp_path):
    cache = AdapterCache(tmp_path, limit=1000)
    error = AdapterBaseError("acme/tune@abc: trained over another base")
    cache.put("refused", "abc", verdict=verdict_of(error))
    cache.put("large", "abc", verdict=verdict_of(AdapterTooLargeError("acme/big is 9 bytes", "model")))
    path = _put(cache, "whole", 10)
    (path.parent / ADAPTER).write_bytes(b"x" * 3)  # a file cut short behind the record's back
    live = cache._staging  # (this process's staging folder: another process sharing the cache may be writing there)
    pid, _, boot, namespace = live.name.removeprefix(private_folder.PREFIX).split("-")
    crashed = live.with_name(f"{private_folder.PREFIX}{pid}-1-{boot}-{namespace}")
    (crashed / "half-written").mkdir(parents=True)  # a dead process's leftover (this PID, another start time)
    opened = f"from clef_gguf.runtime.adapter_cache import AdapterCache; AdapterCache({str(tmp_path)!r}, 1000)"
    subprocess.run([sys.executable, "-c", opened], check=True)  # (another process opens it: it sweeps the dead's)
    restarted = AdapterCache(tmp_path, limit=1000)
    assert restarted.keys() == ["large", "refused"] and not crashed.exists() and live.is_dir()
    refused = restarted.get("refused")
    assert refused is not None and refused.path is None
    with pytest.raises(AdapterBaseError, match="another base"):
        raise refused.error()
    large = restarted.get("large")
    assert large is not None
    with pytest.raises(AdapterTooLargeError) as caught:
        raise large.error()
    assert caught.value.field == "model" and str(caught.value) == "model: acme/big is 9 bytes"
    (next((tmp_path / "entries").iterdir()) / RECORD).write_text("{")  # a record that does not parse: dropped
    assert len(AdapterCache(tmp_path, limit=1000).keys()) == 1


def test_without_a_folder_the_cache_is_private_and_removed_at_close():
    """Removed at close; and in this process's private folder (runtime/private_folder.py), which the next process
    removes if this one is killed before it closes."""
    cache = AdapterCache(None, limit=1000)
    root = cache.root
    _put(cache, "k", 5)
    assert any(parent.name.startswith(f"{private_folder.PREFIX}{os.getpid()}-") for parent in root.parents)
    cache.close()
    assert not root.exists()


def test_an_entry_another_process_wrote_is_found(tmp_path):
    mine, theirs = AdapterCache(tmp_path, limit=1000), AdapterCache(tmp_path, limit=1000)
    _put(theirs, "shared", 7)
    found = mine.get("shared")
    assert found is not None and found.path is not None and found.path.read_bytes() == b"x" * 7
    assert mine.get("absent") is None


def test_the_names_the_cache_holds_are_named_back_from_their_keys_newest_first_and_bounded(tmp_path, monkeypatch):
    """What /v1/models lists of the cache (catalog_sources.kept_names): each entry's key named back as a request names
    it (branch main's bare), the most recently used first, its kept refusal's message; another source's keys not;
    at most `kept` names with those delivered in this process; read from the index, no file hashed."""
    hub = HubSource("acme", None)
    names = ["acme/a", "acme/b@v2/sub/dir", "acme/c@" + "0" * 40, "acme/d/sub"]
    cache = AdapterCache(tmp_path, limit=1 << 20)
    for name in names:
        wanted = hub.claims(name)
        assert wanted is not None
        if name.startswith("acme/c"):
            cache.put(wanted.key, "0" * 40, verdict=verdict_of(AdapterTooLargeError(f"{name} is 9 bytes", "model")))
        else:
            _put(cache, wanted.key, 10)
    other = HubSource("other", None).claims("other/x")
    assert other is not None
    _put(cache, other.key, 10)  # (kept by a server that fetched from hf://other: not a name this one serves)
    monkeypatch.setattr(adapter_cache, "_sha256", lambda path: pytest.fail(f"{path} hashed"))
    restarted = AdapterCache(tmp_path, limit=1 << 20)
    for name in reversed(names):  # "acme/a" used last: listed first
        wanted = hub.claims(name)
        assert wanted is not None
        entry = next(e for e in restarted.entries() if e.key == wanted.key)
        entry.used = len(restarted.entries()) - names.index(name)
    sources = AdapterSources([hub], restarted, Bounds(1 << 20, 5.0), lambda path, name: None)
    assert kept_names(sources, set()) == [
        (n, "acme/c@" + "0" * 40 + " is 9 bytes" if n.startswith("acme/c") else None) for n in names
    ]
    assert [n for n, _ in kept_names(sources, {"acme/a"}, kept=2)] == ["acme/b@v2/sub/dir", "acme/c@" + "0" * 40]
    assert [n for n, _ in kept_names(AdapterSources([HubSource("acme", "d")], restarted, Bounds(1, 1.0), print), set())] == [
        "acme/d/sub"
    ]


@pytest.mark.parametrize("platform", ["linux", "win32", "darwin"])
def test_a_new_version_replaces_an_entry_on_every_system(tmp_path, monkeypatch, platform):
    """Linux swaps an entry in one step (renameat2); Windows and macOS, which cannot, rename it in two: each leaves
    the new version, readable, and no staging folder behind."""
    monkeypatch.setattr(adapter_cache.sys, "platform", platform)
    cache = AdapterCache(tmp_path, limit=1 << 20)
    _put(cache, "k", 10)
    path = _put(cache, "k", 20)
    assert path.read_bytes() == b"x" * 20 and cache.get("k") is not None and cache.get("k").nbytes == 20
    assert AdapterCache(tmp_path, limit=1 << 20).get("k").nbytes == 20  # (as a restart reads it)
    assert not any(p.is_file() for p in (tmp_path / "staging").rglob("*"))


def test_a_refusal_holds_over_the_base_it_was_reached_over(tmp_path):
    """A server of another base sharing the folder is not refused by a verdict reached over this one (it fetches and
    checks the name again, over its own base), nor does it list it; a file entry is shared (checked at each load)."""
    cache = AdapterCache(tmp_path, limit=1000, base="base-a")
    cache.put("refused", "abc", verdict=verdict_of(AdapterBaseError("acme/tune@abc: trained over another base")))
    _put(cache, "file", 10)
    other = AdapterCache(tmp_path, limit=1000, base="base-b")
    assert other.get("refused") is None and other.get("file") is not None
    assert [e.key for e in other.entries()] == ["file"]
    again = AdapterCache(tmp_path, limit=1000, base="base-a")  # (a restart over the first base)
    refused = again.get("refused")
    assert refused is not None and refused.verdict is not None and sorted(e.key for e in again.entries()) == ["file", "refused"]

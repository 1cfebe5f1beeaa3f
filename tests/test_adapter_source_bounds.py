"""What adapter sources (runtime/sources.py, hub_source.py, adapter_cache.py) hold back against a hostile stream of
names or a hostile Hub (the stand-in, clef_gguf/testing/hub.py, with the real huggingface-hub client): the back-off
table and the new fetches a minute bounded, a listing that lies about sizes cut off at the bound, no second copy in
huggingface-hub's cache, a dripping download abandoned at its deadline, and a tampered cache entry fetched again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from clef_gguf.errors import AdapterNotAllowedError, AdapterTooLargeError, RequestError, SourceUnavailableError
from clef_gguf.runtime import sources as sources_module
from clef_gguf.runtime.adapter_cache import AdapterCache
from clef_gguf.runtime.catalog_sources import parse_source
from clef_gguf.runtime.relay_source import relayed
from clef_gguf.runtime.sources import AdapterSources, Bounds, FetchPending, not_waiting
from clef_gguf.testing.hub import Hub


@pytest.fixture()
def hub(tmp_path, monkeypatch) -> Hub:
    stand_in = Hub(tmp_path / "hub")
    monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_never_shown")
    yield stand_in
    stand_in.close()


def _check(path: Path, name: str) -> None:
    """The base's check stands aside here: these tests are about the bytes' way, not what they hold."""


def _sources(tmp_path: Path, bounds: Bounds) -> AdapterSources:
    return AdapterSources([parse_source("hf://acme")], AdapterCache(tmp_path / "cache", 1 << 30), bounds, _check)


def test_junk_names_are_bounded_in_hub_requests_and_in_the_back_off_table(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(sources_module, "FAILED_KEPT", 3)
    sources = _sources(tmp_path, Bounds(1 << 20, 10.0, new_per_minute=5))
    for i in range(5):  # each a repository the Hub does not have: asked once, remembered with its back-off
        with pytest.raises(RequestError, match="no such repository"):
            sources.locate(f"acme/junk-{i}")
    asked = len(hub.tokens)
    assert asked == 5
    for i in range(5, 40):  # past the five a minute: refused without a word to the Hub
        with pytest.raises(SourceUnavailableError, match="too many new adapter names"):
            sources.locate(f"acme/junk-{i}")
    assert len(hub.tokens) == asked
    assert list(sources._failed) == [f"hf://acme/junk-{i}@main/" for i in (2, 3, 4)]  # the newest kept
    assert all(error.__traceback__ is None for _, _, error in sources._failed.values())
    with pytest.raises(RequestError, match="no such repository"):  # still in its back-off: the same answer, no request
        sources.locate("acme/junk-4")
    assert len(hub.tokens) == asked
    sources.close()


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if not p.is_dir()]


def _hf_cache_files(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "hf-home").rglob("*") if p.is_file() and p.name != "token"]


def test_a_listing_that_lies_is_cut_off_at_the_bound_and_nothing_lands_in_the_hf_cache(hub, tmp_path):
    (hub.repo("acme", "liar") / "liar.adapter.gguf").write_bytes(b"\0" * (4 << 20))
    hub.listed["acme/liar/liar.adapter.gguf"] = 100  # the listing says 100 bytes; 4 MiB come
    hub.drip_s = 0.002  # (4096 pieces: a download read whole takes 8 s and more)
    sources = _sources(tmp_path, Bounds(64 << 10, 10.0))
    staged = tmp_path / "cache" / "staging"
    started = time.monotonic()
    with pytest.raises(AdapterTooLargeError, match="over this server's --adapter-max-size of 65536 bytes"):
        sources.locate("acme/liar")
    assert time.monotonic() - started < 4  # cut off, not read whole
    assert not _hf_cache_files(tmp_path) and not _files(staged)  # no copy anywhere, nothing left half-written
    sources.close()


def test_an_adapter_is_kept_once_in_the_clef_cache_and_not_in_the_hf_cache(hub, tmp_path):
    (hub.repo("acme", "tune") / "tune.adapter.gguf").write_bytes(b"GGUF" + b"\1" * 5000)
    sources = _sources(tmp_path, Bounds(1 << 20, 10.0))
    path = sources.locate("acme/tune")
    assert path is not None and path.read_bytes() == b"GGUF" + b"\1" * 5000
    assert not _hf_cache_files(tmp_path)
    assert all(token == "Bearer hf_secret_token_never_shown" for token in hub.tokens)  # HF_TOKEN sent with each
    sources.close()


def test_a_dripping_download_is_abandoned_at_its_deadline_and_backed_off(hub, tmp_path):
    (hub.repo("acme", "drip") / "drip.adapter.gguf").write_bytes(b"\0" * (1 << 20))
    hub.drip_s = 0.05  # 1 KiB each 50 ms: each read in time, the whole 50 s
    sources = _sources(tmp_path, Bounds(4 << 20, 0.5, deadline_factor=2.0))
    started = time.monotonic()
    with pytest.raises(SourceUnavailableError, match="still being fetched after 0.5 s"):  # the first use's bound
        sources.locate("acme/drip")
    while sources._flights and time.monotonic() - started < 20:  # (the fetch goes on, until its deadline)
        time.sleep(0.05)
    assert time.monotonic() - started < 10 and not sources._flights
    assert not _files(tmp_path / "cache" / "staging")
    with pytest.raises(SourceUnavailableError, match="not delivered within 1 s; abandoned"):  # its back-off
        sources.locate("acme/drip")
    assert hub.downloads_of("acme", "drip") == 1
    sources.close()


def test_fetches_at_once_are_capped(hub, tmp_path):
    for i in range(3):
        (hub.repo("acme", f"slow-{i}") / "a.adapter.gguf").write_bytes(b"\0" * 8192)
    hub.drip_s = 0.2
    sources = _sources(tmp_path, Bounds(1 << 20, 30.0, max_fetches=2))
    with not_waiting():
        for i in range(2):
            with pytest.raises(FetchPending):
                sources.locate(f"acme/slow-{i}")
        with pytest.raises(SourceUnavailableError, match="2 adapters are being fetched"):
            sources.locate("acme/slow-2")
    sources.close()


def test_a_swapped_cache_file_is_fetched_again_live_and_after_a_restart(hub, tmp_path):
    good = b"GGUF" + b"\1" * 5000
    (hub.repo("acme", "tune") / "tune.adapter.gguf").write_bytes(good)
    sources = _sources(tmp_path, Bounds(1 << 20, 10.0))
    path = sources.locate("acme/tune")
    assert path is not None and path.read_bytes() == good
    path.write_bytes(b"GGUF" + b"\2" * 5000)  # the same size, another adapter's bytes
    again = sources.locate("acme/tune")
    assert again is not None and again.read_bytes() == good and hub.downloads_of("acme", "tune") == 2
    sources.close()
    again.write_bytes(b"GGUF" + b"\3" * 5000)
    restarted = _sources(tmp_path, Bounds(1 << 20, 10.0))
    third = restarted.locate("acme/tune")
    assert third is not None and third.read_bytes() == good and hub.downloads_of("acme", "tune") == 3
    assert restarted.locate("acme/tune") == third and hub.downloads_of("acme", "tune") == 3  # intact: no fetch
    restarted.close()


@pytest.mark.parametrize("name", ["acme/good.", "acme/good@.", "acme/good/", "acme//good", "acme/a--b", "acme/-a"])
def test_a_malformed_hub_name_is_the_request_s_fault_and_asks_nothing(hub, tmp_path, name):
    sources = _sources(tmp_path, Bounds(1 << 20, 10.0))
    with pytest.raises(RequestError, match="not an adapter name a source reads") as caught:
        sources.locate(name)
    assert type(caught.value) is RequestError and caught.value.field == "model"  # a 422 at model, not a 403
    assert not hub.tokens and not sources._failed
    sources.close()


def test_a_cache_that_cannot_be_written_is_said_to_be_the_cache(hub, tmp_path, caplog):
    (hub.repo("acme", "tune") / "tune.adapter.gguf").write_bytes(b"GGUF" + b"\1" * 100)
    sources = _sources(tmp_path, Bounds(1 << 20, 10.0))
    staging = sources.cache._staging  # (this process's)
    staging.rmdir()
    staging.write_text("")  # (no folder can be made there: as a read-only or full disk refuses, even to root)
    with pytest.raises(SourceUnavailableError, match="the adapter cache cannot keep 'acme/tune' now") as caught:
        sources.locate("acme/tune")
    assert "Hugging Face" not in str(caught.value)
    assert any("the adapter cache" in r.getMessage() and str(tmp_path / "cache") in r.getMessage() for r in caplog.records)
    sources.close()


def test_a_relay_hands_on_only_what_the_other_process_fetched_and_is_bounded_here(hub, tmp_path):
    """runtime/relay_source.py as `serve --ray` wires it (server/ray_relay.py): a replica's sources take the ingress's
    delivery, never the Hub's; two replicas, one download; a name only a folder claims at the ingress is refused; a
    relay is held neither to --adapter-max-size (the ingress held the download to it, and a checkpoint's conversion
    may be larger) nor to --adapter-fetch-rate (it asks no one outside)."""
    (hub.repo("acme", "tune") / "tune.adapter.gguf").write_bytes(b"GGUF" + bytes(60))
    (hub.repo("acme", "tune2") / "tune.adapter.gguf").write_bytes(b"GGUF" + bytes(60))
    (tmp_path / "tunes").mkdir()
    (tmp_path / "tunes" / "local.adapter.gguf").write_bytes(b"GGUF" + bytes(60))
    ingress = AdapterSources(
        [parse_source("hf://acme"), parse_source(str(tmp_path / "tunes"))],
        AdapterCache(tmp_path / "ingress", 1 << 30),
        Bounds(1 << 20, 10.0),
        _check,
    )

    def relay(name: str) -> tuple[bytes, str]:
        path, revision = ingress.delivered(name)
        return path.read_bytes(), revision

    def replica(folder: str) -> AdapterSources:
        sources = relayed([parse_source("hf://acme")], relay)
        bounds = Bounds(10, 10.0, new_per_minute=1)  # (smaller than the file; one fetch a minute)
        return AdapterSources(sources, AdapterCache(tmp_path / folder, 1 << 30), bounds, _check)

    one = replica("one")
    for name in ("acme/tune", "acme/tune2"):  # (two relays: past the rate)
        assert one.locate(name).read_bytes() == b"GGUF" + bytes(60)
    assert replica("two").locate("acme/tune").read_bytes() == b"GGUF" + bytes(60)
    assert hub.downloads_of("acme", "tune") == 1
    with pytest.raises(AdapterNotAllowedError, match="not from a source this server fetches"):
        ingress.delivered("local")


def test_serve_on_rays_preflight_fetches_no_pin_a_source_delivers(hub, tmp_path):
    """`serve --ray` checks its files before Ray starts (runtime/encoder.check_spec); a pin from the Hub is fetched by
    the ingress at its start, once for the cluster, not by that check too. A pin of a folder is still checked there."""
    from clef_gguf.data import DEMO_MODEL
    from clef_gguf.errors import ClefError
    from clef_gguf.runtime.encoder import check_spec
    from clef_gguf.settings import ModelSpec

    (hub.repo("acme", "tune") / "tune.adapter.gguf").write_bytes(b"GGUF" + bytes(60))
    (tmp_path / "tunes").mkdir()
    (tmp_path / "tunes" / "junk.adapter.gguf").write_bytes(b"not a gguf")
    sources = ["hf://acme", str(tmp_path / "tunes")]
    check_spec(ModelSpec.of(DEMO_MODEL, adapter_sources=sources, pins=["acme/tune"], adapter_cache=tmp_path / "c"))
    assert not hub.tokens and hub.downloads_of("acme", "tune") == 0
    with pytest.raises(ClefError, match="junk"):
        check_spec(ModelSpec.of(DEMO_MODEL, adapter_sources=sources, pins=["junk"], adapter_cache=tmp_path / "c"))

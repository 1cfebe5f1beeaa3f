"""Adapter sources (runtime/sources.py, hub_source.py, adapter_cache.py) against a local stand-in of the Hugging Face
Hub (clef_gguf/testing/hub.py), the real huggingface-hub client pointed at it with HF_ENDPOINT: an adapter file and a
clef-finetune checkpoint (converted as `convert --to-adapter` converts it) fetched once however many ask, kept in a
disk cache that a restart reuses, and each refusal its own typed error: a name outside the allow list, a release, an
oversized repository, another base's checkpoint, a Hub that is down or slow (and its back-off)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from clef_gguf.conversion.adapter import convert_adapter
from clef_gguf.errors import (
    AdapterBaseError,
    AdapterNotAllowedError,
    AdapterTooLargeError,
    NotADecisionModelError,
    RequestError,
    SourceUnavailableError,
)
from clef_gguf.format.header import GGUFFile
from clef_gguf.runtime.adapter_cache import AdapterCache
from clef_gguf.runtime.adapter_files import PrivateFolder, read_version
from clef_gguf.runtime.catalog_sources import parse_source
from clef_gguf.runtime.sources import AdapterSources, Bounds, FetchPending, not_waiting
from clef_gguf.testing import finetune
from clef_gguf.testing.hub import Hub
from clef_gguf.testing.release_builder import ReleaseSpec, build_release

pytestmark = pytest.mark.slow  # PEFT checkpoints and conversions in the module's fixture

LORA = {"r": 4, "lora_alpha": 8, "target_modules": r".*language_model.*\.(q_proj|in_proj_qkv|out_proj|down_proj)"}
MIB = 1 << 20


class Files:
    def __init__(self, ws, root: Path) -> None:
        self.release = ws.release("untied_f32")
        self.base = ws.gguf("untied_f32", "f32")
        self.checkpoint = finetune.peft_checkpoint(self.release, root / "tune", LORA, {"prior_logit_scale": 0.5})
        self.adapter = convert_adapter(self.checkpoint, self.release, root / "tune.adapter.gguf", "f32")
        narrow = build_release(root / "narrow-release", ReleaseSpec(head_width=16, head_feedforward=32, vision=False))
        self.narrow = finetune.peft_checkpoint(narrow, root / "narrow", LORA)
        other = build_release(root / "other-release", ReleaseSpec(seed=7, vision=False))
        other_checkpoint = finetune.peft_checkpoint(other, root / "other", LORA)
        self.other_adapter = convert_adapter(other_checkpoint, other, root / "other.adapter.gguf", "f32")


@pytest.fixture(scope="module")
def files(ws, tmp_path_factory) -> Files:
    return Files(ws, tmp_path_factory.mktemp("sources"))


@pytest.fixture()
def hub(files, tmp_path, monkeypatch) -> Hub:
    stand_in = Hub(tmp_path / "hub")
    shutil.copyfile(files.adapter, stand_in.repo("acme", "tune-gguf") / "tune.adapter.gguf")
    shutil.copytree(files.checkpoint, stand_in.repo("acme", "tune"), dirs_exist_ok=True)
    shutil.copytree(files.release, stand_in.repo("acme", "merged"), dirs_exist_ok=True)
    shutil.copytree(files.narrow, stand_in.repo("acme", "narrow"), dirs_exist_ok=True)
    shutil.copyfile(files.other_adapter, stand_in.repo("acme", "other") / "other.adapter.gguf")
    shutil.copyfile(files.adapter, stand_in.repo("evil", "tune-gguf") / "tune.adapter.gguf")
    monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_never_shown")
    yield stand_in
    stand_in.close()


def _sources(files: Files, cache_dir: Path, *names: str, max_bytes: int = 64 * MIB, timeout_s: float = 30.0) -> AdapterSources:
    base = GGUFFile.open(files.base)
    private = PrivateFolder()

    def check(path: Path, name: str) -> None:
        read_version(base, base.identity(), path, private, label=name).copy.close()

    def convert(checkpoint: Path, out: Path) -> None:
        convert_adapter(checkpoint, files.release, out, "f32")

    return AdapterSources(
        [parse_source(n) for n in names], AdapterCache(cache_dir, 256 * MIB), Bounds(max_bytes, timeout_s), check, convert
    )


class Recorded:
    """A SourceObserver that keeps what it is told (what the server's metrics hang on)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def looked_up(self, name: str, hit: bool) -> None:
        self.events.append(("looked_up", name, hit))

    def fetched(self, name: str, seconds: float, nbytes: int) -> None:
        self.events.append(("fetched", name, nbytes))

    def converted(self, name: str, seconds: float) -> None:
        self.events.append(("converted", name))

    def failed(self, name: str, error: Exception) -> None:
        self.events.append(("failed", name, type(error).__name__))


def test_an_adapter_file_is_fetched_once_by_eight_and_kept_across_a_restart(files, hub, tmp_path):
    sources = _sources(files, tmp_path / "cache", "hf://acme")
    sources.observer = recorded = Recorded()
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(sources.locate("acme/tune-gguf"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 8 and len(set(got)) == 1
    assert got[0].read_bytes() == files.adapter.read_bytes()
    assert hub.downloads_of("acme", "tune-gguf") == 1
    assert all(token == "Bearer hf_secret_token_never_shown" for token in hub.tokens)  # HF_TOKEN sent, as the client sends it
    size = files.adapter.stat().st_size
    assert [e for e in recorded.events if e[0] != "looked_up"] == [("fetched", "acme/tune-gguf", size)]
    assert ("looked_up", "acme/tune-gguf", False) in recorded.events
    again = _sources(files, tmp_path / "cache", "hf://acme")  # a restart: the disk cache answers
    assert again.locate("acme/tune-gguf").read_bytes() == files.adapter.read_bytes()
    assert hub.downloads_of("acme", "tune-gguf") == 1


def test_a_checkpoint_is_converted_as_convert_to_adapter_converts_it(files, hub, tmp_path):
    sources = _sources(files, tmp_path / "cache", "hf://acme/tune", "hf://acme/merged")
    path = sources.locate("acme/tune")
    local = Path(shutil.copytree(files.checkpoint, tmp_path / "local" / "tune"))  # (its folder's name: the adapter's)
    expected = convert_adapter(local, files.release, tmp_path / "expected.adapter.gguf", "f32")
    assert path.read_bytes() == expected.read_bytes()
    assert hub.downloads_of("acme", "tune") == 3  # adapter_config.json, adapter_model.safetensors, joint_head.safetensors
    commit = hub.sha("acme", "merged")
    with pytest.raises(NotADecisionModelError, match="a release"):  # a commit's refusal: kept as its verdict
        sources.locate(f"acme/merged@{commit}")
    asked = len(hub.tokens)
    restarted = _sources(files, tmp_path / "cache", "hf://acme/tune", "hf://acme/merged")
    with pytest.raises(NotADecisionModelError, match="a release"):  # after a restart, without asking the Hub
        restarted.locate(f"acme/merged@{commit}")
    assert restarted.locate("acme/tune") == path and len(hub.tokens) == asked


def test_refusals_are_typed_one_line_and_the_allow_list_holds(files, hub, tmp_path):
    sources = _sources(files, tmp_path / "cache", "hf://acme")
    refusals = {
        "evil/tune-gguf": AdapterNotAllowedError,  # another namespace: never asked of the Hub
        "acme/merged": NotADecisionModelError,  # a release: a merged fine-tune or a full model
        "acme/narrow": AdapterBaseError,  # a checkpoint of another base's shapes: its conversion refused
        "acme/nothing": RequestError,  # no such repository
        "acme/tune-gguf@0123456789abcdef0123456789abcdef01234567": RequestError,  # no such revision
    }
    for name, kind in refusals.items():
        with pytest.raises(kind) as caught:
            sources.locate(name)
        message = str(caught.value)
        assert "\n" not in message and "hf_secret" not in message and str(tmp_path) not in message, message
    assert "a release" in str(pytest.raises(NotADecisionModelError, sources.locate, "acme/merged").value)
    with pytest.raises(AdapterBaseError, match="another base"):  # an adapter file of another base: checked as today
        sources.locate("acme/other")
    small = _sources(files, tmp_path / "small", "hf://acme", max_bytes=files.adapter.stat().st_size - 1)
    with pytest.raises(AdapterTooLargeError, match="over this server's --adapter-max-size"):  # refused from the listing
        small.locate("acme/tune-gguf")
    assert hub.downloads_of("evil", "tune-gguf") == hub.downloads_of("acme", "tune-gguf") == 0
    assert hub.downloads_of("acme", "merged") == 0 and not any("evil" in key for key in hub.downloads)


def test_a_hub_that_is_down_or_slow_is_a_503_and_is_asked_again_only_after_a_back_off(files, hub, tmp_path, monkeypatch):
    sources = _sources(files, tmp_path / "cache", "hf://acme", timeout_s=1.0)
    hub.delay_s = 6.0
    started = time.monotonic()
    # (the first-use bound, or the Hub's own request timeout, which is that bound too: whichever ends first)
    with pytest.raises(SourceUnavailableError, match="still being fetched after 1 s|cannot deliver .* timed out"):
        sources.locate("acme/tune-gguf")
    assert time.monotonic() - started < 4.0  # the first-use bound, not the Hub's pace
    with not_waiting(), pytest.raises(FetchPending) as pending:  # the server's intake awaits instead of blocking
        sources.locate("acme/merged")
    pending.value.future.exception(timeout=60)  # (the slow fetch ends: its own timeouts, the Hub's delay)
    hub.delay_s = 0.0
    down = Hub(tmp_path / "down")
    down.close()  # a port nothing answers on
    monkeypatch.setenv("HF_ENDPOINT", down.url)
    cold = _sources(files, tmp_path / "cold", "hf://acme", timeout_s=20.0)
    started = time.monotonic()
    with pytest.raises(SourceUnavailableError, match="cannot deliver acme/tune-gguf"):
        cold.locate("acme/tune-gguf")
    assert time.monotonic() - started < 15
    monkeypatch.setenv("HF_ENDPOINT", hub.url)  # the Hub is back, but the back-off holds
    with pytest.raises(SourceUnavailableError, match="cannot deliver"):
        cold.locate("acme/tune-gguf")
    assert hub.downloads_of("acme", "tune-gguf") == 0


def test_a_folder_source_is_read_in_place_before_the_hub(files, hub, tmp_path):
    folder = tmp_path / "adapters"
    folder.mkdir()
    shutil.copyfile(files.adapter, folder / "local.adapter.gguf")
    sources = _sources(files, tmp_path / "cache", str(folder), "hf://acme")
    assert sources.locate("local") == folder / "local.adapter.gguf"  # in place: no cache entry, no download
    assert sources.locate("missing") is None  # no source has it: the catalog's unknown name
    assert sources.cache.keys() == [] and not hub.downloads
    with pytest.raises(AdapterNotAllowedError):
        sources.locate("other/tune")

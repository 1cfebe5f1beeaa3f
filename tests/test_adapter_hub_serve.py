"""Adapters as a service: `serve --adapter-source hf://ORG` against a local stand-in of the Hugging Face Hub (the real
huggingface-hub client pointed at it with HF_ENDPOINT). A request naming ORG/REPO is answered as that fine-tune's
merged conversion on its first use (a clef-finetune checkpoint converted on the way, or an adapter file), with one
download however many ask at once, the base answering meanwhile, and again after a restart from the disk cache with
the Hub gone; every refusal is its own one-line status while the base keeps answering."""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from cli_helpers import run_cli  # the CLI in this process
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import start

import clef_gguf
from clef_gguf.conversion.adapter import convert_adapter
from clef_gguf.runtime import adapter_cache
from clef_gguf.runtime.model import ClefModel
from clef_gguf.server import create_app
from clef_gguf.server.adapter_metrics import OTHER, AdapterCounts, local_view
from clef_gguf.server.app import MODEL_SHA256_HEADER
from clef_gguf.settings import ModelSpec, ServeSettings
from clef_gguf.testing import finetune
from clef_gguf.testing.hub import Hub
from clef_gguf.testing.release_builder import ReleaseSpec, build_release
from clef_gguf.testing.request_suite import flat_probabilities, labelled_requests

pytestmark = pytest.mark.slow  # a PEFT checkpoint, conversions and a served model

LORA = {"r": 4, "lora_alpha": 8, "target_modules": r".*language_model.*\.(q_proj|in_proj_qkv|out_proj|down_proj)"}
CONTEXT = 4096
ROUNDED = 1e-4 + 1e-9  # answers are rounded to 4 decimals: float noise may move one by a unit
MAX_SIZE = 8 << 20


class Files:
    def __init__(self, ws, root: Path) -> None:
        self.release = ws.release("untied_f32")
        self.base = ws.gguf("untied_f32", "f32")
        checkpoint = finetune.peft_checkpoint(self.release, root / "tune", LORA, {"prior_logit_scale": 0.5})
        self.checkpoint = Path(shutil.copytree(checkpoint, root / "published" / "tune"))
        self.adapter = convert_adapter(checkpoint, self.release, root / "tune.adapter.gguf", "f32")
        self.adapter16 = convert_adapter(checkpoint, self.release, root / "tune16.adapter.gguf", "f16")  # (other bytes)
        self.merged = clef_gguf.convert(checkpoint, root / "merged-f32.gguf", "f32", base=self.release, mmproj=False)
        other = build_release(root / "other-release", ReleaseSpec(seed=7, vision=False))
        self.other = convert_adapter(finetune.peft_checkpoint(other, root / "other", LORA), other, root / "o.adapter.gguf", "f32")


@pytest.fixture(scope="module")
def files(ws, tmp_path_factory) -> Files:
    return Files(ws, tmp_path_factory.mktemp("hub-serve"))


@pytest.fixture(scope="module")
def hub(files, tmp_path_factory) -> Any:
    stand_in = Hub(tmp_path_factory.mktemp("hub"))
    shutil.copytree(files.checkpoint, stand_in.repo("acme", "tune"), dirs_exist_ok=True)
    shutil.copyfile(files.adapter, stand_in.repo("acme", "tune-gguf") / "tune.adapter.gguf")
    shutil.copyfile(files.adapter16, stand_in.repo("acme", "tune16") / "tune16.adapter.gguf")
    shutil.copytree(files.release, stand_in.repo("acme", "merged"), dirs_exist_ok=True)
    shutil.copyfile(files.other, stand_in.repo("acme", "other") / "other.adapter.gguf")
    with open(stand_in.repo("acme", "big") / "big.adapter.gguf", "wb") as f:
        f.truncate(MAX_SIZE + 1)  # (refused from the listing's size: never downloaded)
    shutil.copyfile(files.adapter, stand_in.repo("evil", "tune") / "tune.adapter.gguf")
    yield stand_in
    stand_in.close()


@pytest.fixture(scope="module")
def merged(files) -> list[list[float]]:
    with clef_gguf.load(files.merged, max_prompt_tokens=CONTEXT) as alone:
        return [flat_probabilities(alone.decide(r)) for r in labelled_requests(2)]


def _settings(files: Files, cache: Path) -> dict[str, Any]:
    return {
        "max_prompt_tokens": CONTEXT,
        "state_cache": 0,
        "adapter_sources": ["hf://acme"],
        "adapter_cache": cache,
        "adapter_base_release": files.release,
        "adapter_max_size": MAX_SIZE,
    }


def _serve(files: Files, cache: Path, **keywords: Any) -> tuple[Any, Any]:
    model = clef_gguf.load(files.base, **_settings(files, cache), **keywords)
    return model, start(create_app(model))


def _post(url: str, name: str | None, request: dict | None = None) -> httpx.Response:
    body = {**(request or labelled_requests(1)[0]), **({"model": name} if name else {})}
    return httpx.post(f"{url}/v1/systemone", json=body, timeout=120)


def _as_merged(response: httpx.Response, name: str, expected: list[float]) -> None:
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model"] == name
    assert np.abs(np.subtract(flat_probabilities(answer), expected)).max() <= ROUNDED


def test_first_uses_fetch_once_and_answer_as_the_merged_fine_tune(files, hub, merged, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    model, live = _serve(files, tmp_path / "cache")
    try:
        hub.delay_s = 1.0  # a Hub at its pace: the fetch lasts seconds (7 answers), the base must not wait on it
        answers: list[httpx.Response] = []
        first_uses = [threading.Thread(target=lambda: answers.append(_post(live.url, "acme/tune"))) for _ in range(8)]
        for t in first_uses:
            t.start()
        while not hub.tokens:  # (the fetch has begun)
            time.sleep(0.01)
        for _ in range(3):  # the base answers meanwhile, without waiting for the fetch and the conversion
            started = time.monotonic()
            base = _post(live.url, None)
            assert base.status_code == 200 and time.monotonic() - started < 3.0
        assert np.abs(np.subtract(flat_probabilities(base.json()), merged[0])).max() > 0.01  # (the fine-tune's own answers)
        assert all(t.is_alive() for t in first_uses)  # (the base answered while every first use still waited)
        for t in first_uses:
            t.join(120)
        hub.delay_s = 0.0
        assert len(answers) == 8
        for response in answers:
            _as_merged(response, "acme/tune", merged[0])
        assert hub.downloads_of("acme", "tune") == 3  # each of the checkpoint's three files once
        _as_merged(_post(live.url, "acme/tune-gguf"), "acme/tune-gguf", merged[0])  # an adapter file, as is
        _as_merged(_post(live.url, "acme/tune", labelled_requests(2)[1]), "acme/tune", merged[1])
        listed = [m["name"] for m in httpx.get(f"{live.url}/v1/models", timeout=60).json()["models"]]
        assert {"acme/tune", "acme/tune-gguf"} <= set(listed)  # (the adapters delivered, listed once they are)
    finally:
        live.stop()
        model.close()
    down = Hub(tmp_path / "down")
    down.close()
    monkeypatch.setenv("HF_ENDPOINT", down.url)  # a restart with the Hub gone: the disk cache answers
    model, live = _serve(files, tmp_path / "cache")
    try:
        _as_merged(_post(live.url, "acme/tune"), "acme/tune", merged[0])
        _as_merged(_post(live.url, "acme/tune-gguf"), "acme/tune-gguf", merged[0])
        assert hub.downloads_of("acme", "tune") == 3
    finally:
        live.stop()
        model.close()


def test_each_refusal_is_its_own_one_line_status_and_the_base_answers_throughout(files, hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_TOKEN", "hf_never_shown")
    model, live = _serve(files, tmp_path / "cache", adapter_fetch_timeout=1.0)
    try:
        cases = {
            "evil/tune": (403, "permission_error", "not from a source this server fetches adapters from (hf://acme)"),
            "acme/merged": (422, "value_error", "is a release (a merged fine-tune or a full model), not an adapter"),
            "acme/big": (422, "adapter_too_large", f"over this server's --adapter-max-size of {MAX_SIZE} bytes"),
            "acme/other": (422, "value_error", "another base"),
            "acme/nothing": (422, "value_error", "no such repository"),
        }
        for name, (status, kind, words) in cases.items():
            response = _post(live.url, name)
            assert response.status_code == status, (name, response.text)
            assert kind in response.text and words in response.text, (name, response.text)
            assert "\\n" not in response.text and "hf_never_shown" not in response.text and str(tmp_path) not in response.text
            assert _post(live.url, None).status_code == 200
        hub.delay_s = 6.0  # a Hub that answers slowly: a 503 at the first-use bound, never a hang
        started = time.monotonic()
        slow = _post(live.url, "acme/tune-gguf")
        assert slow.status_code == 503 and "source_unavailable_error" in slow.text, slow.text
        assert "still being fetched after 1 s" in slow.text or "timed out" in slow.text, slow.text  # (whichever ends first)
        assert slow.headers["Retry-After"] and time.monotonic() - started < 4.0
        assert _post(live.url, None).status_code == 200
    finally:
        hub.delay_s = 0.0
        live.stop()
        model.close()
    down = Hub(tmp_path / "down")
    down.close()
    monkeypatch.setenv("HF_ENDPOINT", down.url)  # a Hub that cannot be reached: a 503 with Retry-After
    model, live = _serve(files, tmp_path / "cold")
    try:
        response = _post(live.url, "acme/tune-gguf")
        assert response.status_code == 503 and "cannot deliver acme/tune-gguf now" in response.text, response.text
        assert response.headers["Retry-After"] == "10" and "source_unavailable_error" in response.text
        assert _post(live.url, None).status_code == 200
    finally:
        live.stop()
        model.close()


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pin_is_fetched_at_start_and_never_unloaded_to_make_room(files, hub, tmp_path, monkeypatch, pinned):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    before = hub.downloads_of("acme", "tune-gguf")
    pins = {"pins": ["acme/tune-gguf"]} if pinned else {}
    with clef_gguf.load(
        files.base,
        max_prompt_tokens=CONTEXT,
        state_cache=0,
        adapter_sources=["hf://acme"],
        adapter_cache=tmp_path / "cache",
        adapter_base_release=files.release,
        max_adapters=2,
        **pins,
    ) as model:
        assert hub.downloads_of("acme", "tune-gguf") == before + pinned  # a pin is fetched and checked at start
        for name in ("acme/tune-gguf", "acme/tune16", "acme/tune"):  # the third makes room: the oldest goes, unless pinned
            assert model.decide({**labelled_requests(1)[0], "model": name})["model"] == name
        assert sorted(model.decider.loaded) == (["acme/tune", "acme/tune-gguf"] if pinned else ["acme/tune", "acme/tune16"])


def _models(url: str) -> dict[str, dict[str, Any]]:
    response = httpx.get(f"{url}/v1/models", timeout=60)
    assert response.status_code == 200, response.text
    return {m["name"]: m for m in response.json()["models"]}


def test_models_lists_what_the_disk_cache_holds_after_a_restart(files, hub, tmp_path, monkeypatch):
    """/v1/models lists the names the disk cache holds (delivered before a restart: on disk; a pinned revision refused
    for good: refused, with the reason a request would get), without reading a file of it; then as a request finds them."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    pinned = f"acme/tune-gguf@{hub.sha('acme', 'tune-gguf')}"
    big, release = f"acme/big@{hub.sha('acme', 'big')}", f"acme/merged@{hub.sha('acme', 'merged')}"
    model, live = _serve(files, tmp_path / "cache")
    try:
        for name, status in (("acme/tune-gguf", 200), (pinned, 200), (big, 422), (release, 422)):
            assert _post(live.url, name).status_code == status, name
        before = _models(live.url)
    finally:
        live.stop()
        model.close()
    states = {"acme/tune-gguf": "on_disk", pinned: "on_disk", big: "refused", release: "refused"}
    assert {n: before[n]["state"] for n in states} == {**states, "acme/tune-gguf": "resident", pinned: "resident"}
    assert "--adapter-max-size" in before[big]["reason"] and "is a release" in before[release]["reason"]
    down = Hub(tmp_path / "down")
    down.close()
    monkeypatch.setenv("HF_ENDPOINT", down.url)  # restarted with the Hub gone: what is listed is the cache's
    hashed: list[Path] = []
    real_sha256 = adapter_cache._sha256
    monkeypatch.setattr(adapter_cache, "_sha256", lambda path: hashed.append(path) or real_sha256(path))
    model, live = _serve(files, tmp_path / "cache")
    try:
        after = _models(live.url)
        assert hashed == []  # (listed from the cache's records: no file read)
        assert {n: after[n]["state"] for n in states} == states
        assert {n: after[n]["reason"] for n in (big, release)} == {n: before[n]["reason"] for n in (big, release)}
        response = _post(live.url, "acme/tune-gguf")
        assert response.status_code == 200 and response.json()["model"] == "acme/tune-gguf"
        assert _models(live.url)["acme/tune-gguf"]["state"] == "resident" and len(hashed) == 1
    finally:
        live.stop()
        model.close()


def test_a_push_to_main_answers_after_the_refresh_period_and_a_hub_down_then_fails_nothing(files, hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    moving = hub.repo("acme", "moving") / "moving.adapter.gguf"
    shutil.copyfile(files.adapter, moving)
    refresh_s = 3.0
    model, live = _serve(files, tmp_path / "cache", adapter_refresh=refresh_s)

    def version(name: str) -> str:
        response = _post(live.url, name)
        assert response.status_code == 200, response.text
        return response.headers[MODEL_SHA256_HEADER]

    try:
        f32, f16 = version("acme/tune-gguf"), version("acme/tune16")  # each adapter file's version over this base
        assert f32 != f16 and version("acme/moving") == f32
        kept = time.time()  # (the entry was kept before this)
        shutil.copyfile(files.adapter16, moving)  # a push to main: the stand-in's sha moves
        assert version("acme/moving") == f32 and hub.lookups["acme/moving"] == 0  # within the period: not asked
        while time.time() - kept < refresh_s:
            time.sleep(0.05)
        deadline = time.monotonic() + 120
        while (answered := version("acme/moving")) != f16:  # the version held answers until the new one is ready
            assert answered == f32 and time.monotonic() < deadline
            time.sleep(0.05)
        assert hub.lookups["acme/moving"] == 1 and hub.downloads_of("acme", "moving") == 2
        kept = time.time()
        shutil.copyfile(files.adapter, moving)
        down = Hub(tmp_path / "down")
        down.close()
        monkeypatch.setenv("HF_ENDPOINT", down.url)  # the Hub gone at refresh time: the version held answers
        while time.time() - kept < refresh_s:
            time.sleep(0.05)
        while "hf://acme/moving@main/" not in model.catalog.sources._failed:  # (the look failed, backed off)
            assert version("acme/moving") == f16 and time.monotonic() < deadline
            time.sleep(0.05)
        assert version("acme/moving") == f16 and hub.lookups["acme/moving"] == 1
    finally:
        live.stop()
        model.close()


def test_serve_refuses_a_source_that_is_not_one_in_one_line(files, tmp_path):
    cases = (("s3://bucket/tunes", "is not one: a folder, hf://ORG or hf://ORG/REPO"), (str(tmp_path / "no"), "not a folder"))
    for source, words in cases:
        bounds = ("--adapter-cache-size", "1GiB", "--adapter-fetch-timeout", "5")
        run = run_cli("serve", files.base, "--adapter-source", source, *bounds)
        output = run.stdout + run.stderr
        assert run.returncode == 2 and words in output and "Traceback" not in output, output
        assert len([line for line in output.splitlines() if "adapter source" in line]) == 1


class _Watched(AdapterCounts):
    """AdapterCounts as `clef-gguf serve` has them, telling the test how many disk lookups each name made (a first
    use's misses reach /metrics only once its fetch ends)."""

    def __init__(self) -> None:
        super().__init__(ServeSettings.metrics_adapter_cap)
        self.looks: Counter[str] = Counter()

    def looked_up(self, name: str, hit: bool) -> None:
        super().looked_up(name, hit)
        self.looks[name] += 1


def _counted(files: Files, cache: Path, counts: AdapterCounts | None = None) -> tuple[Any, Any]:
    """_serve's model and app, its adapter sources and its decider counted as `clef-gguf serve` counts them."""
    spec = ModelSpec.of(files.base, **_settings(files, cache))
    counts = counts or AdapterCounts(ServeSettings.metrics_adapter_cap)
    model = ClefModel(spec, counts, counts)
    return model, start(create_app(model, adapters=local_view(counts, model.resident_adapters)))


def _scraped(url: str) -> dict[str, dict[str, float]]:
    """Each adapter label's figures on /metrics: counters by name (fetch_failures by reason), histograms' _count."""
    figures: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for s in family.samples:
            if s.name.startswith("clef_adapter_") and "le" not in s.labels and not s.name.endswith(("_sum", "_created")):
                what = s.name.removeprefix("clef_adapter_").removesuffix("_total")
                what += f":{s.labels['reason']}" if "reason" in s.labels else ""
                figures.setdefault(s.labels["adapter"], {})[what] = s.value
    return figures


def test_a_scrape_counts_each_adapters_disk_lookups_fetch_and_conversion(files, hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    counts = _Watched()
    model, live = _counted(files, tmp_path / "cache", counts)
    before = dict(hub.downloads)
    try:
        hub.gate.clear()  # the Hub holds its answers until every first use has looked in the disk cache and waits
        answers: list[httpx.Response] = []
        first_uses = [threading.Thread(target=lambda: answers.append(_post(live.url, "acme/tune"))) for _ in range(8)]
        for t in first_uses:
            t.start()
        deadline = time.monotonic() + 120
        while counts.looks["acme/tune"] != 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "acme/tune" not in _scraped(live.url) and _scraped(live.url)[OTHER]["disk_lookups"] == 8
        hub.gate.set()
        for t in first_uses:
            t.join(120)
        assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
        assert _post(live.url, "acme/nothing").status_code == 422  # a fetch that fails: counted by its error's row
        scraped = _scraped(live.url)
    finally:
        hub.gate.set()
        live.stop()
        model.close()
    delivered = {k: n for k, n in hub.downloads.items() if k.startswith("acme/tune/") and n > before.get(k, 0)}
    nbytes = sum((hub.root / key).stat().st_size for key in delivered)
    tune = scraped["acme/tune"]
    # Each first use looked twice: a miss (then it waited for the one fetch), and the hit once the fetch was kept. The
    # misses, before its delivery, are OTHER's (a name takes a label once it exists: junk names cannot take them all).
    disk = ("disk_lookups", "disk_hits", "fetch_seconds_count", "conversion_seconds_count")
    assert [tune[k] for k in disk] == [8, 8, 1, 1], tune
    assert tune["fetched_bytes"] == nbytes and len(delivered) == 3 and not any(k.startswith("fetch_failures") for k in tune)
    assert (tune["loads"], tune["resident"], tune["lookups"] - tune["memory_hits"], tune["evictions"]) == (1, 1, 1, 0)
    # A name never delivered takes no label (junk names cannot crowd real ones out of theirs): its figures are OTHER's.
    nothing = scraped[OTHER]
    failed = {k: v for k, v in nothing.items() if k.startswith("fetch_failures")}
    # (looked twice too: the miss that started the fetch, and the look before its remembered refusal was raised)
    assert "acme/nothing" not in scraped  # (OTHER's 8 lookups are acme/tune's misses)
    assert (nothing["disk_lookups"], nothing["disk_hits"], nothing["fetch_seconds_count"], nothing["loads"]) == (10, 0, 0, 0)
    assert failed == {"fetch_failures:invalid": 1}, nothing
    down = Hub(tmp_path / "down")
    down.close()
    monkeypatch.setenv("HF_ENDPOINT", down.url)  # a restart with the Hub gone: the disk cache answers, nothing fetched
    model, live = _counted(files, tmp_path / "cache")
    try:
        for _ in range(2):
            assert _post(live.url, "acme/tune").status_code == 200
        tune = _scraped(live.url)["acme/tune"]
    finally:
        live.stop()
        model.close()
    assert [tune[k] for k in disk] == [2, 2, 0, 0], tune
    assert (tune["fetched_bytes"], tune["lookups"], tune["memory_hits"], tune["loads"]) == (0, 2, 1, 1)

"""Adapter sources on `serve --ray` (server/ray_relay.py): the ingress fetches from the Hub with the address and token
`serve --ray` was given (the session cluster's workers were started without them), and every replica takes the
adapter from the ingress, never from the Hub: one download for the cluster, each replica's answer the merged
fine-tune's, the token sent to the Hub and shown nowhere."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from live_server import served
from prometheus_client.parser import text_string_to_metric_families

import clef_gguf
from clef_gguf.conversion.adapter import convert_adapter
from clef_gguf.testing import finetune
from clef_gguf.testing.hub import Hub
from clef_gguf.testing.request_suite import flat_probabilities, labelled_requests

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LORA = {"r": 4, "lora_alpha": 8, "target_modules": r".*language_model.*\.(q_proj|in_proj_qkv|out_proj|down_proj)"}
CONTEXT = 4096
ROUNDED = 1e-4 + 1e-9  # answers are rounded to 4 decimals
TOKEN = "hf_relaytesttoken0123456789"
TIMEOUT = 300.0


@dataclass(frozen=True)
class OnRay:
    url: str
    hub: Hub
    log: Path
    merged: list[float]  # the merged fine-tune's answer to labelled_requests(1)[0], in this process
    pushed: Path  # the same fine-tune as an f16 adapter file: other bytes, a new commit when pushed


@pytest.fixture(scope="module")
def on_ray(ws, tmp_path_factory, ray_address, ray_serve_port) -> Iterator[OnRay]:
    """One `serve --ray` of two replicas over the Hub stand-in's acme (a clef-finetune checkpoint, and the same
    fine-tune as an adapter file); HF_ENDPOINT and HF_TOKEN in its environment only."""
    root = tmp_path_factory.mktemp("ray-sources")
    release, base = ws.release("untied_f32"), ws.gguf("untied_f32", "f32")
    checkpoint = finetune.peft_checkpoint(release, root / "tune", LORA, {"prior_logit_scale": 0.5})
    merged = clef_gguf.convert(checkpoint, root / "merged.gguf", "f32", base=release, mmproj=False)
    with clef_gguf.load(merged, max_prompt_tokens=CONTEXT, state_cache=0) as alone:
        expected = flat_probabilities(alone.decide(labelled_requests(1)[0]))
    hub = Hub(root / "hub")
    shutil.copytree(checkpoint, hub.repo("acme", "tune"), dirs_exist_ok=True)
    convert_adapter(checkpoint, release, hub.repo("acme", "tune-gguf") / "tune.adapter.gguf", "f32")
    pushed = convert_adapter(checkpoint, release, root / "tune16.adapter.gguf", "f16")
    args = ("--ray", "--replicas", "2", "--ctx", str(CONTEXT), "--state-cache", "0", "--parallel", "1")
    args += ("--adapter-source", "hf://acme", "--adapter-base-release", str(release), "--adapter-refresh", "2")
    env = {"RAY_ADDRESS": ray_address, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_CACHE": str(root / "hf")}
    try:
        with served(base, *args, env=env, port=ray_serve_port, log=root / "serve.log", timeout_s=TIMEOUT) as (url, _):
            yield OnRay(url, hub, root / "serve.log", expected, pushed)
    finally:
        hub.close()


def _post(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/systemone", json={**labelled_requests(1)[0], "model": name}, timeout=TIMEOUT)


def _loads_by_replica(scraped: str, adapter: str) -> dict[str, float]:
    return {
        s.labels["replica"]: s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
        if s.name == "clef_adapter_loads_total" and s.labels.get("adapter") == adapter
    }


def test_the_ingress_fetches_once_and_every_replica_answers_as_the_merged_fine_tune(on_ray):
    with ThreadPoolExecutor(8) as pool:  # first uses at once: both replicas get some
        answers = list(pool.map(lambda _: _post(on_ray.url, "acme/tune"), range(8)))
    for response in answers:
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "acme/tune"
        assert np.abs(np.subtract(flat_probabilities(response.json()), on_ray.merged)).max() <= ROUNDED
    gguf = _post(on_ray.url, "acme/tune-gguf")
    assert gguf.status_code == 200, gguf.text
    assert np.abs(np.subtract(flat_probabilities(gguf.json()), on_ray.merged)).max() <= ROUNDED
    # One download of each file for the cluster (the ingress's), however many replicas loaded it.
    assert on_ray.hub.downloads_of("acme", "tune") == 3 and on_ray.hub.downloads_of("acme", "tune-gguf") == 1
    # serve --ray's token reached the ingress and the Hub with each of its requests (huggingface-hub's own daily
    # fetch of its agent registry, /api/agent-harnesses, sends none).
    assert {t for t in on_ray.hub.tokens if t} == {f"Bearer {TOKEN}"}
    loads = _loads_by_replica(httpx.get(f"{on_ray.url}/metrics", timeout=60).text, "acme/tune")
    assert sum(loads.values()) >= 1, loads  # (each replica that decided it loaded it once, from the ingress's bytes)
    shown = httpx.get(f"{on_ray.url}/v1/models", timeout=60).text + httpx.get(f"{on_ray.url}/metrics", timeout=60).text
    assert TOKEN not in shown and TOKEN not in on_ray.log.read_text(errors="replace")


def test_a_name_outside_the_allow_list_is_refused_at_the_ingress_and_fetches_nothing(on_ray):
    before = len(on_ray.hub.tokens)
    response = _post(on_ray.url, "evil/tune")
    assert response.status_code == 403, response.text
    assert "permission_error" in response.text and "(hf://acme)" in response.text and len(on_ray.hub.tokens) == before


def test_a_push_the_ingress_follows_reaches_every_replica_without_a_refusal(on_ray):
    """The ingress follows acme/tune-gguf's branch (--adapter-refresh 2); a replica holding the old version takes the
    new one from it (sources.fetch_again) instead of refusing the request as changed on the way."""
    old = _post(on_ray.url, "acme/tune-gguf")
    assert old.status_code == 200, old.text
    shutil.copyfile(on_ray.pushed, on_ray.hub.repo("acme", "tune-gguf") / "tune.adapter.gguf")
    time.sleep(2.5)  # (the refresh period: the entry is then due a look at the branch)
    seen: list[str] = []
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:  # the first uses after the period may answer as the old version, while it is fetched
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: _post(on_ray.url, "acme/tune-gguf"), range(4)))
        for response in answers:
            assert response.status_code == 200, response.text
            seen.append(response.headers["Clef-Model-Sha256"])
        if len(seen) >= 8 and len(set(seen[-8:])) == 1 and seen[-1] != old.headers["Clef-Model-Sha256"]:
            break
        time.sleep(0.5)
    assert seen[-1] != old.headers["Clef-Model-Sha256"] and len(set(seen[-8:])) == 1, seen
    assert on_ray.hub.downloads_of("acme", "tune-gguf") == 2  # (the new commit once, by the ingress)

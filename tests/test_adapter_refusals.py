"""Every refusal of an adapter is a 4xx (or a 503 with Retry-After for a file gone) from the problem table, naming the
file but never the server's folders; an adapter whose LoRA holds NaN or Inf, or whose alpha overflows, is refused by
`validate BASE --adapter` and at load; llama-server's head-less variant is refused by decide and serve unless the
base's head is asked for; names mean one thing (jev-latest, the names /v1/models lists, metrics by the name asked);
and the same on Ray.

One `clef-gguf serve` on loopback over a folder of bad files (not GGUF, empty, truncated, a model, another base's
adapter, NaN weights, alpha 1e6, llama-server's variant, one deleted after its first use) and one file under two names;
the real CLI for validate and decide; one `serve --ray` on the session's Ray cluster, two replicas with the named
adapters and a folder's: each model answers by its name as a ClefModel loaded with the same adapters does here (the Ray
case of tests/test_ray_adapters.py), and the refusals, names and counts are the plain server's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import typesafe_sdk as ts
from cli_helpers import run_cli  # the CLI in this process
from live_server import served
from peft_adapters import peft_adapter
from prometheus_client.parser import text_string_to_metric_families

import clef_gguf
from clef_gguf.check.adapter_pair import validate_adapter_pair
from clef_gguf.conversion.adapter import convert_adapter
from clef_gguf.errors import AdapterBaseError, CorruptModelError, IncompleteModelError
from clef_gguf.format import adapter as A
from clef_gguf.testing.gguf_bytes import rewritten_adapter
from clef_gguf.testing.release_builder import ReleaseSpec, build_release
from clef_gguf.testing.request_suite import flat_probabilities, labelled_requests

CLI = [sys.executable, "-m", "clef_gguf.cli"]
CONTEXT = 4096
TIMEOUT = 300.0
ROUNDED = 1e-4 + 1e-9  # answers are rounded to 4 decimals: float noise may move one by a unit
NAN_TENSOR = "blk.0.ffn_up.weight.lora_a"
# Folder files that cannot be served, each with what its refusal must say.
BAD = {
    "notgguf": "notgguf.adapter.gguf",
    "empty": "empty.adapter.gguf",
    "truncated": "truncated.adapter.gguf",
    "model": "model.adapter.gguf",
    "other": "other.adapter.gguf",
    "nan": NAN_TENSOR,
    "alpha": A.KEY_ALPHA,
    "headless": "llama-server",
}


@dataclass(frozen=True)
class Files:
    root: Path
    base: Path
    good: Path
    other: Path  # an adapter of another base (another seed's release)
    nan: Path
    alpha: Path
    headless: Path  # convert --to-adapter --llama-server
    folder: Path  # good, gone and every BAD file as NAME.adapter.gguf


@pytest.fixture(scope="module")
def files(ws, tmp_path_factory) -> Files:
    root = tmp_path_factory.mktemp("refusals")
    release, base = ws.release("untied_f32"), ws.gguf("untied_f32", "f32")
    good = peft_adapter(release, root, "good")
    other_release = build_release(root / "other-release", ReleaseSpec(seed=7, vision=False))
    other = peft_adapter(other_release, root, "other")
    checkpoint = root / "good" / "checkpoint-4"  # (peft_adapter's)
    headless = convert_adapter(checkpoint, release, root / "headless.adapter.gguf", "f32", llama_server=True)
    a = next(np.array(t.data) for t in gguf.GGUFReader(good).tensors if t.name == NAN_TENSOR).copy()
    a[0, 0] = np.nan
    nan = rewritten_adapter(good, root / "nan.adapter.gguf", {NAN_TENSOR: a})
    alpha = rewritten_adapter(good, root / "alpha.adapter.gguf", alpha=1e6)
    folder = root / "tunes"
    folder.mkdir()
    for name, source in {"good": good, "gone": good, "model": base, "other": other, "nan": nan, "alpha": alpha}.items():
        shutil.copyfile(source, folder / f"{name}.adapter.gguf")
    shutil.copyfile(headless, folder / "headless.adapter.gguf")
    (folder / "notgguf.adapter.gguf").write_text("this is no GGUF file\n" * 20)
    (folder / "empty.adapter.gguf").write_bytes(b"")
    whole = good.read_bytes()
    (folder / "truncated.adapter.gguf").write_bytes(whole[: len(whole) // 2])
    return Files(root, base, good, other, nan, alpha, headless, folder)


def _request(model: str | None = None) -> dict:
    request = labelled_requests(1)[0]
    return {**request, "model": model} if model is not None else request


def _refused(response: httpx.Response, files: Files, says: str) -> None:
    """A 4xx (or the 503 of a file gone, with Retry-After) naming the file, not where the server keeps it."""
    status = response.status_code
    assert 400 <= status < 500 or (status == 503 and response.headers.get("retry-after")), (status, response.text)
    assert str(files.root) not in response.text and str(files.folder) not in response.text, response.text
    assert says in response.text, response.text


# --- validate and load ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_validate_refuses_nan_lora_weights_and_an_alpha_that_overflows(files):
    nan = run_cli("validate", files.base, "--adapter", files.nan)
    assert nan.returncode == 5 and NAN_TENSOR in nan.stdout + nan.stderr, nan.stdout + nan.stderr
    alpha = run_cli("validate", files.base, "--adapter", files.alpha)
    assert alpha.returncode == 7 and A.KEY_ALPHA in alpha.stdout + alpha.stderr, alpha.stdout + alpha.stderr
    deep = validate_adapter_pair(files.base, files.alpha, deep=True)
    assert deep.exit_code == 7 and "1e+06" in deep.second.summary  # --deep, which it pointed to, refuses it too
    assert validate_adapter_pair(files.base, files.nan, deep=True).exit_code == 5
    # No false alarm: the sound adapter, and llama-server's variant (sound for llama-server), validate.
    assert validate_adapter_pair(files.base, files.good).exit_code == 0
    assert validate_adapter_pair(files.base, files.headless).exit_code == 0


def test_load_refuses_them_and_the_head_less_variant_unless_asked_for_the_base_head(files):
    with pytest.raises(CorruptModelError, match=NAN_TENSOR):
        clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter=files.nan)
    with pytest.raises(IncompleteModelError, match="adapter.lora.alpha = 1e\\+06"):
        clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapters={"x": files.alpha})
    with pytest.raises(IncompleteModelError, match="llama-server's variant.*base-head"):
        clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter=files.headless)
    with (
        clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter=files.headless, base_head=True) as tuned,
        clef_gguf.load(files.base, max_prompt_tokens=CONTEXT) as plain,
    ):
        request = _request()
        assert tuned.decide(request)["answers"] != plain.decide(request)["answers"]  # its LoRA, the base's head


def test_decide_refuses_the_head_less_variant_unless_base_head(files, tmp_path):
    request = tmp_path / "request.json"
    request.write_text(json.dumps(_request()))
    common = ["decide", files.base, request, "--ctx", str(CONTEXT), "--adapter", files.headless]
    refused = run_cli(*common)
    assert refused.returncode == 7 and "--base-head" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    allowed = run_cli(*common, "--base-head")
    assert allowed.returncode == 0 and "answers" in json.loads(allowed.stdout), allowed.stderr


def test_decide_on_ray_checks_the_adapter_against_the_base_before_a_cluster(files, tmp_path):
    """One line and exit 7, at once, as locally: no cluster started, no Ray traceback."""
    data = tmp_path / "requests.jsonl"
    data.write_text(json.dumps(_request()) + "\n")
    args = [str(files.base), str(data), "--ctx", str(CONTEXT), "--adapter", str(files.other)]
    local = run_cli("decide", *args, "-o", tmp_path / "local.jsonl")  # (in this process: the refusal on Ray's reference)
    started = time.monotonic()
    env = {**os.environ, "RAY_ADDRESS": ""}
    on_ray = subprocess.run(
        [*CLI, "decide", *args, "-o", str(tmp_path / "ray.jsonl"), "--ray"], capture_output=True, text=True, env=env, timeout=300
    )
    assert local.returncode == on_ray.returncode == AdapterBaseError.exit_code, on_ray.stderr
    assert on_ray.stderr == local.stderr and len(on_ray.stderr.strip().splitlines()) == 1, on_ray.stderr
    assert "Traceback" not in on_ray.stderr and time.monotonic() - started < 60
    assert not (tmp_path / "ray.jsonl").exists()


def test_a_workers_typed_error_crosses_ray_as_itself():
    """What Ray hands the driver for an actor's error (a RayTaskError of it, inside Ray Data's UserCodeException)
    is raised as the actor's own error: its type, its exit code, its one line."""
    pytest.importorskip("ray.data")
    from ray.data.exceptions import UserCodeException
    from ray.exceptions import RayTaskError

    from clef_gguf.runtime.dataset_ray import clef_cause, same_error

    error = same_error(AdapterBaseError("x.adapter.gguf does not fit"), "a Ray worker on 10.0.0.1 cannot load the model: ...")
    assert type(error) is AdapterBaseError and error.exit_code == 7
    task = RayTaskError("_PartActor.__init__", "Traceback (most recent call last):\n ...", error).as_instanceof_cause()
    try:
        try:
            raise task
        except RayTaskError as e:
            raise UserCodeException("UDF failed") from e
    except UserCodeException as wrapped:
        assert clef_cause(wrapped) is error
    assert clef_cause(RuntimeError("no cause")) is None


# --- serve ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(files):
    args = ("--ctx", str(CONTEXT), "--state-cache", "0", "--max-adapters", "1", "--adapter-dir", str(files.folder))
    args += ("--adapter", f"a={files.good}", "--adapter", f"b={files.good}")  # one file, two names
    with served(files.base, *args) as (url, _), httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        yield client


@pytest.mark.slow
def test_every_bad_file_in_the_folder_is_a_4xx_naming_the_file_not_its_folder(server, files):
    for name, says in BAD.items():
        _refused(server.post("/v1/systemone", json=_request(name)), files, says)
        run = server.post("/accounts/a/ai/run/@cf/cloudflare/clef-flash", json={**_request(), "lora": name})
        _refused(run, files, says)
        assert run.json()["success"] is False
    assert server.post("/v1/systemone", json=_request("good")).status_code == 200  # the server goes on


def test_an_adapter_deleted_after_its_first_use_is_refused_not_a_500(server, files):
    assert server.post("/v1/systemone", json=_request("gone")).status_code == 200
    assert server.post("/v1/systemone", json=_request("good")).status_code == 200  # (--max-adapters 1: gone unloaded)
    (files.folder / "gone.adapter.gguf").unlink()
    _refused(server.post("/v1/systemone", json=_request("gone")), files, "gone")
    assert server.post("/v1/systemone", json=_request("good")).status_code == 200


def test_typesafe_sdk_at_its_defaults_is_answered_by_a_server_with_adapters(server):
    url = str(server.base_url).rstrip("/")
    with ts.TypeSafeClient(base_url=url, api_key="local") as sdk:
        got = sdk.system_one(state="The parcel arrived broken.", questions={"refund": ts.Noul(instructions="Refund?")})
        assert got.model == "jev-latest"
        assert "jev-latest" in [m.name for m in sdk.models.list().models]


def test_every_name_v1_models_lists_is_servable_or_refused_with_its_reason(server, files):
    listed = {m["name"]: m for m in server.get("/v1/models").json()["models"]}
    assert {"a", "b", "good", "jev-latest"} <= set(listed)
    for name, model in listed.items():
        response = server.post("/v1/systemone", json=_request(name))
        if model["state"] == "refused":  # the reason the request gets, naming the file and never its folder
            _refused(response, files, model["reason"])
        else:
            assert response.status_code == 200, (name, response.text)
    assert {name: listed[name]["state"] for name in BAD} == dict.fromkeys(BAD, "refused")
    assert all(says in listed[name]["reason"] for name, says in BAD.items()), listed


def _decided(scraped: str) -> dict[str, float]:
    return {
        s.labels["model"]: s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
        if s.name == "clef_decision_seconds_count" and s.labels["phase"] == "compute"
    }


def test_one_file_under_two_names_answers_and_counts_by_the_name_asked(server):
    before = _decided(server.get("/metrics").text)
    answered = [server.post("/v1/systemone", json=_request(name)).json()["model"] for name in ("a", "a", "b")]
    assert answered == ["a", "a", "b"]
    after = _decided(server.get("/metrics").text)
    assert after.get("a", 0) - before.get("a", 0) == 2 and after.get("b", 0) - before.get("b", 0) == 1


# --- serve --ray ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OnRay:
    url: str
    folder: Path  # good, nan, other, notgguf (files.folder's); urgency and counted: fine-tunes of their own


@pytest.fixture(scope="module")
def on_ray(ws, files, tmp_path_factory, ray_address, ray_serve_port) -> Iterator[OnRay]:
    """One `serve --ray` on the session's Ray cluster (conftest.py's ray_address) for the tests below: two replicas,
    the named adapters (a and b: one file, two names) and the folder's (resolved by a replica on its first request)."""
    root = tmp_path_factory.mktemp("ray")
    folder = root / "tunes"
    folder.mkdir()
    for name in ("good", "nan", "other", "notgguf"):
        shutil.copyfile(files.folder / f"{name}.adapter.gguf", folder / f"{name}.adapter.gguf")
    peft_adapter(ws.release("untied_f32"), folder, "urgency", seed=1)
    peft_adapter(ws.release("untied_f32"), folder, "counted", seed=2)  # (asked only by the test of the adapter metrics)
    args = ("--ray", "--replicas", "2", "--ctx", str(CONTEXT), "--state-cache", "0", "--parallel", "1")
    args += ("--adapter-dir", str(folder), "--adapter", f"a={files.good}", "--adapter", f"b={files.good}")
    on_ray = {"env": {"RAY_ADDRESS": ray_address}, "port": ray_serve_port, "log": root / "serve.log"}
    with served(files.base, *args, **on_ray, timeout_s=300) as (url, _):
        yield OnRay(url, folder)


def _decided_since(client: httpx.Client, before: dict[str, float]) -> dict[str, float]:
    """The decisions counted by model name since `before` (the other test's requests left out)."""
    after = _decided(client.get("/metrics").text)
    return {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}


@pytest.mark.ray
@pytest.mark.slow
def test_serve_on_ray_answers_each_model_by_its_name(files, on_ray):
    """Every replica is loaded with the same fine-tunes, and the ingress resolves a request's model name to the identity
    the replicas give it: each answers as a ClefModel loaded with the same adapters answers in this process."""
    requests = labelled_requests(3)
    names = [None, "a", "urgency"]
    # The reference, in this process: the base loaded with the same adapters, one request at a time, no state cache.
    loading = {"max_prompt_tokens": CONTEXT, "state_cache": 0, "parallel": 1}
    with clef_gguf.load(files.base, adapters={"a": files.good}, adapter_dir=on_ray.folder, **loading) as model:
        want = {(n, i): flat_probabilities(model.decide({**r, "model": n})) for n in names for i, r in enumerate(requests)}
    assert max(np.abs(np.subtract(want["urgency", 0], want[None, 0]))) > 0.01  # the fine-tunes answer otherwise
    assert max(np.abs(np.subtract(want["a", 0], want["urgency", 0]))) > 0.01
    with httpx.Client(base_url=on_ray.url, timeout=TIMEOUT) as client:
        before = _decided(client.get("/metrics").text)
        # Twice each, from 6 threads at once: both replicas decide, each loading the adapters it is asked for.
        sent = [(n, i) for n in names for i in range(len(requests))] * 2
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda key: client.post("/v1/systemone", json={**requests[key[1]], "model": key[0]}), sent))
        for key, response in zip(sent, got, strict=True):
            assert response.status_code == 200, (key, response.text)
            assert response.json()["model"] == (key[0] or model.name)
            assert np.abs(np.subtract(flat_probabilities(response.json()), want[key])).max() <= ROUNDED, key
        run = client.post("/accounts/a/ai/run/@cf/cloudflare/clef-flash", json={**requests[0], "lora": "urgency"}).json()
        assert run["success"] and np.abs(np.subtract(flat_probabilities(run["result"]), want["urgency", 0])).max() <= ROUNDED
        unknown = client.post("/v1/systemone", json={**requests[0], "model": "nope"})
        assert unknown.status_code == 422, unknown.text
        # The names it could have meant: the two named and the folder's six files (more than the message lists).
        assert "'nope'" in unknown.text and "and 8 adapters" in unknown.text, unknown.text
        listed = [m["name"] for m in client.get("/v1/models").json()["models"]]
        assert {"a", "b", "urgency"} <= set(listed)
        decided = _decided_since(client, before)  # the ingress's, each decided request under its model's name
    assert decided == {model.name: 6, "a": 6, "urgency": 7}


@pytest.mark.ray
@pytest.mark.slow
def test_serve_on_ray_refuses_alike_and_answers_typesafe_sdk_defaults(files, on_ray):
    with (
        httpx.Client(base_url=on_ray.url, timeout=TIMEOUT) as client,
        ts.TypeSafeClient(base_url=on_ray.url, api_key="local") as sdk,
    ):
        before = _decided(client.get("/metrics").text)
        got = sdk.system_one(state="The parcel arrived broken.", questions={"refund": ts.Noul(instructions="Refund?")})
        assert got.model == "jev-latest"
        for name in ("nan", "other", "notgguf"):
            _refused(client.post("/v1/systemone", json=_request(name)), files, BAD[name])
        assert [client.post("/v1/systemone", json=_request(n)).json()["model"] for n in ("a", "a", "b")] == ["a", "a", "b"]
        decided = _decided_since(client, before)
        listed = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
    assert decided.get("a") == 2 and decided.get("b") == 1
    assert "jev-latest" in listed and all(BAD[n] in listed[n]["reason"] for n in ("nan", "other", "notgguf")), listed


def _per_replica(scraped: str, adapter: str) -> dict[str, dict[str, float]]:
    """One adapter's figures on the ingress's scrape, by replica: its counters, resident versions and bytes."""
    figures: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(scraped):
        for s in family.samples:
            if s.name.startswith("clef_adapter_") and s.labels.get("adapter") == adapter and "le" not in s.labels:
                what = s.name.removeprefix("clef_adapter_").removesuffix("_total")
                figures.setdefault(s.labels["replica"], {})[what] = s.value
    return figures


@pytest.mark.ray
@pytest.mark.slow
def test_serve_on_ray_brings_every_replicas_adapter_counts_to_the_ingress_scrape(on_ray):
    """Each replica's per-adapter counts reach the ingress's /metrics with its decisions, labelled by replica: after
    a scripted workload, exactly one lookup per request, one load on each replica that decided one (the rest hits),
    no eviction; /v1/models says the adapter is resident."""
    sent = 5
    with httpx.Client(base_url=on_ray.url, timeout=TIMEOUT) as client:
        assert {m["name"]: m["state"] for m in client.get("/v1/models").json()["models"]}["counted"] == "on_disk"
        for _ in range(sent):
            response = client.post("/v1/systemone", json=_request("counted"))
            assert response.status_code == 200, response.text
        replicas = _per_replica(client.get("/metrics").text, "counted")
        listed = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
    assert 1 <= len(replicas) <= 2 and sum(r["lookups"] for r in replicas.values()) == sent, replicas
    for figures in replicas.values():
        assert figures["loads"] == figures["load_seconds_count"] == 1 and figures["memory_hits"] == figures["lookups"] - 1
        assert figures["evictions"] == figures["retirements"] == 0 and figures["resident"] == 1 and figures["resident_bytes"] > 0
    assert listed["counted"]["state"] == "resident"

"""`clef-gguf serve --ray` with adapters (runtime/adapters.py): every replica is loaded with the same fine-tunes, and
the ingress resolves a request's model name to the identity the replicas give it (runtime/catalog.py).

One application start on the session's Ray cluster (conftest.py's ray_address, as tests/test_ray_serve.py's): two
replicas, one adapter named (--adapter) and one in a folder (--adapter-dir, resolved by a replica on its first
request), each answering as a ClefModel loaded with the same adapters answers in this process.
"""

from __future__ import annotations

import json
import pickle
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra: pip install 'clef-gguf[ray]' (tools/test.sh does)")

from live_server import served  # noqa: E402
from peft_adapters import peft_adapter  # noqa: E402

import clef_gguf  # noqa: E402
from clef_gguf.errors import SettingsError  # noqa: E402
from clef_gguf.server.ray_serve import build_app, settings_from_args  # noqa: E402
from clef_gguf.settings import AdapterSet, LoadOptions, ModelSpec  # noqa: E402
from clef_gguf.testing.request_suite import flat_probabilities, labelled_requests  # noqa: E402

CONTEXT = 4096
ROUNDED = 1e-4 + 1e-9  # answers are rounded to 4 decimals: float noise may move one by a unit
TIMEOUT = 300.0
DEPLOY_TIMEOUT_S = 300  # a Ray worker process per replica, on a 2-core machine shared with other jobs


def test_every_replica_is_bound_with_the_adapter_settings():
    """What each ClefReplica builds its model from (its deployment's arguments, the same for every replica: one
    ModelSpec, the adapters in its AdapterSet), and the ingress's encoder the same spec; a config's adapters sit in
    their own table, `adapter_set` (under `load` they are refused, saying where they belong)."""
    expected = {"adapters": {"a": "/a.adapter.gguf"}, "adapter_dir": "/tunes", "max_adapters": 3, "adapter_memory": 1 << 30}
    settings = settings_from_args({"model": "/m.gguf", "scale": {"replicas": 2}, "adapter_set": expected})
    ingress = build_app(settings)._bound_deployment
    replicas = ingress.init_args[0]._bound_deployment
    assert replicas.num_replicas == 2
    [spec] = replicas.init_args
    assert ingress.init_args[1] == spec == ModelSpec("/m.gguf", LoadOptions(n_threads=1), AdapterSet(**expected))
    pickle.loads(pickle.dumps(spec))  # (what Ray hands each replica)
    with pytest.raises(SettingsError, match=r"load\.adapter_dir: not a setting here; it is adapter_set\.adapter_dir"):
        settings_from_args({"model": "/m.gguf", "load": {"adapter_dir": "/tunes"}})


@pytest.mark.ray
@pytest.mark.slow
def test_serve_on_ray_answers_each_model_by_its_name(ws, tmp_path, ray_address, ray_serve_port):
    release, base = ws.release("untied_f32"), ws.gguf("untied_f32", "f32")
    named = peft_adapter(release, tmp_path, "triage")
    folder = tmp_path / "tunes"
    folder.mkdir()
    peft_adapter(release, folder, "urgency", seed=1)
    requests = labelled_requests(3)
    names = [None, "triage", "urgency"]
    # The reference, in this process: the base loaded with the same adapters, one request at a time, no state cache.
    loading = {"max_prompt_tokens": CONTEXT, "state_cache": 0, "parallel": 1}
    with clef_gguf.load(base, adapters={"triage": named}, adapter_dir=folder, **loading) as model:
        want = {(n, i): flat_probabilities(model.decide({**r, "model": n})) for n in names for i, r in enumerate(requests)}
    assert max(np.abs(np.subtract(want["urgency", 0], want[None, 0]))) > 0.01  # the fine-tunes answer otherwise
    assert max(np.abs(np.subtract(want["triage", 0], want["urgency", 0]))) > 0.01
    args = ("--ray", "--replicas", "2", "--ctx", str(CONTEXT), "--state-cache", "0", "--parallel", "1")
    args += ("--adapter", f"triage={named}", "--adapter-dir", str(folder))
    on_ray = {"env": {"RAY_ADDRESS": ray_address}, "port": ray_serve_port, "log": tmp_path / "serve.log"}
    with (
        served(base, *args, **on_ray, timeout_s=DEPLOY_TIMEOUT_S) as (url, _),
        httpx.Client(base_url=url, timeout=TIMEOUT) as client,
    ):
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
        detail = json.dumps(unknown.json())
        assert "'nope'" in detail and "triage, urgency" in detail
        listed = [m["name"] for m in client.get("/v1/models").json()["models"]]
        assert {"triage", "urgency"} <= set(listed)
        scraped = client.get("/metrics").text  # the ingress's, each decided request under its model's name
    decided = {
        s.labels["model"]: s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
        if s.name == "clef_decision_seconds_count" and s.labels["phase"] == "compute"
    }
    assert decided == {model.name: 6, "triage": 6, "urgency": 7}


def test_serve_on_ray_refuses_a_bad_adapter_before_ray_starts(ws):
    """The named adapters are checked against the model as loading checks them, before any Ray process starts."""
    import os
    import subprocess
    import sys

    from live_server import free_port

    base = ws.gguf("untied_f32", "f32")
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(base), "--ray", "--port", str(free_port())]
    run = subprocess.run(
        [*command, "--adapter", f"x={base}"], capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": ""}
    )
    assert run.returncode == 6 and "is not an adapter file" in run.stderr, run.stderr  # (a model given as the adapter)
    assert "Traceback" not in run.stderr and "Ray" not in run.stderr

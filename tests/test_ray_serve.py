"""`clef-gguf serve --ray`: the plain server's app on Ray Serve, held to the plain server.

`clef-gguf serve --ray --replicas 2` joins the session's local Ray cluster on loopback (conftest.py's ray_address:
Ray's single-node mode, testing/ray_cluster.py) as a subprocess (RAY_ADDRESS), as an operator would; a plain
`clef-gguf serve` of the same demo model is the reference. Checked: the same answers, byte for byte; the released
clients (server_helpers.py's checks, test_clients.py's) against the Ray endpoint; the same 4xx for bad requests; a
replica's process killed under load loses no request its client did not see fail with a retryable 503, and the
replica comes back; the documented config file deploys with `serve run`, its API key and autoscaling included; a
replica that cannot answer a decision never becomes ready. SIGTERM on a local cluster `serve --ray` starts itself
(drain, our 503, the port closed, no session folder left) is test_ray_installed.py's, on the installed package.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra: pip install 'clef-gguf[ray]' (tools/test.sh does)")

import yaml  # noqa: E402  (Ray's own dependency, for `serve run` configs)
from cli_helpers import run_cli  # noqa: E402
from live_server import free_port, served, wait_healthy  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.schema import ApplicationStatus  # noqa: E402
from server_helpers import (  # noqa: E402
    MALFORMED,
    WORKERS_AI_PATHS,
    answer_of,
    check_clef_compactor,
    check_clef_evals,
    check_clef_rag,
    check_clef_router,
    check_typesafe_sdk,
    open_body,
    set_workers_ai_env,
)

import clef_gguf  # noqa: E402
from clef_gguf.cli.errors import STOP_S  # noqa: E402
from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST  # noqa: E402
from clef_gguf.errors import ModelFileError, SettingsError  # noqa: E402
from clef_gguf.server.ray_serve import APP_NAME, RaySettings, build_app, settings_from_args  # noqa: E402
from clef_gguf.settings import HttpLimits, LoadOptions, ModelSpec, RayScale, ServeSettings  # noqa: E402
from clef_gguf.testing import ray_cluster  # noqa: E402
from clef_gguf.testing.request_suite import all_requests, long_state_request, mixed_request  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300.0
DEPLOY_TIMEOUT_S = 300  # a Ray worker process per replica, on a 2-core machine shared with other jobs


@pytest.fixture(scope="module")
def ray_url(ray_address: str, ray_serve_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    # No state cache, here and in plain_url: which replica saw a state before would show in usage.cached_tokens,
    # and the bodies are compared byte for byte (the cache's own answers are tested in test_state_cache.py). One
    # request at a time (--parallel 1) for the same reason: which requests a batch holds moves the answers by float
    # noise (tests/test_batching.py). A body rate of its own (the defaults are 5 s and 240 B/s), held at the ingress.
    args = ("--ray", "--replicas", "2", "--state-cache", "0", "--parallel", "1", "--body-grace", "1", "--min-body-rate", "1000")
    on_ray = {"env": {"RAY_ADDRESS": ray_address}, "port": ray_serve_port, "log": log}
    with served(DEMO_MODEL, *args, **on_ray, timeout_s=DEPLOY_TIMEOUT_S) as (url, process):
        ray_cluster.wait_deployed(log, process, DEPLOY_TIMEOUT_S)  # both replicas up, not only the ingress
        yield url


@pytest.fixture(scope="module")
def plain_url() -> Iterator[str]:
    with served(DEMO_MODEL, "--state-cache", "0", "--parallel", "1") as (url, _):
        yield url


def replica_states() -> dict[str, int]:
    return {str(state): n for state, n in serve.status().applications[APP_NAME].deployments["ClefReplica"].replica_states.items()}


def post(url: str, path: str, content: bytes, headers: dict[str, str] | None = None, method: str = "POST") -> httpx.Response:
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.request(method, f"{url}{path}", content=content, headers=headers, timeout=TIMEOUT)


def same_response(ray: httpx.Response, plain: httpx.Response) -> None:
    assert (ray.status_code, ray.content) == (plain.status_code, plain.content), (ray.text, plain.text)
    for header in ("content-type", "retry-after", "www-authenticate"):
        assert ray.headers.get(header) == plain.headers.get(header), header


# --- The same answers --------------------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_two_replicas_answer_as_the_plain_server(ray_url, plain_url):
    assert replica_states() == {"RUNNING": 2}
    bodies = [DEMO_REQUEST.read_bytes()] + [json.dumps(r, ensure_ascii=False).encode() for r in all_requests().values()]
    paths = ["/v1/systemone", WORKERS_AI_PATHS[-1]]
    want = {(path, body): post(plain_url, path, body) for path in paths for body in bodies}
    # From 8 threads at once, so that both replicas decide (each answers as one model, first come first served).
    with ThreadPoolExecutor(8) as pool:
        got = dict(zip(want, pool.map(lambda key: post(ray_url, *key), want), strict=True))
    for key, plain in want.items():
        assert plain.status_code == 200
        same_response(got[key], plain)
        assert "decide;dur=" in got[key].headers["server-timing"]
    for url in (ray_url, plain_url):  # the same model listed, the same health fields
        assert httpx.get(f"{url}/v1/models").json() == httpx.get(f"{plain_url}/v1/models").json()
    assert httpx.get(f"{ray_url}/health").json() | {"pending": 0, "reading": 0} == httpx.get(f"{plain_url}/health").json()


# --- The released clients, as test_clients.py runs them against the plain server ------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_typesafe_sdk_parses_every_answer_type_and_gets_422_for_a_null_level(ray_url):
    check_typesafe_sdk(ray_url)


@pytest.mark.ray
@pytest.mark.slow
def test_clef_rag_self_hosted_asks_about_a_state_of_more_than_20k_tokens(ray_url, monkeypatch):
    check_clef_rag(ray_url, monkeypatch)


@pytest.mark.ray
@pytest.mark.slow
def test_clef_evals_judges_a_choice_and_evaluates_a_set(ray_url, monkeypatch):
    check_clef_evals(set_workers_ai_env(monkeypatch, ray_url))


@pytest.mark.ray
@pytest.mark.slow
def test_clef_compactor_scores_64_chunks_in_one_request(ray_url, monkeypatch):
    check_clef_compactor(set_workers_ai_env(monkeypatch, ray_url))


@pytest.mark.ray
@pytest.mark.slow
def test_clef_router_routes_through_its_base_url(ray_url):
    check_clef_router(ray_url)


@pytest.mark.ray
@pytest.mark.slow
def test_other_sites_pages_are_refused_at_the_ingress_as_by_the_plain_server(ray_url):
    """The ingress is the plain server's app (run.settings_app): Host and Origin are held to the same rules through
    Ray's proxy, and its answers carry the same headers."""
    body = DEMO_REQUEST.read_bytes()
    attack = {"content-type": "text/plain", "origin": "http://attacker.example"}
    assert post(ray_url, "/v1/systemone", body, attack).json()["detail"]["error_type"] == "permission_error"
    assert httpx.get(f"{ray_url}/v1/models", headers={"Host": "attacker.example"}, timeout=TIMEOUT).status_code == 403
    own = post(ray_url, "/v1/systemone", body, {"origin": ray_url})
    assert own.status_code == 200 and own.headers["x-content-type-options"] == "nosniff", own.text
    assert own.headers["cache-control"] == "no-store"


# --- The same errors -------------------------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_the_ingress_counts_requests_and_answers_with_one_request_id(ray_url):
    """The ingress's own metrics (the plain server's series, but the replicas' state cache figures), and one
    X-Request-Id: the client's, or the one Ray's proxy made and handed the ingress, which it takes."""
    sent = "ray-client-id-1"
    answered = httpx.post(f"{ray_url}/v1/systemone", json=mixed_request(), headers={"X-Request-Id": sent}, timeout=TIMEOUT)
    assert answered.status_code == 200
    assert answered.headers.get_list("x-request-id") == [sent] and answered.headers["x-typesafe-request-id"] == sent
    health = httpx.get(f"{ray_url}/health", timeout=TIMEOUT)
    [ray_id] = health.headers.get_list("x-request-id")
    assert health.headers["x-typesafe-request-id"] == ray_id
    scraped = httpx.get(f"{ray_url}/metrics", timeout=TIMEOUT)
    assert scraped.status_code == 200
    samples = {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(scraped.text) for s in f.samples
    }
    assert samples[("clef_requests_total", frozenset({("route", "/v1/systemone"), ("status", "200")}))] >= 1
    model = ("model", health.json()["model"])  # the decided requests' series, by the model that decided them
    assert samples[("clef_decision_seconds_count", frozenset({("phase", "compute"), model}))] >= 1
    assert ("clef_state_cache_hits_total", frozenset({model})) in samples
    assert samples[("clef_batch_prompts_count", frozenset())] >= 1  # (the replicas' batches, by their decisions)
    assert (
        samples[("clef_batch_prompts_count", frozenset())]
        <= samples[("clef_decision_seconds_count", frozenset({("phase", "compute"), model}))]
    )
    assert not any(name.startswith("clef_state_cache_bytes") for name, _ in samples)  # in each replica, not here


def _bad_requests() -> dict[str, tuple[str, str, bytes, dict[str, str]]]:
    """name -> (method, path, body, headers) of requests the plain server refuses with a 4xx."""
    raw = json.dumps(mixed_request()).encode()
    cases = {
        f"malformed: {name}": ("POST", "/v1/systemone", body if isinstance(body, bytes) else json.dumps(body).encode(), {})
        for name, (body, _) in MALFORMED.items()
    }
    too_long = json.dumps(long_state_request(paragraphs=420)).encode()  # over the 65,536-token context: 413 from the intake
    cases |= {
        "prompt too long": ("POST", "/v1/systemone", too_long, {}),
        "prompt too long, Workers AI": ("POST", WORKERS_AI_PATHS[0], too_long, {}),
        "body too large": ("POST", "/v1/systemone", b" " * (1 << 20) + b" ", {}),
        "unknown encoding": ("POST", "/v1/systemone", raw, {"content-encoding": "br"}),
        "multipart": ("POST", "/v1/systemone", b"--x--", {"content-type": "multipart/form-data; boundary=x"}),
        "null level, Workers AI": ("POST", WORKERS_AI_PATHS[1], json.dumps(MALFORMED["score level null"][0]).encode(), {}),
        "unknown Workers AI model": ("POST", "/client/v4/accounts/a/ai/run/@cf/meta/llama-3.1-8b-instruct", raw, {}),
        "unknown route": ("GET", "/v1/nothing", b"", {}),
        "wrong method": ("GET", "/v1/systemone", b"", {}),
    }
    return cases


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("name", list(_bad_requests()))
def test_a_bad_request_gets_the_plain_servers_4xx(ray_url, plain_url, name):
    method, path, body, headers = _bad_requests()[name]
    ray, plain = (post(url, path, body, headers, method) for url in (ray_url, plain_url))
    assert 400 <= plain.status_code < 500
    same_response(ray, plain)


@pytest.mark.ray
@pytest.mark.slow
def test_the_min_body_rate_given_holds_at_the_ingress(ray_url):
    """ray_url's --body-grace 1 --min-body-rate 1000: a body stalled after 100 bytes gets the plain server's 408, at
    that rate (the ingress's limits were the defaults but for --body-timeout)."""
    with open_body(httpx.URL(ray_url).port, 5000, b"{" + b" " * 99) as sock:
        status, _, body = answer_of(sock, 20)
    assert status == 408 and b"under this server's minimum of 1000" in body, (status, body)


# --- A replica lost under load ---------------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_replica_loses_no_request_and_comes_back(ray_url, plain_url):
    # About 1,450 tokens, 120 ms a decision on the demo model: with 4 clients a replica holds two decisions
    # most of the time (one deciding, one waiting), but not always (the ingress encodes, the router balances on
    # queue lengths it probed a while ago): the kill waits until Ray counts two on a replica, so that it lands
    # mid-decision.
    body = json.dumps(long_state_request(paragraphs=6)).encode()
    want = post(plain_url, "/v1/systemone", body).content
    before = ray_cluster.replica_pids()["ClefReplica"]
    assert len(before) == 2
    attempts: list[tuple[int, str | None, bytes]] = []  # status, Retry-After, body of every attempt
    answered: list[bytes] = []
    lock = threading.Lock()
    # 100 requests: 40 before the kill, the rest while Ray counts the replica out and starts another.
    tickets = iter(range(100))
    killed = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=ray_url, timeout=TIMEOUT) as http:
            while next(tickets, None) is not None:  # next() on a shared iterator is atomic under the GIL
                for _ in range(60):  # what a client does with a 503 and Retry-After: wait, then try again
                    response = http.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
                    with lock:
                        attempts.append((response.status_code, response.headers.get("retry-after"), response.content))
                    if response.status_code != 503:
                        break
                    time.sleep(float(response.headers.get("retry-after", "1")))
                with lock:
                    answered.append(response.content)
                    if len(answered) == 40:
                        killed.set()

    threads = [threading.Thread(target=client) for _ in range(4)]
    for thread in threads:
        thread.start()
    assert killed.wait(TIMEOUT), "the load did not start"
    deadline = time.monotonic() + 60
    while not (busy := [pid for pid, held in ray_cluster.held_requests("ClefReplica").items() if held >= 2]):
        assert time.monotonic() < deadline, "no replica held two decisions under the load"
    victim = busy[0]
    assert victim in before
    os.kill(victim, signal.SIGKILL)  # the process deciding, mid-load: no chance to drain
    for thread in threads:
        thread.join(TIMEOUT)
    statuses = [status for status, _, _ in attempts]
    refused = [(retry_after, json.loads(content)) for status, retry_after, content in attempts if status == 503]
    # Every attempt either answered, or failed retryably: a 503 with Retry-After, in our JSON (never Ray's 500).
    assert set(statuses) <= {200, 503}, sorted(set(statuses))
    assert all(retry_after == "1" and problem["detail"]["error_type"] == "overloaded_error" for retry_after, problem in refused)
    # ... and after the client's retries, all 100 requests were answered, each as the plain server answers it.
    assert len(answered) == 100 and set(answered) == {want}
    # The decisions the replica held when it died are the 503s: at least the one still waiting when it died.
    assert refused, f"no request was lost with replica {victim}, killed holding two ({len(attempts)} attempts)"
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while True:  # Ray's controller replaces the dead replica
        after = ray_cluster.replica_pids().get("ClefReplica", [])
        if replica_states() == {"RUNNING": 2} and len(after) == 2 and victim not in after:
            break
        assert time.monotonic() < deadline, (replica_states(), after)
        time.sleep(0.2)
    assert post(ray_url, "/v1/systemone", body).content == want


# --- `serve run` with the documented config file ---------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_the_config_file_deploys_with_serve_run_key_and_autoscaling_included(ray_address, ray_url, tmp_path):
    """Last: it replaces the application the CLI deployed (same name, same route)."""
    config = yaml.safe_load((ROOT / "examples/ray-serve.yaml").read_text())
    [application] = config["applications"]
    assert application["import_path"] == "clef_gguf.server.ray_serve:app_builder"
    args = application["args"]
    args |= {"model": str(DEMO_MODEL), "scale": {"autoscale": "1:2", "gpus": 0}}
    args["load"] |= {"n_threads": 1, "n_gpu_layers": 0}
    args["serve"]["api_key"] = "s3cret"
    path = tmp_path / "ray-serve.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "ray.serve.scripts", "run", "--non-blocking", str(path)]
    run = subprocess.run(command, env={**os.environ, "RAY_ADDRESS": ray_address}, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    body = DEMO_REQUEST.read_bytes()
    with served(DEMO_MODEL, "--api-key", "s3cret") as (plain_url, _):  # (it starts while Ray deploys)
        deadline = time.monotonic() + DEPLOY_TIMEOUT_S
        # Until the keyed application has replaced the CLI's, ingress and replicas (now autoscaled) alike.
        while (
            post(ray_url, "/v1/systemone", body).status_code != 401
            or serve.status().applications[APP_NAME].status != ApplicationStatus.RUNNING
        ):
            assert time.monotonic() < deadline, serve.status().applications[APP_NAME]
            time.sleep(0.2)
        assert 1 <= replica_states().get("RUNNING", 0) <= 2
        for key in (None, "wrong", "s3cret"):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            for route in ("/v1/systemone", WORKERS_AI_PATHS[0]):
                same_response(post(ray_url, route, body, headers), post(plain_url, route, body, headers))
        assert httpx.get(f"{ray_url}/health").status_code == 200  # unauthenticated, for probes


# --- An idle `serve --ray` on a cluster of its own stops at once ------------------------------------------------------
# s from the signal to the exit. About 2 s on a quiet 2-core machine; 5.9 s was seen with the suite's other worker and
# four more processes on its two cores, so the bound tells a stop (seconds) from a wait on the dead cluster (60 s).
STOPPED_WITHIN = 3 * STOP_S


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("group", [False, True], ids=["to_the_process", "to_its_process_group"])
def test_an_idle_serve_ray_stops_at_sigterm_within_seconds_exit_128_plus_15(tmp_path, group):
    """A local cluster of its own (no RAY_ADDRESS; Ray's folder one of its own, RAY_TMPDIR). SIGTERM to the command:
    nothing to drain, the proxy and the cluster stopped (the monitor's own stop took a second of them). SIGTERM to its
    process group (`timeout`'s, a service manager's stop), which holds the cluster's processes: they stop with it, and
    the command no longer waits a minute for the stopped GCS to end with exit 1."""
    env, ray_tmp = ray_cluster.own_cluster_env()
    port = free_port()
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(DEMO_MODEL), "--ray", "--replicas", "1", "--port", str(port)]
    log = tmp_path / "serve.log"
    with open(log, "w") as output:
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}", DEPLOY_TIMEOUT_S)
        started = time.monotonic()
        if group:
            os.killpg(server.pid, signal.SIGTERM)
        else:
            server.send_signal(signal.SIGTERM)
        server.wait(timeout=TIMEOUT)
        took = time.monotonic() - started
    finally:
        sessions = ray_cluster.end_own_cluster(server, ray_tmp)
    text = log.read_text()
    assert server.returncode == 128 + signal.SIGTERM and took < STOPPED_WITHIN, (server.returncode, took, text[-3000:])
    [line] = [line for line in text.splitlines() if line.startswith("stopped by")]
    assert line.startswith("stopped by SIGTERM; ") and ("nothing was left to drain" in line) == group, line
    assert "Traceback" not in text and not sessions, (sessions, text[-3000:])


# --- The command's own refusals (no cluster needed) -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "2"], "--replicas and --autoscale need --ray"),
        (["--ray", "--replicas", "2", "--autoscale", "1:2"], "exclude each other"),
        (["--ray", "--autoscale", "3:1"], "1 <= MIN <= MAX"),
        (["--ray", "--autoscale", "two"], "MIN:MAX"),
    ],
)
def test_serve_refuses_ray_options_that_cannot_work(args, message):
    run = run_cli("serve", DEMO_MODEL, "--port", str(free_port()), *args, env={"RAY_ADDRESS": ""})  # in this process
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_serve_on_ray_refuses_a_file_that_is_not_a_clef_model(tmp_path):
    bad = tmp_path / "random.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ModelFileError) as refused:  # what loading (validate) says of the file
        clef_gguf.load(bad)
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(bad), "--ray", "--port", str(free_port())]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": ""})
    # validate's verdict and exit code, before any Ray process starts
    assert run.returncode == refused.value.exit_code and str(refused.value) in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and "Ray" not in run.stderr


def test_a_config_files_args_are_checked_and_the_key_can_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("CLEF_GGUF_API_KEY", raising=False)
    args = {"model": str(DEMO_MODEL), "scale": {"autoscale": "1:4", "gpus": 0.5}, "load": {"n_threads": 2}}
    settings = settings_from_args(args | {"serve": {"limits": {"min_body_rate": 1000}}})
    assert (settings.scale, settings.load.n_threads, settings.serve.api_key) == (RayScale(autoscale="1:4", gpus=0.5), 2, None)
    assert settings.serve.limits == HttpLimits(min_body_rate=1000)
    monkeypatch.setenv("CLEF_GGUF_API_KEY", "from-env")
    assert settings_from_args({"model": "m.gguf"}).serve.api_key == "from-env"
    assert settings_from_args({"model": "m.gguf", "serve": {"api_key": "given"}}).serve.api_key == "given"
    names = {"allowed_hosts": ["clef.example.com"], "allowed_origins": ["https://app.example.com"]}
    served = settings_from_args({"model": "m.gguf", "serve": names}).serve  # (a YAML list: the table's tuple)
    assert (served.allowed_hosts, served.allowed_origins) == (("clef.example.com",), ("https://app.example.com",))
    for bad, why in [
        ({"model": "m.gguf", "scale": {"replica": 2}}, "scale.replica: Unexpected keyword argument"),  # a typo is refused
        # a setting outside its table (the flat args before 0.2.0) is refused, saying where it lives now
        ({"model": "m.gguf", "replicas": 2}, r"replicas: not a setting here; it is scale\.replicas"),
        ({"model": "m.gguf", "serve": {"min_body_rate": 1}}, r"serve\.min_body_rate: .* it is serve\.limits\.min_body_rate"),
        ({"model": "m.gguf", "host": "0.0.0.0"}, r"host: not a setting here; it is http_options\.host"),
        ({"model": "m.gguf", "scale": {"autoscale": "4:1"}}, "1 <= MIN <= MAX"),
        ({"model": "m.gguf", "serve": {"api_key": "has space"}}, "visible ASCII"),
        ({"model": "m.gguf", "load": {"n_threads": 0}}, "load.n_threads must be between 1 and 512, not 0"),
        ({"model": "m.gguf", "serve": {"limits": {"min_body_rate": -1}}}, "serve.limits.min_body_rate must be >= 0, not -1"),
        ({"model": "m.gguf", "serve": {"port": 9000}}, "set http_options.port instead"),
        ({"model": "m.gguf", "serve": {"allowed_origins": ["app.example.com"]}}, "is not an origin"),
    ]:
        with pytest.raises(SettingsError, match=why):
            settings_from_args(bad)
    monkeypatch.setenv("CLEF_GGUF_API_KEY", "")
    with pytest.raises(SettingsError, match="empty"):
        settings_from_args({"model": "m.gguf"})


def test_the_ingress_and_the_replicas_are_bound_with_the_settings_tables_as_they_are(monkeypatch):
    """Every HTTP limit reaches the ingress (its app is create_app's with them), the model's spec (its load options)
    each replica and the ingress's encoder; the Hub's address and token of the building process the ingress alone
    (server/ray_relay.py), the token in no repr."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_TOKEN", "hf_bound_token")
    limits = HttpLimits(body_timeout=7, min_body_rate=1000, body_grace=1, max_body_buffer=1 << 21, max_body_readers=3)
    served_with = ServeSettings(api_key="k", max_queue=5, limits=limits, log_format="json", metrics_adapter_cap=3)
    options = LoadOptions(max_prompt_tokens=4096, parallel=2, state_cache=0)
    settings = RaySettings(str(DEMO_MODEL), served_with, options, scale=RayScale(replicas=3))
    ingress = build_app(settings)._bound_deployment
    replicas = ingress.init_args[0]._bound_deployment
    threaded = LoadOptions(max_prompt_tokens=4096, parallel=2, state_cache=0, n_threads=1)  # 1 thread a replica by default
    spec = ModelSpec(str(DEMO_MODEL), threaded)
    assert ingress.init_args[1:3] == (spec, served_with)
    hub = ingress.init_args[3]
    assert hub.values == {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_bound_token"} and "hf_bound" not in repr(hub)
    assert (replicas.init_args, replicas.init_kwargs, replicas.num_replicas) == ((spec,), {"queue": 5, "adapter_cap": 3}, 3)


# --- Readiness (last: its failed deployment deletes the application) -----------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_a_replica_that_cannot_answer_never_serves_and_the_command_says_why(ray_address):
    # A context too small for the probe decision: the model loads, but cannot answer one, so its replica never
    # reports healthy; Ray gives up (after one try on the test cluster: testing/ray_cluster.py) and the command exits
    # with the replica's own error.
    command = [
        sys.executable,
        "-m",
        "clef_gguf.cli",
        "serve",
        str(DEMO_MODEL),
        "--ray",
        "--ctx",
        "16",
        "--port",
        str(free_port()),
    ]
    run = subprocess.run(command, env={**os.environ, "RAY_ADDRESS": ray_address}, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 1, run.stderr[-2000:]
    [line] = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert "ClefReplica: " in line and "PromptTooLongError" in line and "limit of 16 tokens" in line, line
    assert "serving" not in run.stderr

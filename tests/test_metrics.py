"""GET /metrics counts exactly what was sent; each request's id is in its answer and in its one access log line."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from live_server import served
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import BlockingModel, start

import clef_gguf
from clef_gguf.runtime.state_cache import split_at_prefix
from clef_gguf.server import create_app
from clef_gguf.server.observe import ACCESS_LOGGER
from clef_gguf.testing.request_suite import long_state_request

TIMEOUT = httpx.Timeout(120.0)
SHORT = {"state": "s", "questions": {"q": {"type": "noul"}}}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def model(ws):
    return ws.model("untied_f32", "f32")


class GatedModel(BlockingModel):
    """server_helpers' BlockingModel, open until a test shuts it (to hold the queue full for one 503), with the
    state cache the app reads its gauges from."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.state_cache = model.state_cache
        self.release.set()


def scrape(client: httpx.Client, **headers: str) -> Samples:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def value(samples: Samples, series: str, **labels: str) -> float:
    return samples.get((series, frozenset(labels.items())), 0.0)


def test_metrics_count_exactly_the_requests_sent_and_the_state_cache_hits(model):
    gated = GatedModel(model)
    state = f"A state test_metrics alone sends ({uuid.uuid4().hex}). " + long_state_request(paragraphs=2)["state"]
    cached = {**long_state_request(), "state": state}
    prompt = model.encode(cached)
    assert split_at_prefix(prompt.state_prefix, len(prompt.tokens)) and prompt.state_prefix > prompt.preamble
    live = start(create_app(gated, owns_model=False, max_queue=1))
    answered: list[httpx.Response] = []
    health_polls = 0
    try:
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
            answered += [c.post("/v1/systemone", json=cached), c.post("/v1/systemone", json=cached)]  # a miss, then a hit
            answered.append(c.post("/v1/systemone", json=SHORT))  # a state too short to cache: neither
            assert c.post("/v1/systemone", content=b"{", headers={"content-type": "application/json"}).status_code == 422
            assert c.post("/v1/systemone", json=long_state_request(paragraphs=50)).status_code == 413
            assert c.get("/v1/systemone").status_code == 405
            assert c.get(f"/v1/nothing/{uuid.uuid4().hex}").status_code == 404
            gated.release.clear()
            held: list[httpx.Response] = []
            sender = threading.Thread(
                target=lambda: held.append(httpx.post(f"{live.url}/v1/systemone", json=SHORT, timeout=TIMEOUT))
            )
            sender.start()
            deadline = time.monotonic() + 30
            while True:
                health_polls += 1
                if c.get("/health").json()["pending"] == 1:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert c.post("/v1/systemone", json=SHORT).status_code == 503
            gated.release.set()
            sender.join(60)
            answered += held
            assert [r.status_code for r in answered] == [200] * 4
            samples = scrape(c)
    finally:
        gated.release.set()
        live.stop()

    def requests(route: str, status: int) -> float:
        return value(samples, "clef_requests_total", route=route, status=str(status))

    systemone = {200: 4, 422: 1, 413: 1, 405: 1, 503: 1}
    assert {s: requests("/v1/systemone", s) for s in systemone} == systemone
    assert requests("unmatched", 404) == 1 and requests("/health", 200) == health_polls
    assert value(samples, "clef_request_duration_seconds_count", route="/v1/systemone") == sum(systemone.values())
    assert value(samples, "clef_requests_refused_total") == 1
    usages = [r.json()["usage"] for r in answered]
    base = {"model": model.name}  # the decided requests' series, by model
    assert value(samples, "clef_prompt_tokens_total", **base) == sum(u["input_tokens"] for u in usages)
    assert value(samples, "clef_cached_tokens_total", **base) == sum(u["input_tokens_details"]["cached_tokens"] for u in usages)
    assert usages[1]["input_tokens_details"]["cached_tokens"] == prompt.state_prefix  # the hit, as the answer says
    assert value(samples, "clef_state_cache_hits_total", **base) == 1
    assert value(samples, "clef_state_cache_misses_total", **base) == 1
    assert value(samples, "clef_images_total", **base) == 0
    for phase in ("queue", "compute"):
        assert value(samples, "clef_decision_seconds_count", phase=phase, **base) == 4
    assert value(samples, "clef_decision_seconds_sum", phase="compute", **base) > 0
    assert value(samples, "clef_requests_in_flight") == 1  # the scrape itself
    assert value(samples, "clef_decisions_queued") == 0 and value(samples, "clef_bodies_reading") == 0
    assert value(samples, "clef_state_cache_entries") == len(model.state_cache) > 0
    assert value(samples, "clef_state_cache_bytes") == model.state_cache.nbytes > 0
    assert value(samples, "clef_state_cache_budget_bytes") == model.state_cache.budget
    info = {"name": model.name, "type": "text", "context": str(model.max_prompt_tokens), "ubatch": str(model.ubatch)}
    assert value(samples, "clef_model_info", **info) == 1


def test_the_decided_series_carry_the_model_that_decided(ws, tmp_path):
    """Served with an adapter, each decided request is counted under its model's name: the base's or the adapter's
    (as the answer's `model` says), by System One's `model` and Workers AI's `lora` alike."""
    from peft_adapters import peft_adapter

    adapter = peft_adapter(ws.release("untied_f32"), tmp_path, "tuned")
    model = clef_gguf.load(ws.gguf("untied_f32", "f32"), max_prompt_tokens=4096, adapters={"tuned": adapter})
    live = start(create_app(model, max_queue=4))
    try:
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
            base = c.post("/v1/systemone", json=SHORT).json()
            tuned = [c.post("/v1/systemone", json={**SHORT, "model": "tuned"}).json()]
            run = c.post("/accounts/a/ai/run/@cf/cloudflare/clef-flash", json={**SHORT, "lora": "tuned"}).json()
            tuned.append(run["result"])
            assert c.post("/v1/systemone", json={**SHORT, "model": "nope"}).status_code == 422  # not decided: not counted
            samples = scrape(c)
    finally:
        live.stop()
    assert base["model"] == model.name and [t["model"] for t in tuned] == ["tuned", "tuned"]
    for name, answers in ((model.name, [base]), ("tuned", tuned)):
        tokens = sum(a["usage"]["input_tokens"] for a in answers)
        assert value(samples, "clef_prompt_tokens_total", model=name) == tokens > 0, name
        assert value(samples, "clef_decision_seconds_count", phase="compute", model=name) == len(answers), name
        assert ("clef_images_total", frozenset({("model", name)})) in samples
        assert value(samples, "clef_images_total", model=name) == 0
    assert value(samples, "clef_requests_total", route="/v1/systemone", status="200") == 2


class EnteredModel(GatedModel):
    """Tells when a batch is being decided (`entered`), before it waits for the release."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.entered = threading.Event()

    def answer_batch(self, prompts: list[Any]) -> list[Any]:
        self.entered.set()
        return super().answer_batch(prompts)


def test_each_batch_is_counted_once_by_its_prompts(model):
    """clef_batch_prompts: one observation per batch, of the prompts decided together. The first request is decided
    alone while three more wait behind it (held by the gated model); the three are then decided in one batch."""
    gated = EnteredModel(model)
    live = start(create_app(gated, owns_model=False, max_queue=8))
    try:
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
            gated.release.clear()
            answered: list[httpx.Response] = []
            senders = [threading.Thread(target=lambda: answered.append(c.post("/v1/systemone", json=SHORT))) for _ in range(4)]
            senders[0].start()
            assert gated.entered.wait(60)  # the first is being decided, alone: the others wait for the next batch
            for sender in senders[1:]:
                sender.start()
            deadline = time.monotonic() + 60
            while c.get("/health").json()["pending"] < 4:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            gated.release.set()
            for sender in senders:
                sender.join(60)
            assert [r.status_code for r in answered] == [200] * 4
            timings = sorted(r.headers["server-timing"].split('desc="batch of ')[1][0] for r in answered)
            samples = scrape(c)
    finally:
        gated.release.set()
        live.stop()
    assert timings == ["1", "3", "3", "3"]
    assert value(samples, "clef_batch_prompts_count") == 2 and value(samples, "clef_batch_prompts_sum") == 4
    buckets = {le: value(samples, "clef_batch_prompts_bucket", le=le) for le in ("1.0", "2.0", "4.0", "64.0", "+Inf")}
    assert buckets == {"1.0": 1, "2.0": 1, "4.0": 2, "64.0": 2, "+Inf": 2}


def test_two_apps_in_one_process_keep_their_own_counts(model):
    first, second = (start(create_app(model, owns_model=False)) for _ in range(2))
    try:
        with httpx.Client(base_url=first.url, timeout=TIMEOUT) as a, httpx.Client(base_url=second.url, timeout=TIMEOUT) as b:
            a.get("/health")
            assert value(scrape(a), "clef_requests_total", route="/health", status="200") == 1
            assert value(scrape(b), "clef_requests_total", route="/health", status="200") == 0
    finally:
        first.stop()
        second.stop()


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def access_lines() -> Iterator[list[str]]:
    """The access log's lines, whatever configured the logger before (serve's own handler in this process)."""
    logger, handler = logging.getLogger(ACCESS_LOGGER), Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class BrokenModel(GatedModel):
    def encode(self, request: dict[str, Any]) -> Any:
        raise RuntimeError("a bug")


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_request_id_is_in_the_answer_and_in_its_one_access_line(model, log_format):
    live = start(create_app(model, owns_model=False, log_format=log_format))
    broken = start(create_app(BrokenModel(model), owns_model=False, log_format=log_format))
    sent = {"ok": "client-id-1", "bad": "client-id-2", "broken": "client-id-3"}
    try:
        with access_lines() as lines, httpx.Client(timeout=TIMEOUT) as c:
            ok = c.post(f"{live.url}/v1/systemone", json=SHORT, headers={"X-Request-Id": sent["ok"]})
            bad_headers = {"X-Request-Id": sent["bad"], "content-type": "application/json"}
            bad = c.post(f"{live.url}/v1/systemone", content=b"{", headers=bad_headers)
            broken_answer = c.post(f"{broken.url}/v1/systemone", json=SHORT, headers={"X-Request-Id": sent["broken"]})
            unfit = [c.get(f"{live.url}/health", headers={"X-Request-Id": rid}) for rid in ("has space", "x" * 129, b"caf\xe9")]
            fresh = c.get(f"{live.url}/nowhere")
            assert (ok.status_code, bad.status_code, broken_answer.status_code, fresh.status_code) == (200, 422, 500, 404)
            for response, rid in ((ok, sent["ok"]), (bad, sent["bad"]), (broken_answer, sent["broken"])):
                assert response.headers["x-request-id"] == response.headers["x-typesafe-request-id"] == rid
            ids = [r.headers["x-request-id"] for r in [*unfit, fresh]]
            assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids) and len(set(ids)) == 4  # new ids, not the client's
            deadline = time.monotonic() + 10
            while len(lines) < 7:  # (the line is written once the answer is sent)
                assert time.monotonic() < deadline, lines
                time.sleep(0.01)
    finally:
        live.stop()
        broken.stop()
    assert len(lines) == 7, lines
    if log_format == "json":
        records = [json.loads(line) for line in lines]
    else:
        records = [dict(field.split("=", 1) for field in line.split(" ")) for line in lines]
    by_id = {r["id"]: r for r in records}
    assert set(by_id) == {*sent.values(), *ids}
    tokens = len(model.encode(SHORT).tokens)
    got = by_id[sent["ok"]]
    if log_format == "json":
        assert {k: got[k] for k in ("route", "status", "tokens", "method")} == {
            "route": "/v1/systemone",
            "status": 200,
            "tokens": tokens,
            "method": "POST",
        }
        assert isinstance(got["cached_tokens"], int) and got["ms"] > 0
        assert by_id[sent["bad"]]["status"] == 422 and by_id[sent["bad"]]["tokens"] is None
        assert by_id[sent["broken"]]["status"] == 500 and by_id[ids[-1]]["route"] == "unmatched"
    else:
        assert (got["route"], got["status"], got["tokens"], got["method"]) == ("/v1/systemone", "200", str(tokens), "POST")
        assert got["cached_tokens"].isdigit() and float(got["ms"]) > 0
        assert by_id[sent["bad"]]["status"] == "422" and by_id[sent["bad"]]["tokens"] == "-"
        assert by_id[sent["broken"]]["status"] == "500" and by_id[ids[-1]]["route"] == "unmatched"


@pytest.mark.slow
def test_serve_logs_one_json_line_per_request_and_guards_metrics_with_the_key(ws):
    with served(ws.gguf("untied_f32", "f32"), "--log-format", "json", "--api-key", "k3y") as (url, process):
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
            refused = c.get("/metrics")
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            key = {"Authorization": "Bearer k3y"}
            ok = c.post("/v1/systemone", json=SHORT, headers={**key, "X-Request-Id": "from-the-client"})
            assert ok.status_code == 200 and ok.headers["x-request-id"] == "from-the-client"
            samples = scrape(c, **key)
            assert value(samples, "clef_requests_total", route="/v1/systemone", status="200") == 1
            assert value(samples, "clef_requests_total", route="/metrics", status="401") == 1
            # The served ClefModel's own cache: its template preamble at least, stored by the load's probe.
            assert value(samples, "clef_state_cache_entries") >= 1
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    # wait_healthy's polls, then the three requests above: one line each, and no uvicorn access line.
    assert [(r["route"], r["status"]) for r in lines if r["route"] != "/health"] == [
        ("/metrics", 401),
        ("/v1/systemone", 200),
        ("/metrics", 200),
    ]
    assert [r for r in lines if r["route"] == "/v1/systemone"][0]["id"] == "from-the-client"
    assert 'HTTP/1.1"' not in stderr

"""Every released Clef client, unchanged, against `clef-gguf serve` at its defaults on loopback.

Each client is driven through its own public API and configured as its documentation says
(environment variables, or `base_url=` where that is the only way). What it parses is held to
what the server's /v1/systemone answers for the very body the client sends (rebuilt with the
client's own public payload builders), so the Workers AI route is also checked to give the same
answers as the System One route. The clients run against the small demo model; the checks
against Cloudflare's reference (the oracle) use the f32 fixture, at the same defaults.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from cli_helpers import run_cli
from live_server import rss_bytes, served
from server_helpers import (
    CLIENT_TIMEOUT_S,
    check_clef_compactor,
    check_clef_evals,
    check_clef_rag,
    check_clef_router,
    check_typesafe_sdk,
    set_workers_ai_env,
    systemone,
)

from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST
from clef_gguf.settings import DEFAULT_UBATCH, LoadOptions
from clef_gguf.testing.request_suite import long_state_request, wide_choice_request

pytestmark = pytest.mark.device  # in the device set (tests/conftest.py)



@pytest.fixture(scope="module")
def demo() -> Iterator[str]:
    with served(DEMO_MODEL) as (url, _):
        yield url


@pytest.fixture
def workers_ai_env(demo: str, monkeypatch: pytest.MonkeyPatch) -> str:
    return set_workers_ai_env(monkeypatch, demo)


# The checks themselves are in server_helpers.py: test_ray_serve.py runs them against the Ray endpoint.
@pytest.mark.slow
def test_typesafe_sdk_parses_every_answer_type_and_gets_422_for_a_null_level(demo):
    check_typesafe_sdk(demo)


@pytest.mark.slow
def test_clef_rag_self_hosted_asks_about_a_state_of_more_than_20k_tokens(demo, monkeypatch):
    check_clef_rag(demo, monkeypatch)


def test_clef_evals_judges_a_choice_and_evaluates_a_set(workers_ai_env):
    check_clef_evals(workers_ai_env)


@pytest.mark.slow
def test_clef_compactor_scores_64_chunks_in_one_request(workers_ai_env):
    check_clef_compactor(workers_ai_env)


def test_clef_router_routes_through_its_base_url(demo):
    check_clef_router(demo)


def test_other_sites_pages_cannot_use_serve_at_its_defaults(demo):
    """What a page on another site can make its visitor's browser do to a server on loopback (no --api-key): a
    cross-origin text/plain POST (no preflight), a request under a rebound name. Both refused; the clients above,
    httpx and the page (its own Origin) are answered."""
    body = DEMO_REQUEST.read_bytes()
    attack = {"Content-Type": "text/plain", "Origin": "http://attacker.example"}
    assert httpx.post(f"{demo}/v1/systemone", content=body, headers=attack, timeout=CLIENT_TIMEOUT_S).status_code == 403
    for path in ("/v1/models", "/health", "/"):
        assert httpx.get(demo + path, headers={"Host": "attacker.example"}, timeout=CLIENT_TIMEOUT_S).status_code == 403
    for own in ({}, {"Origin": demo}):
        sent = {"Content-Type": "application/json", **own}
        answer = httpx.post(f"{demo}/v1/systemone", content=body, headers=sent, timeout=CLIENT_TIMEOUT_S)
        assert answer.status_code == 200 and answer.headers["x-content-type-options"] == "nosniff", answer.text


# --- The defaults: Clef's context, prefilled in ubatches, against the oracle ----------------------------------
@pytest.fixture(scope="module")
def fixture_server(ws) -> Iterator[tuple[str, int]]:
    with served(ws.gguf("untied_f32", "f32")) as (url, process):
        yield url, process.pid


def _largest_difference(answer: dict[str, Any], oracle: dict[str, dict[str, float]]) -> float:
    differences = []
    for qid, probabilities in oracle.items():
        got = answer["answers"][qid]
        served_p = {"true": got["noul"], "false": 1 - got["noul"]} if got["type"] == "noul" else got["probabilities"]
        differences += [abs(served_p[option] - p) for option, p in probabilities.items()]
    return max(differences)


def test_the_defaults_are_clef_context_in_ubatches(fixture_server):
    url, _ = fixture_server
    health = httpx.get(f"{url}/health").json()
    assert (
        health["max_prompt_tokens"] == LoadOptions.max_prompt_tokens == 65536 and LoadOptions.max_prompt_tokens > DEFAULT_UBATCH
    )


@pytest.mark.slow
def test_a_255_option_choice_gets_the_oracle_answer_at_the_defaults(fixture_server, oracle_probabilities):
    url, _ = fixture_server
    answer = systemone(url, wide_choice_request(255))
    assert _largest_difference(answer, oracle_probabilities("untied_f32", "wide_choice")) <= 0.005


@pytest.mark.slow
def test_a_30000_token_request_prefilled_in_ubatches_equals_the_oracle(fixture_server, ws):
    url, pid = fixture_server
    request = long_state_request(paragraphs=157)  # about 30,300 tokens
    before = rss_bytes(pid)
    answer = systemone(url, request)
    tokens = answer["usage"]["input_tokens"]
    assert tokens >= 30_000 and tokens > 16 * DEFAULT_UBATCH  # many ubatches, the state carried across each
    oracle = ws.oracle("untied_f32")
    assert tokens == len(oracle.input_ids(request))
    assert _largest_difference(answer, oracle.probabilities(request)) <= 0.005
    # Host buffers that grow with the prompt: the embedding batch and llama.cpp's output (tokens x n_embd floats each).
    assert rss_bytes(pid) - before < 256 << 20


def test_a_prompt_over_the_context_gets_413_before_any_compute(fixture_server):
    url, _ = fixture_server
    response = httpx.post(f"{url}/v1/systemone", json=long_state_request(paragraphs=420), timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 413, response.text
    detail = response.json()["detail"]
    assert detail["error_type"] == "prompt_too_long" and f"limit of {LoadOptions.max_prompt_tokens} tokens" in detail["message"]


def _probabilities(answer: dict[str, Any]) -> list[float]:
    values = []
    for got in answer["answers"].values():
        values += [got["noul"]] if got["type"] == "noul" else list(got["probabilities"].values())
    return values


@pytest.mark.slow
def test_serve_ubatch_sets_the_physical_batch_and_keeps_the_answers(demo):
    request = long_state_request()  # about 3,000 tokens: more than 20 ubatches of 128
    default = systemone(demo, request)
    assert httpx.get(f"{demo}/health").json()["ubatch"] == DEFAULT_UBATCH
    with served(DEMO_MODEL, "--ctx", "4096", "--ubatch", "128") as (url, _):
        health = httpx.get(f"{url}/health").json()
        assert (health["max_prompt_tokens"], health["ubatch"]) == (4096, 128)
        small = systemone(url, request)
    assert small["usage"] == default["usage"] and default["usage"]["input_tokens"] > 20 * 128
    # Another ubatch size changes ggml's summation order: float noise, far below the oracle tolerance.
    assert max(abs(a - b) for a, b in zip(_probabilities(small), _probabilities(default), strict=True)) <= 1e-3


def test_serve_refuses_a_ubatch_larger_than_the_context():
    run = run_cli("serve", DEMO_MODEL, "--ctx", "512", "--ubatch", "1024", timeout=120)  # in this process
    assert run.returncode == 2 and "--ubatch (1024) cannot exceed" in run.stderr and "Uvicorn running" not in run.stderr

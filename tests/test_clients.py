"""Every released Clef client, unchanged, against `clef-gguf serve` at its defaults on loopback.

Each client is driven through its own public API and configured as its documentation says
(environment variables, or `base_url=` where that is the only way). What it parses is held to
what the server's /v1/systemone answers for the very body the client sends (rebuilt with the
client's own public payload builders), so the Workers AI route is also checked to give the same
answers as the System One route. The clients run against the small demo model; the checks
against Cloudflare's reference (the oracle) use the f32 fixture, at the same defaults.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import pytest
import typesafe_sdk as ts
from live_server import rss_bytes, served

from clef_gguf.data import DEMO_MODEL
from clef_gguf.settings import DEFAULT_UBATCH, LoadOptions
from clef_gguf.testing.request_suite import long_state_request, long_state_text, wide_choice_request

pytestmark = pytest.mark.device  # in the device set (tests/conftest.py)

ACCOUNT_ID = "0123456789abcdef0123456789abcdef"
API_TOKEN = "local-token"  # the server has no --api-key: any Bearer token is accepted, as the clients always send one
TIMEOUT = 300.0
Request = dict[str, Any]


@pytest.fixture(scope="module")
def demo() -> Iterator[str]:
    with served(DEMO_MODEL) as (url, _):
        yield url


def systemone(url: str, body: Request) -> dict[str, Any]:
    """What /v1/systemone answers for a body: each client must report exactly this."""
    response = httpx.post(f"{url}/v1/systemone", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture
def workers_ai_env(demo: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The environment clef-evals and clef-compactor document, pointed at the local server."""
    monkeypatch.setenv("CLEF_BASE_URL", f"{demo}/client/v4")
    monkeypatch.setenv("CLEF_ACCOUNT_ID", ACCOUNT_ID)
    monkeypatch.setenv("CLEF_API_TOKEN", API_TOKEN)
    # Their documented timeout (30 or 60 s by default), as long as this module gives the other clients: on a software
    # device (the device set on lavapipe) clef-compactor's 64-chunk request took 181 s and timed out at 60.
    monkeypatch.setenv("CLEF_TIMEOUT", str(TIMEOUT))
    return demo


# --- typesafe-sdk: System One ---------------------------------------------------------------------------------
def test_typesafe_sdk_parses_every_answer_type_and_gets_422_for_a_null_level(demo):
    sent: list[httpx2.Request] = []
    http = httpx2.Client(timeout=TIMEOUT, event_hooks={"request": [sent.append]})
    questions = {
        "spam": ts.Noul(instructions="Is this spam?", criteria={"true": "Unsolicited"}),
        "tone": ts.Choice(instructions="What is the tone?", criteria={"calm": None, "angry": "upset", "🙂": ["happy"]}),
        "urgency": ts.Score(instructions="How urgent?", criteria=["low", "medium", {"level": "high"}]),
    }
    with ts.TypeSafeClient(base_url=demo, api_key="local", http_client=http, compression=False) as sdk:
        got = sdk.system_one(state={"message": "I was charged twice for the café order."}, questions=questions)
        want = systemone(demo, ts_body(sent[0]))
        answers = want["answers"]
        assert got.nouls["spam"].noul == answers["spam"]["noul"]
        assert got.choices["tone"].choice == answers["tone"]["choice"]
        assert got.choices["tone"].probabilities == answers["tone"]["probabilities"]
        score = got.scores["urgency"]
        assert score.score == answers["urgency"]["score"] and score.confidence == answers["urgency"]["confidence"]
        assert score.legend == {0: "low", 1: "medium", 2: {"level": "high"}}
        assert got.usage.input_tokens == want["usage"]["input_tokens"]
        # A null level, which the SDK's own models do not allow, sent as a raw question: refused up front,
        # naming the level, instead of an answer whose null legend the SDK could not parse.
        with pytest.raises(ts.TypeSafeUnprocessableEntityError, match=r"questions\.anger\.criteria\.1"):
            sdk.system_one(state="Calm down!", questions={"anger": {"type": "score", "criteria": ["calm", None, "furious"]}})


def ts_body(request: httpx2.Request) -> Request:
    return json.loads(request.content)


# --- clef-rag: System One, self-hosted backend ----------------------------------------------------------------
def test_clef_rag_self_hosted_asks_about_a_state_of_more_than_20k_tokens(demo, monkeypatch):
    from clef_rag.clef import Choice, ClefClient, ClefConfig, Noul, Score

    monkeypatch.setenv("CLEF_BASE_URL", demo)  # clef-rag's self-hosted backend: {CLEF_BASE_URL}/v1/systemone
    questions = {
        "refund": Noul("Does the customer ask for a refund?"),
        "language": Choice("Main language of the state.", {"en": "English", "fr": "French", "zh": "Chinese"}),
        "anger": Score("How angry?", ["calm", "annoyed", "furious"]),
    }
    state = long_state_text(paragraphs=108)  # about 20,600 tokens with the demo tokenizer
    config = ClefConfig(backend="self-hosted", cache_dir=None)  # no answer cache: every ask reaches the server

    async def ask() -> tuple[Any, Request]:
        async with ClefClient(config) as clef:
            return await clef.ask(state, questions), clef.build_payload(state, questions)

    response, payload = asyncio.run(ask())
    want = systemone(demo, payload)
    assert response.input_tokens == want["usage"]["input_tokens"] > 20_000
    assert response.answers["refund"].noul == want["answers"]["refund"]["noul"]
    assert response.answers["language"].probabilities == want["answers"]["language"]["probabilities"]
    assert response.answers["anger"].score == want["answers"]["anger"]["score"]


# --- clef-evals, clef-compactor, clef-router: Workers AI's REST shape -----------------------------------------
def test_clef_evals_judges_a_choice_and_evaluates_a_set(workers_ai_env):
    from clef_evals import Choice, ClefJudge, Noul
    from clef_evals.models import build_payload

    criteria = {"billing": "Payments and refunds.", "technical": "Bugs and outages.", "sales": "Pricing."}
    state = "My card was charged twice for one order."
    with ClefJudge() as judge:
        question = "Which team should handle this?"
        decision = judge.judge_choice(state, question, criteria)
        want = systemone(workers_ai_env, build_payload("clef", state, {"decision": Choice(question, criteria)}))
        assert decision.choice == want["answers"]["decision"]["choice"]
        assert decision.probabilities == want["answers"]["decision"]["probabilities"]
        assert decision.usage.input_tokens == want["usage"]["input_tokens"]

        eval_set = [
            {"state": state, "instructions": question, "criteria": criteria, "gold": "billing"},
            {"state": "The site is down.", "instructions": question, "choices": ["billing", "technical"], "gold": "technical"},
            {"state": "Free pizza!", "instructions": "Is this spam?", "gold": True},
            {"state": "Your invoice is attached.", "instructions": "Is this spam?", "gold": False},
        ]
        result = judge.evaluate(eval_set)
    assert result.failures == 0 and result.n_samples == len(eval_set)
    expected = []
    for item in eval_set:
        if isinstance(item["gold"], bool):
            body = build_payload("clef", item["state"], {"is_true": Noul(item["instructions"])})
            expected.append((systemone(workers_ai_env, body)["answers"]["is_true"]["noul"] >= 0.5) == item["gold"])
        else:
            options = item.get("criteria") or {c: "" for c in item["choices"]}
            body = build_payload("clef", item["state"], {"decision": Choice(item["instructions"], options)})
            expected.append(systemone(workers_ai_env, body)["answers"]["decision"]["choice"] == item["gold"])
    assert result.correct == expected


def test_clef_compactor_scores_64_chunks_in_one_request(workers_ai_env):
    from clef_compactor import ClefCompactor
    from clef_compactor.core import build_questions, build_state

    query = "Why was the customer charged twice?"
    topics = ("a duplicate card charge", "the shipping delay", "a password reset", "the refund policy")
    # Short chunks: the 64 questions alone (the compactor's fixed instructions) are about 15,000 tokens.
    chunks = [f"Document {i} is about {topics[i % 4]}, with the details." for i in range(64)]
    # encoding_model names no tiktoken encoding, so the compactor counts whitespace tokens: tiktoken would
    # otherwise download cl100k_base, and CI has no network. Token accounting is not what is tested here.
    with ClefCompactor(model="clef-flash", encoding_model="offline", chunk_preview_chars=512) as compactor:
        result = compactor.compact(query, chunks, token_budget=400)
    body = {"model": "clef-flash", "state": build_state(query, chunks, 512), "questions": build_questions(64)}
    want = systemone(workers_ai_env, body)
    assert [chunk.score for chunk in result.scores] == [want["answers"][f"chunk_{i + 1}"]["noul"] for i in range(64)]
    assert result.usage is not None and result.usage.input_tokens == want["usage"]["input_tokens"] > 4096
    assert len(result.kept) + len(result.dropped) == 64


def test_clef_router_routes_through_its_base_url(demo):
    from clef_router import ClefRouter
    from clef_router.models import DEFAULT_QUESTIONS, derive_tier
    from clef_router.transport import build_chat_state

    prompt = "Our payment API returns 500 for every request since the last deploy. What do we check first?"
    system = "Route anything about outages to the frontier team."
    with ClefRouter(account_id=ACCOUNT_ID, api_token=API_TOKEN, base_url=f"{demo}/client/v4") as router:
        routing = router.route(prompt, system_prompt=system)
    want = systemone(demo, {"model": "clef-flash", "state": build_chat_state(system, prompt), "questions": DEFAULT_QUESTIONS})
    team, urgency = want["answers"]["team"], want["answers"]["urgency"]
    assert routing.decision.answers["team"].choice == team["choice"]
    assert routing.decision.answers["team"].probabilities == team["probabilities"]
    assert routing.decision.answers["urgency"].noul == urgency["noul"]
    assert routing.decision.usage.input_tokens == want["usage"]["input_tokens"]
    assert routing.tier == derive_tier(routing.decision, min_confidence=router.config.min_confidence).tier


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


def test_a_255_option_choice_gets_the_oracle_answer_at_the_defaults(fixture_server, oracle_probabilities):
    url, _ = fixture_server
    answer = systemone(url, wide_choice_request(255))
    assert _largest_difference(answer, oracle_probabilities("untied_f32", "wide_choice")) <= 0.005


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
    response = httpx.post(f"{url}/v1/systemone", json=long_state_request(paragraphs=420), timeout=TIMEOUT)
    assert response.status_code == 413, response.text
    detail = response.json()["detail"]
    assert detail["error_type"] == "prompt_too_long" and f"limit of {LoadOptions.max_prompt_tokens} tokens" in detail["message"]


def _probabilities(answer: dict[str, Any]) -> list[float]:
    values = []
    for got in answer["answers"].values():
        values += [got["noul"]] if got["type"] == "noul" else list(got["probabilities"].values())
    return values


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
    run = subprocess.run(
        [sys.executable, "-m", "clef_gguf.cli", "serve", str(DEMO_MODEL), "--ctx", "512", "--ubatch", "1024"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--ubatch (1024) cannot exceed" in run.stderr and "Uvicorn running" not in run.stderr

"""What several test modules share about a server: an app served in this process (start), the malformed bodies and
Workers AI paths, raw-socket helpers, a model that holds its batch, answer comparisons, and the released clients' checks
(the local `serve` in test_clients.py and the Ray endpoint in test_ray_serve.py run the same ones). Test modules import
this, never each other."""

from __future__ import annotations

import asyncio
import copy
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import httpx2
import pytest
import typesafe_sdk as ts
import uvicorn

from clef_gguf.server import HttpLimits, uvicorn_config
from clef_gguf.testing.request_suite import largest_difference, long_state_text, mixed_request, response_probabilities

TIMEOUT = httpx.Timeout(120.0)
Request = dict[str, Any]


# --- A live server in this process ---------------------------------------------------------------------------
@dataclass
class Live:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def start(app: Any) -> Live:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; no race with other tests
    server = uvicorn.Server(uvicorn_config(app, HttpLimits(), log_level="warning"))  # serve's protocol and limits
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return Live(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)


class BlockingModel:
    """A real model whose answer_batch waits for a release: to hold the queue full on purpose."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.name, self.path, self.written = model.name, model.path, model.written
        self.max_prompt_tokens, self.ubatch = model.max_prompt_tokens, model.ubatch
        self.image_limits = model.image_limits  # the Encoder protocol's (runtime/protocols.py)
        self.release = threading.Event()

    def encode(self, request: Request) -> Any:
        return self.model.encode(request)

    def adapter_names(self) -> list[str]:
        return self.model.adapter_names()

    def adapter_listing(self) -> list[Any]:
        return self.model.adapter_listing()

    def batchable(self, prompts: list[Any]) -> bool:
        return self.model.batchable(prompts)

    def answer_batch(self, prompts: list[Any]) -> list[Any]:
        assert self.release.wait(60)
        return self.model.answer_batch(prompts)

    def submit(self, fn: Any) -> Any:
        return self.model.submit(fn)

    def stepped(self, prompt: Any) -> bool:
        return self.model.stepped(prompt)

    def begin(self, prompt: Any) -> Any:
        return self.model.begin(prompt)

    def resident_adapters(self) -> frozenset[str]:
        return self.model.resident_adapters()

    def close(self) -> None:
        pass


# --- Answers compared ----------------------------------------------------------------------------------------
# At f32 the responses' rounding to 4 decimals can move a last digit; q8_0 requantizes every activation row to 8
# bits, so that noise flips roundings, layer after layer, as another ubatch size does (state_cache.cuts: up to
# 0.0074): measured up to 0.0099, against the q8_0 parity tolerance of 0.035 (tests/test_parity.py).
ANSWER_TOLERANCE = {"f32": 1e-4 + 1e-9, "q8_0": 0.015}


def reuse_apart(body: dict[str, Any]) -> dict[str, Any]:
    """A response without the state cache's count of reused tokens, which depends on the requests before it."""
    usage = {k: v for k, v in body["usage"].items() if k != "input_tokens_details"}
    assert set(body["usage"]) - set(usage) == {"input_tokens_details"}
    return {**body, "usage": usage}


def assert_close(one: dict[str, Any], other: dict[str, Any], tolerance: float) -> None:
    assert one["usage"] == other["usage"]
    assert largest_difference(response_probabilities(one), response_probabilities(other)) <= tolerance


# --- Bodies the API refuses, and the Workers AI route's paths ------------------------------------------------
def with_change(change: Callable[[Request], Any]) -> Request:
    """The mixed suite request, changed by `change`."""
    request = copy.deepcopy(mixed_request())
    change(request)
    return request


MALFORMED: dict[str, tuple[bytes | Request, list[Any]]] = {
    "not JSON": (b'{"state": ', ["body", 10]),
    "NaN": (b'{"model": "m", "state": NaN, "questions": {"q": {"type": "noul"}}}', ["body"]),
    "not UTF-8": (b'{"state": "\xff"}', ["body", 11]),
    "lone surrogate": (b'{"state": {"k": ["\\ud800"]}, "questions": {"q": {"type": "noul"}}}', ["body", "state", "k", 0]),
    "nested too deeply": (b"[" * 100_000 + b"]" * 100_000, ["body"]),
    "huge integer": (b'{"state": ' + b"9" * 5000 + b"}", ["body"]),
    "an array": (b"[]", ["body"]),
    "no state": (with_change(lambda r: r.pop("state")), ["body", "state"]),
    "state a number": (with_change(lambda r: r.update(state=3)), ["body", "state"]),
    "model a number": (with_change(lambda r: r.update(model=3)), ["body", "model"]),
    "no questions": (with_change(lambda r: r.update(questions={})), ["body", "questions"]),
    "65 questions": (
        with_change(lambda r: r.update(questions={f"q{i}": {"type": "noul"} for i in range(65)})),
        ["body", "questions"],
    ),
    "empty id": (with_change(lambda r: r["questions"].update({"": {"type": "noul"}})), ["body", "questions"]),
    "question a string": (with_change(lambda r: r["questions"].update({"a.b": "x"})), ["body", "questions", "a.b"]),
    "unknown type": (with_change(lambda r: r["questions"].update({"r": {"type": "rank"}})), ["body", "questions", "r", "type"]),
    "instructions a number": (
        with_change(lambda r: r["questions"]["is_spam"].update(instructions=1)),
        ["body", "questions", "is_spam", "instructions"],
    ),
    "choice with 1 option": (
        with_change(lambda r: r["questions"]["category"].update(criteria={"a": None})),
        ["body", "questions", "category", "criteria"],
    ),
    "choice with 256 options": (
        with_change(lambda r: r["questions"]["category"].update(criteria={str(i): None for i in range(256)})),
        ["body", "questions", "category", "criteria"],
    ),
    "choice description a number": (
        with_change(lambda r: r["questions"]["category"].update(criteria={"x.y": 1, "z": None})),
        ["body", "questions", "category", "criteria", "x.y"],
    ),
    "score as a map": (
        with_change(lambda r: r["questions"]["severity"].update(criteria={"0": "low", "1": "high"})),
        ["body", "questions", "severity", "criteria"],
    ),
    "score with 1 level": (
        with_change(lambda r: r["questions"]["severity"].update(criteria=["only"])),
        ["body", "questions", "severity", "criteria"],
    ),
    "score with 11 levels": (
        with_change(lambda r: r["questions"]["severity"].update(criteria=list("abcdefghijk"))),
        ["body", "questions", "severity", "criteria"],
    ),
    "score level a number": (
        with_change(lambda r: r["questions"]["severity"].update(criteria=["a", 2])),
        ["body", "questions", "severity", "criteria", 1],
    ),
    # TypeSafe's schema has no null level, and typesafe-sdk cannot parse a null in the answer's legend.
    "score level null": (
        with_change(lambda r: r["questions"]["severity"].update(criteria=["a", None])),
        ["body", "questions", "severity", "criteria", 1],
    ),
    "noul with other keys": (
        with_change(lambda r: r["questions"].update(n={"type": "noul", "criteria": {"maybe": "x"}})),
        ["body", "questions", "n", "criteria"],
    ),
    # This model is loaded without its vision tower (test_server_images.py has one).
    "an image": (
        with_change(lambda r: r.update(assets={"img": {"type": "image", "format": "png", "data_base64": "AAAA"}})),
        ["body", "assets"],
    ),
    "an image without its format": (
        with_change(lambda r: r.update(assets={"img": {"type": "image", "data_base64": "AAAA"}})),
        ["body", "assets", "img", "format"],
    ),
    "images": (with_change(lambda r: r.update(images=["data:image/png;base64,AAAA"])), ["body", "images"]),
    "a video": (with_change(lambda r: r.update(videos=["data:video/mp4;base64,AAAA"])), ["body", "videos"]),
}


WORKERS_AI_PATHS = [
    f"{prefix}/accounts/acct-1/ai/run/{model_id}"
    for prefix in ("", "/client/v4")
    for model_id in ("@cf/cloudflare/clef", "@cf/cloudflare/clef-flash")
]


# --- Raw HTTP on a socket ------------------------------------------------------------------------------------
def parse_answer(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """An HTTP answer's status (0: none), headers (names in lower case) and body."""
    if not raw:
        return 0, {}, b""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def whole_answers(raw: bytes) -> int:
    """How many whole answers (a head and its Content-Length of body) `raw` begins with."""
    count = 0
    while (end := raw.find(b"\r\n\r\n")) >= 0:
        size = parse_answer(raw[: end + 4])[1].get("content-length")
        if size is None or len(raw) < end + 4 + int(size):
            break  # (an answer of unknown length ends only when the connection does)
        raw, count = raw[end + 4 + int(size) :], count + 1
    return count


def receive(sock: socket.socket, deadline: float, answers: int | None = None) -> bytes:
    """What the server sends on `sock` until it closes the connection or time.perf_counter() reaches `deadline`; with
    `answers`, only until that many whole answers have come (not waiting out the keep-alive after them)."""
    received = bytearray()
    while select.select([sock], [], [], max(0.0, deadline - time.perf_counter()))[0]:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        received += data
        if answers is not None and whole_answers(received) >= answers:
            break
    return bytes(received)


def post_head(length: int | None = None, extra: str = "") -> bytes:
    sized = f"content-length: {length}\r\n" if length is not None else ""
    return f"POST /v1/systemone HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n{sized}{extra}\r\n".encode()


@contextmanager
def open_body(port: int, declared: int, sent: bytes = b" ") -> Iterator[socket.socket]:
    """A connection that declared a body of `declared` bytes, sent `sent` of it and then waits (a trickler between
    two bytes); closed on exit."""
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(post_head(declared) + sent)
        yield sock
    finally:
        sock.close()


def answer_of(sock: socket.socket, limit_s: float) -> tuple[int, dict[str, str], bytes]:
    """The answer on `sock` (status 0: none within limit_s, or closed without one), read until the server closes."""
    return parse_answer(receive(sock, time.perf_counter() + limit_s))


# --- The released clients, each driven through its own public API (test_clients.py, test_ray_serve.py) ---------
ACCOUNT_ID = "0123456789abcdef0123456789abcdef"
API_TOKEN = "local-token"  # the server has no --api-key: any Bearer token is accepted, as the clients always send one
CLIENT_TIMEOUT_S = 300.0


def systemone(url: str, body: Request) -> dict[str, Any]:
    """What /v1/systemone answers for a body: each client must report exactly this."""
    response = httpx.post(f"{url}/v1/systemone", json=body, timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def set_workers_ai_env(monkeypatch: pytest.MonkeyPatch, url: str) -> str:
    """The environment clef-evals and clef-compactor document, pointed at the server at `url` (returned)."""
    monkeypatch.setenv("CLEF_BASE_URL", f"{url}/client/v4")
    monkeypatch.setenv("CLEF_ACCOUNT_ID", ACCOUNT_ID)
    monkeypatch.setenv("CLEF_API_TOKEN", API_TOKEN)
    # Their documented timeout (30 or 60 s by default), as long as the other clients get: on a software device (the
    # device set on lavapipe) clef-compactor's 64-chunk request took 181 s and timed out at 60.
    monkeypatch.setenv("CLEF_TIMEOUT", str(CLIENT_TIMEOUT_S))
    return url


def check_typesafe_sdk(url: str) -> None:
    """typesafe-sdk (System One) parses every answer type as served, and gets a 422 for a null level."""
    sent: list[httpx2.Request] = []
    http = httpx2.Client(timeout=CLIENT_TIMEOUT_S, event_hooks={"request": [sent.append]})
    questions = {
        "spam": ts.Noul(instructions="Is this spam?", criteria={"true": "Unsolicited"}),
        "tone": ts.Choice(instructions="What is the tone?", criteria={"calm": None, "angry": "upset", "🙂": ["happy"]}),
        "urgency": ts.Score(instructions="How urgent?", criteria=["low", "medium", {"level": "high"}]),
    }
    with ts.TypeSafeClient(base_url=url, api_key="local", http_client=http, compression=False) as sdk:
        got = sdk.system_one(state={"message": "I was charged twice for the café order."}, questions=questions)
        want = systemone(url, json.loads(sent[0].content))
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


def check_clef_rag(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """clef-rag's self-hosted backend asks about a state of more than 20,000 tokens."""
    from clef_rag.clef import Choice, ClefClient, ClefConfig, Noul, Score

    monkeypatch.setenv("CLEF_BASE_URL", url)  # clef-rag's self-hosted backend: {CLEF_BASE_URL}/v1/systemone
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
    want = systemone(url, payload)
    assert response.input_tokens == want["usage"]["input_tokens"] > 20_000
    assert response.answers["refund"].noul == want["answers"]["refund"]["noul"]
    assert response.answers["language"].probabilities == want["answers"]["language"]["probabilities"]
    assert response.answers["anger"].score == want["answers"]["anger"]["score"]


def check_clef_evals(url: str) -> None:
    """clef-evals (Workers AI's REST shape, set_workers_ai_env) judges a choice and evaluates a set."""
    from clef_evals import Choice, ClefJudge, Noul
    from clef_evals.models import build_payload

    criteria = {"billing": "Payments and refunds.", "technical": "Bugs and outages.", "sales": "Pricing."}
    state = "My card was charged twice for one order."
    with ClefJudge() as judge:
        question = "Which team should handle this?"
        decision = judge.judge_choice(state, question, criteria)
        want = systemone(url, build_payload("clef", state, {"decision": Choice(question, criteria)}))
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
            expected.append((systemone(url, body)["answers"]["is_true"]["noul"] >= 0.5) == item["gold"])
        else:
            options = item.get("criteria") or {c: "" for c in item["choices"]}
            body = build_payload("clef", item["state"], {"decision": Choice(item["instructions"], options)})
            expected.append(systemone(url, body)["answers"]["decision"]["choice"] == item["gold"])
    assert result.correct == expected


def check_clef_compactor(url: str) -> None:
    """clef-compactor (Workers AI's REST shape, set_workers_ai_env) scores 64 chunks in one request."""
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
    want = systemone(url, body)
    assert [chunk.score for chunk in result.scores] == [want["answers"][f"chunk_{i + 1}"]["noul"] for i in range(64)]
    assert result.usage is not None and result.usage.input_tokens == want["usage"]["input_tokens"] > 4096
    assert len(result.kept) + len(result.dropped) == 64


def check_clef_router(url: str) -> None:
    """clef-router routes through its base_url (Workers AI's REST shape)."""
    from clef_router import ClefRouter
    from clef_router.models import DEFAULT_QUESTIONS, derive_tier
    from clef_router.transport import build_chat_state

    prompt = "Our payment API returns 500 for every request since the last deploy. What do we check first?"
    system = "Route anything about outages to the frontier team."
    with ClefRouter(account_id=ACCOUNT_ID, api_token=API_TOKEN, base_url=f"{url}/client/v4") as router:
        routing = router.route(prompt, system_prompt=system)
    want = systemone(url, {"model": "clef-flash", "state": build_chat_state(system, prompt), "questions": DEFAULT_QUESTIONS})
    team, urgency = want["answers"]["team"], want["answers"]["urgency"]
    assert routing.decision.answers["team"].choice == team["choice"]
    assert routing.decision.answers["team"].probabilities == team["probabilities"]
    assert routing.decision.answers["urgency"].noul == urgency["noul"]
    assert routing.decision.usage.input_tokens == want["usage"]["input_tokens"]
    assert routing.tier == derive_tier(routing.decision, min_confidence=router.config.min_confidence).tier

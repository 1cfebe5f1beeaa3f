"""Several prompts decided together: one backbone prefill of distinct llama.cpp sequences.

A prompt's answers in a batch are its answers alone, within float noise: its hidden states move by about
1e-6 (f32), because llama.cpp's kernels group the sums of a ubatch of several sequences differently (its
attention over a KV cache shared with them, where a sequence's cells lie elsewhere than alone; its
products over more rows). The server batches the requests that wait while a batch runs.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import f16_tiles
from server_helpers import ANSWER_TOLERANCE, TIMEOUT, BlockingModel, assert_close, reuse_apart, start

import clef_gguf
from clef_gguf.runtime.batching import take
from clef_gguf.server.app import create_app
from clef_gguf.testing.request_suite import (
    largest_difference,
    long_state_text,
    mixed_request,
    response_probabilities,
    ten_level_score_request,
)

pytestmark = pytest.mark.device  # in the device set (tests/conftest.py)

N_CTX = 8192
# Hidden states (RMS about 1, largest values about 10): float noise, measured up to 1.3e-4 at f32. Probabilities:
# server_helpers.ANSWER_TOLERANCE.
HIDDEN_TOLERANCE = {"f32": 5e-4, "q8_0": 5e-2}
# On a device that rounds the products' operands to F16 (conftest.f16_tiles: llama.cpp's backbone, not the
# head, which splits its products), a batch's hidden states are those alone to an F16 step or two of each value:
# measured on lavapipe up to 0.0039 (one step at 4 to 8), f32 and q8_0. Its answers: up to 0.0008 (f32, batched
# and from the state cache), against 1e-4 on the CPU.
F16_STEPS = 2 * 2.0**-10
F16_ANSWER_TOLERANCE = 2e-3


def answer_tolerance(file_type: str, model: Any) -> float:
    return max(ANSWER_TOLERANCE[file_type], F16_ANSWER_TOLERANCE if f16_tiles(model.head.device) else 0.0)


def hidden_close(one: np.ndarray, other: np.ndarray, file_type: str, f16: bool) -> bool:
    allowed = HIDDEN_TOLERANCE[file_type] + (F16_STEPS * np.maximum(np.abs(one), np.abs(other)) if f16 else 0.0)
    return bool(np.all(np.abs(one - other) <= allowed))


def requests(n: int, *, long_state: bool = False) -> list[dict[str, Any]]:
    """n requests about states of their own, of differing lengths and schemas."""
    out = []
    for i in range(n):
        request = mixed_request() if i % 2 == 0 else ten_level_score_request()
        text = long_state_text(2 + i) if long_state else f"case {i}: " + "the parcel came late. " * (3 * i + 1)
        out.append({**request, "state": {"case": i, "ticket": text}})
    return out


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def loaded(ws, request) -> Any:
    file_type = request.param
    model = clef_gguf.load(ws.gguf("untied_f32", file_type), max_prompt_tokens=N_CTX, ubatch=N_CTX, state_cache=0, parallel=4)
    yield file_type, model
    model.close()


def test_batched_hidden_states_and_answers_are_those_alone(loaded):
    file_type, model = loaded
    prompts = [model.encode(r) for r in requests(4)]
    assert model.batchable(prompts)
    alone = [model.decider.prefill.hidden_states([p])[0][0].copy() for p in prompts]  # (views of llama.cpp's buffer: copied)
    together = model.decider.prefill.hidden_states(prompts)
    f16 = f16_tiles(model.head.device)
    for one, (other, _) in zip(alone, together, strict=True):
        assert one.shape == other.shape and hidden_close(one, other, file_type, f16)
    answers = model.decide_batch(prompts)
    for prompt, answer in zip(prompts, answers, strict=True):
        assert_close(answer, model.decide(prompt), answer_tolerance(file_type, model))


def test_what_is_batchable(loaded):
    _, model = loaded
    prompts = [model.encode(r) for r in requests(5)]
    assert model.batchable(prompts[:4]) and not model.batchable(prompts)  # parallel = 4 sequences
    long = [model.encode(r) for r in requests(2, long_state=True)]
    assert model.batchable(long[:1])  # one prompt always is
    big = long[0]
    assert model.batchable([big, *prompts[:1]]) == (len(big.tokens) + len(prompts[0].tokens) <= model.ubatch)
    with pytest.raises(clef_gguf.errors.ComputeError):
        model.decide_batch(prompts)


@pytest.mark.slow
def test_the_state_cache_hits_and_fills_inside_a_batch(ws):
    path = ws.gguf("untied_f32", "f32")
    cold = clef_gguf.load(path, max_prompt_tokens=N_CTX, ubatch=N_CTX, state_cache=0, parallel=4)
    cached = clef_gguf.load(path, max_prompt_tokens=N_CTX, ubatch=N_CTX, parallel=4)
    try:
        first = requests(3, long_state=True)
        # Two repeat a state the cache has (after the first batch), one is new.
        second = [{**first[0], "questions": ten_level_score_request()["questions"]}, first[1], requests(4, long_state=True)[3]]
        preamble = cached.encode(first[0]).preamble  # the template's, kept since the load's probe
        answers = cached.decide_batch([cached.encode(r) for r in first])
        assert [a["usage"]["input_tokens_details"]["cached_tokens"] for a in answers] == [preamble] * 3
        again = cached.decide_batch([cached.encode(r) for r in second])
        reused = [a["usage"]["input_tokens_details"]["cached_tokens"] for a in again]
        assert reused[0] > preamble and reused[1] > preamble and reused[2] == preamble
        tolerance = answer_tolerance("f32", cold)
        for request, answer in zip([*first, *second], [*answers, *again], strict=True):
            expected = cold.decide(request)
            assert answer["usage"]["input_tokens"] == expected["usage"]["input_tokens"]
            assert largest_difference(response_probabilities(answer), response_probabilities(expected)) <= tolerance
    finally:
        cold.close()
        cached.close()


class GatedModel(BlockingModel):
    """test_server's BlockingModel (its decisions wait for a release), recording the size of each batch."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.batches: list[int] = []

    def answer_batch(self, prompts: list[Any]) -> list[Any]:
        answers = super().answer_batch(prompts)
        self.batches.append(len(prompts))
        return answers


@pytest.mark.slow
def test_the_server_batches_the_requests_that_wait_in_order(loaded):
    file_type, model = loaded
    gated = GatedModel(model)
    live = start(create_app(gated, owns_model=False))
    sent = requests(6)
    try:
        with ThreadPoolExecutor(6) as pool:
            first = pool.submit(httpx.post, f"{live.url}/v1/systemone", json=sent[0], timeout=TIMEOUT)
            deadline = time.monotonic() + 30
            while httpx.get(f"{live.url}/health").json()["pending"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            rest = []
            for i, request in enumerate(sent[1:], 2):  # one at a time, so that the queue's order is known
                rest.append(pool.submit(httpx.post, f"{live.url}/v1/systemone", json=request, timeout=TIMEOUT))
                while httpx.get(f"{live.url}/health").json()["pending"] < i:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            gated.release.set()
            responses = [first.result(), *(f.result() for f in rest)]
    finally:
        gated.release.set()
        live.stop()
    assert gated.batches == [1, 4, 1]  # the first alone; then the oldest four waiting (parallel), then the last
    timings = [r.headers["server-timing"] for r in responses]
    assert ['batch of 1"' in t for t in timings] == [True, False, False, False, False, True]
    assert all("decide;dur=" in t and 'desc="batch of 4"' in t for t in timings[1:5])
    for request, response in zip(sent, responses, strict=True):
        assert response.status_code == 200
        assert_close(reuse_apart(response.json()), reuse_apart(model.decide(request)), answer_tolerance(file_type, model))


def test_after_a_batch_of_one_model_the_oldest_request_of_another_goes_first():
    """A hot model's requests do not hold the context batch after batch while a cold one's request waits behind them
    all (ComputeScheduler passes the model of its last batch): the cold one goes next, the order kept otherwise."""
    waiting = deque([("hot", 1), ("hot", 2), ("hot", 3), ("cold", 4), ("hot", 5)])

    def fits(batch: list, item: tuple) -> bool:
        return len(batch) < 2

    def model(item: tuple) -> str:
        return item[0]

    assert take(waiting, fits, model, last="hot") == [("cold", 4)]
    assert list(waiting) == [("hot", 1), ("hot", 2), ("hot", 3), ("hot", 5)]
    assert take(waiting, fits, model, last="cold") == [("hot", 1), ("hot", 2)]
    assert take(waiting, fits, model, last="hot") == [("hot", 3), ("hot", 5)]  # only the last model waits: it goes
    assert take(deque([("hot", 1), ("cold", 2)]), fits, model) == [("hot", 1)]  # no last batch: the oldest goes
    not_ready = deque([("hot", 1), ("cold", 2), ("hot", 3)])  # the cold one refused now (beside a prompt in steps)
    assert take(not_ready, fits, model, lambda item: item[0] != "cold", last="hot") == [("hot", 1), ("hot", 3)]
    assert list(not_ready) == [("cold", 2)]

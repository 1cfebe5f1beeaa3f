"""Fair compute: a long prompt is decided a ubatch at a time, the batches waiting decided between its steps.

On the demo model at ubatch 256, a request of two choice questions of 255 options takes about 9,400 tokens:
37 ubatches. A small request sent while it is prefilled must be answered long before it (today's main answered it
after the heavy one's whole prefill), and every answer must be the one deciding it alone gives.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from server_helpers import ANSWER_TOLERANCE, TIMEOUT, assert_close, reuse_apart, start

import clef_gguf
from clef_gguf.data import DEMO_MODEL
from clef_gguf.server.app import create_app
from clef_gguf.testing.request_suite import long_state_text, wide_choice_request

UBATCH = 256
CONTEXT = 24576
TOLERANCE = ANSWER_TOLERANCE["f32"]


def heavy(questions: int = 2, state: Any = "Ticket: the printer on floor 3 prints blank pages.") -> dict[str, Any]:
    """Choice questions of 255 options each (a few thousand tokens a question)."""
    [question] = wide_choice_request(255)["questions"].values()
    return {**wide_choice_request(255), "state": state, "questions": {f"label_{i}": question for i in range(questions)}}


def small(i: int) -> dict[str, Any]:
    question = {"type": "noul", "instructions": "Late?"}
    return {"state": {"ticket": f"case {i}: the parcel came late."}, "questions": {"late": question}}


@pytest.fixture(scope="module")
def model() -> Any:
    with clef_gguf.load(DEMO_MODEL, max_prompt_tokens=CONTEXT, ubatch=UBATCH, parallel=4, state_cache=0) as loaded:
        yield loaded


@pytest.mark.slow
def test_a_small_request_is_answered_while_a_heavy_one_is_prefilled(model):
    first, second = heavy(), heavy(state="Ticket: the scanner on floor 2 jams.")
    assert model.stepped(model.encode(first)) and len(model.encode(first).tokens) > 30 * UBATCH
    assert not model.stepped(model.encode(small(0)))
    began = time.perf_counter()
    alone = {id(r): model.decide(r) for r in (first, second)}
    prefill_s = (time.perf_counter() - began) / 2  # one heavy request decided alone
    live = start(create_app(model, owns_model=False))
    done: dict[str, float] = {}

    def post(name: str, request: dict[str, Any]) -> httpx.Response:
        response = httpx.post(f"{live.url}/v1/systemone", json=request, timeout=TIMEOUT)
        done[name] = time.perf_counter()
        return response

    try:
        with ThreadPoolExecutor(2) as pool:
            heavies = [pool.submit(post, "heavy", first)]
            deadline = time.monotonic() + 60
            while httpx.get(f"{live.url}/health").json()["pending"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            heavies.append(pool.submit(post, "second", second))  # waits for the first: one prompt in steps at a time
            time.sleep(0.2)
            smalls, latencies = [], []
            for i in range(3):  # one after the other, each behind the heavy one in progress
                sent = time.perf_counter()
                smalls.append(post(f"small {i}", small(i)))
                latencies.append(time.perf_counter() - sent)
            answers = [f.result() for f in heavies]
    finally:
        live.stop()
    assert max(done[f"small {i}"] for i in range(3)) < done["heavy"] < done["second"]
    assert max(latencies) < prefill_s / 2, (latencies, prefill_s)  # today: the heavy one's whole prefill
    for request, response in zip((first, second), answers, strict=True):
        assert response.status_code == 200
        assert_close(reuse_apart(response.json()), reuse_apart(alone[id(request)]), TOLERANCE)
    for i, response in enumerate(smalls):
        assert response.status_code == 200
        assert_close(reuse_apart(response.json()), reuse_apart(model.decide(small(i))), TOLERANCE)


@pytest.mark.slow
def test_steps_save_the_state_and_survive_a_reset_memory():
    """Decided in steps beside small batches, a long state's prompt fills the state cache as alone, and a memory
    reset under it (a non-finite decode elsewhere: Backbone.clear wipes every sequence) prefills it again."""
    request, ubatch = heavy(1, {"ticket": long_state_text(6)}), 320  # (two small prompts fit a ubatch)
    with (
        clef_gguf.load(DEMO_MODEL, max_prompt_tokens=CONTEXT, ubatch=ubatch, parallel=4) as cached,
        clef_gguf.load(DEMO_MODEL, max_prompt_tokens=CONTEXT, ubatch=ubatch, parallel=4, state_cache=0) as cold,
    ):
        prompt, smalls = cached.encode(request), [cached.encode(small(i)) for i in range(2)]
        assert prompt.state_prefix - prompt.preamble > 2 * ubatch  # the state itself takes several ubatches

        def decide_in_steps(reset_at: int | None) -> tuple[Any, list[Any], int]:
            steps, between = cached.begin(prompt), []
            try:
                assert cached.batchable(smalls) and not cached.batchable([prompt, *smalls[:1]])
                assert not cached.batchable([prompt]) and not cached.batchable(smalls * 2)  # 3 sequences are left
                for n in range(10_000):
                    if n == reset_at:
                        cached.backbone._dirty = True  # as a decode that wrote a NaN leaves it: the next clear wipes all
                    between.append(cached.decide_batch(smalls))
                    answer = steps.step()
                    if answer is not None:
                        return answer if isinstance(answer, Exception) else answer.body, between, steps.restarts
                raise AssertionError("never answered")
            finally:
                steps.finish()

        answer, between, restarts = cached.compute(decide_in_steps, None)
        assert restarts == 0 and cached.batchable([prompt])  # its sequence given back
        expected = cold.decide(request)
        assert answer["usage"]["input_tokens_details"]["cached_tokens"] == prompt.preamble  # (cached at load)
        assert_close(reuse_apart(answer), reuse_apart(expected), TOLERANCE)
        alone = [cold.decide(p) for p in (small(0), small(1))]
        for answers in between:
            for got, want in zip(answers, alone, strict=True):
                assert_close(reuse_apart(got), reuse_apart(want), TOLERANCE)
        # Its state was saved at the cut after the state: the same state with other questions starts there.
        again = cached.decide({**request, "questions": small(0)["questions"]})
        assert again["usage"]["input_tokens_details"]["cached_tokens"] == prompt.state_prefix
        reset, _, restarts = cached.compute(decide_in_steps, 5)
        assert restarts == 1
        assert_close(reuse_apart(reset), reuse_apart(expected), TOLERANCE)

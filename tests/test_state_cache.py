"""The state cache: a repeated state is not prefilled again, and the answers do not change.

Requests about one state share the prompt's first tokens (the template's pieces up to and
including the state); the cache keeps the backbone's state after them and computes only the
schema. Its answers must be the cache-off answers (float noise: the prefill is split at the
prefix) and the reference's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import httpx
import numpy as np
import pytest
from live_server import served

import clef_gguf
from clef_gguf.data import DEMO_MODEL
from clef_gguf.errors import PromptTooLongError, SettingsError
from clef_gguf.format.template import SYSTEM_PROMPT
from clef_gguf.llama.backbone import prompt_positions
from clef_gguf.runtime.state_cache import MIN_PREFIX_TOKENS, Entry, StateCache, entry_bytes, prefix_key
from clef_gguf.testing.request_suite import largest_difference, long_state_request, long_state_text, response_probabilities

pytestmark = pytest.mark.device  # in the device set (tests/conftest.py)

N_CTX = 8192
# A new 3-question schema about the suite's long state (whose own schema the oracle fixture answers).
OTHER_QUESTIONS: dict[str, Any] = {
    "polite": {"type": "noul", "instructions": "Is the customer polite?"},
    "channel": {"type": "choice", "criteria": {"email": "An email", "chat": None, "phone": ["a call"]}},
    "length": {"type": "score", "instructions": "How long is it?", "criteria": ["short", "medium", "long", "very long"]},
}
# The parity tests' tolerances against the reference (tests/test_parity.py).
ORACLE_TOLERANCE = {("f32", "auto"): 0.005, ("q8_0", "auto"): 0.035}


def _request(state: Any, questions: dict[str, Any] = OTHER_QUESTIONS) -> dict[str, Any]:
    return {"model": "jev-latest", "state": state, "questions": questions}


def _cached(response: dict[str, Any]) -> int:
    return response["usage"]["input_tokens_details"]["cached_tokens"]


# --- The prefix -------------------------------------------------------------------------------------------
def test_the_state_prefix_is_the_prompt_up_to_the_end_of_the_state(ws):
    model = ws.model("untied_f32", "f32")
    state = {"ticket": long_state_text(2), "tier": "gold"}
    one, other = model.encode(_request(state)), model.encode(long_state_request() | {"state": state})
    n = one.state_prefix
    assert n == other.state_prefix > 0 and one.tokens[:n] == other.tokens[:n]
    # Exactly the system preamble and the state's JSON, each tokenized on its own (as the reference does).
    preamble = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nSTATE:\n"
    text = json.dumps(state, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    assert one.tokens[:n] == model.backbone.tokenize(preamble) + model.backbone.tokenize(text)
    assert one.tokens[n:] != other.tokens[n:]  # the schemas differ right after it


def test_different_states_have_different_prefixes(ws):
    model = ws.model("untied_f32", "f32")
    base = model.encode(_request(long_state_text(2)))
    for state in (
        long_state_text(2) + " One more sentence.",
        long_state_text(2).replace("refund", "repair"),
        [long_state_text(2)],
    ):
        changed = model.encode(_request(state))
        assert changed.tokens[: changed.state_prefix] != base.tokens[: base.state_prefix]


# --- Same answers -----------------------------------------------------------------------------------------
# The suite's long state (about 3,700 tokens), on which the parity tolerances were set: at q8_0 the
# fixtures' own error moves with the request (a 600-token state is 0.046 from the reference with or
# without the cache, over the tolerance).
STATE_PARAGRAPHS = 18


def _new_schema() -> dict[str, Any]:
    return _request(long_state_text(STATE_PARAGRAPHS), OTHER_QUESTIONS)


@functools.cache
def _oracle_of_the_new_schema(ws: Any, release: str) -> dict[str, dict[str, float]]:
    return ws.oracle(release).probabilities(_new_schema())


@pytest.mark.parametrize("ubatch", [128, 1024])
@pytest.mark.parametrize(("release", "file_type"), [("untied_f32", "f32"), ("untied_f32", "q8_0"), ("tied_bf16", "q8_0")])
def test_a_hit_gives_the_answers_of_the_cache_off_and_of_the_reference(ws, oracle_probabilities, release, file_type, ubatch):
    path = ws.gguf(release, file_type)
    first, second = long_state_request(), _new_schema()  # one state, two schemas
    with (
        clef_gguf.load(path, max_prompt_tokens=N_CTX, ubatch=ubatch) as on,
        clef_gguf.load(path, max_prompt_tokens=N_CTX, ubatch=ubatch, state_cache=0) as off,
    ):
        prefix, preamble = on.encode(first).state_prefix, on.encode(first).preamble
        assert prefix > 2 * ubatch  # the prefix alone spans ubatches
        assert len(on.encode(second).tokens) - prefix > ubatch or ubatch > 128  # at 128 the schema after a hit does too
        cold, hit = on.decide(first), on.decide(second)
        # The template's preamble (kept since the load's probe), then the state.
        assert (_cached(cold), _cached(hit)) == (preamble, prefix) and len(on.state_cache) == 2
        for ours, request in ((cold, first), (hit, second)):
            expected = off.decide(request)
            assert _cached(expected) == 0 and ours["usage"]["input_tokens"] == expected["usage"]["input_tokens"]
            # Both cut the prefill at the preamble and the prefix (state_cache.cuts), and a hit continues from
            # the very state the cold request saved: the same answers to the last bit.
            assert ours["answers"] == expected["answers"]
    tolerance = ORACLE_TOLERANCE[(file_type, "auto")]
    assert largest_difference(response_probabilities(cold), oracle_probabilities(release, "long_state")) <= tolerance
    assert largest_difference(response_probabilities(hit), _oracle_of_the_new_schema(ws, release)) <= tolerance


@pytest.mark.parametrize(("ubatch", "paragraphs", "tolerance"), [(64, 3, 3e-4), (1024, 18, 1e-4)])
@pytest.mark.parametrize("release", ["untied_f32", "tied_bf16"])
def test_a_hit_is_float_noise_away_from_one_unsplit_prefill(ws, release, ubatch, paragraphs, tolerance):
    """A hit's answers against the whole prompt in one decode (no split, no cache), at f32."""
    state = long_state_text(paragraphs)  # 18: about 3,700 tokens, the prefix alone over one ubatch of 1024
    with clef_gguf.load(ws.gguf(release, "f32"), max_prompt_tokens=N_CTX, ubatch=ubatch) as model:
        prompt = model.encode(_request(state))
        assert prompt.state_prefix > ubatch
        unsplit = model.decide(dataclasses.replace(prompt, state_prefix=0, preamble=0))
        model.decide(_request(state, long_state_request()["questions"]))  # the state, with another schema
        hit = model.decide(prompt)
        assert _cached(hit) == prompt.state_prefix and _cached(unsplit) == 0
        whole = model.backbone.hidden_states(prompt.tokens)
        [(hidden, reused)] = model.decider.prefill.hidden_states([prompt])
    assert reused == prompt.state_prefix
    # Positions and the recurrent state continue after the prefix: only ubatch boundaries move. Float noise on
    # hidden states of RMS ~1 (the bounds of tests/test_native_head.py for another ubatch size).
    difference = np.abs(hidden - whole)
    assert difference.max() < 5e-3 and difference.mean() < 5e-4, (difference.max(), difference.mean())
    # Measured: 0 at ubatch 1024, 0.0002 (two steps of the answers' 4 decimals) at ubatch 64.
    assert largest_difference(response_probabilities(hit), response_probabilities(unsplit)) <= tolerance + 1e-9


def test_a_short_state_is_not_cached(ws):
    with clef_gguf.load(ws.gguf("untied_f32", "f32"), max_prompt_tokens=N_CTX) as model:
        short = _request("The printer on floor 3 prints blank pages.")
        assert model.encode(short).state_prefix < MIN_PREFIX_TOKENS
        preamble = model.encode(short).preamble  # the template's, kept for every request
        assert [_cached(model.decide(short)) for _ in range(2)] == [preamble, preamble]
        assert len(model.state_cache) == 1


def test_zero_turns_the_cache_off(ws):
    with clef_gguf.load(ws.gguf("untied_f32", "f32"), max_prompt_tokens=N_CTX, state_cache=0) as model:
        request = _request(long_state_text(4))
        assert [_cached(model.decide(request)) for _ in range(2)] == [0, 0]
        assert len(model.state_cache) == 0 and model.state_cache.nbytes == 0


@pytest.mark.parametrize("size", [-1, 1.5, "1GiB", True])
def test_a_bad_size_is_a_settings_error(ws, size):
    with pytest.raises(SettingsError, match="state_cache must be"):
        clef_gguf.load(ws.gguf("untied_f32", "f32"), max_prompt_tokens=N_CTX, state_cache=size)


def test_a_prompt_over_the_limit_fails_before_any_compute_even_with_its_state_cached(ws):
    with clef_gguf.load(ws.gguf("untied_f32", "f32"), max_prompt_tokens=4096) as model:
        state = long_state_text(3)
        model.decide(_request(state))
        many = {f"q{i}": {"type": "noul", "instructions": "Is it so? " * 30} for i in range(64)}
        too_long = model.encode(_request(state, many))
        assert len(too_long.tokens) > 4096 and too_long.state_prefix < 4096
        with pytest.raises(PromptTooLongError):
            model.decide(too_long)
        assert _cached(model.decide(_request(state))) > 0  # the entry is still there, the model still answers


def test_a_decode_that_leaves_nan_in_memory_does_not_reach_the_next_prompt(ws):
    """Backbone.clear zeroes the memory's bytes only after a decode that may have left a NaN or Inf in
    them (llama.cpp's own zeroing of a new recurrent state is a scaling by 0, which keeps a NaN): a
    poisoned memory is never read by the next prompt, whose hidden states are those of a clean one."""
    backbone = ws.model("untied_f32", "f32").backbone
    tokens = ws.model("untied_f32", "f32").encode(_request("A short state.")).tokens
    backbone.clear()
    clean = backbone.decode(tokens).copy()
    n = len(tokens) + 8  # more cells than the next prompt overwrites
    backbone.clear()
    poisoned = backbone.decode_embeddings(np.full((n, backbone.n_embd), np.nan, dtype=np.float32), prompt_positions(n))
    assert np.isnan(poisoned[-1]).all()
    backbone.clear()
    assert np.array_equal(backbone.decode(tokens), clean)
    backbone.clear()  # and after a clean decode, the next one is the same too (the memory is not zeroed)
    assert np.array_equal(backbone.decode(tokens), clean)


# --- Bounded ----------------------------------------------------------------------------------------------
def test_many_distinct_states_never_exceed_the_budget(ws):
    with clef_gguf.load(ws.gguf("untied_f32", "f32"), max_prompt_tokens=N_CTX, state_cache=0) as probe:
        one_entry = None
        prompt = probe.encode(_request(long_state_text(2)))
        probe.backbone.clear()
        sizes = []
        for end in (prompt.preamble, prompt.state_prefix):
            probe.backbone.clear()
            hidden = probe.backbone.decode(prompt.tokens[:end])
            sizes.append(entry_bytes(prefix_key(prompt.tokens[:end]), probe.backbone.sequence_size(), hidden.nbytes))
    preamble_entry, one_entry = sizes
    budget = preamble_entry + int(3.5 * one_entry)  # room for the template's preamble and three states of this length
    with clef_gguf.load(ws.gguf("untied_f32", "f32"), max_prompt_tokens=N_CTX, state_cache=budget) as model:
        for i in range(8):
            model.decide(_request(f"Request {i}. " + long_state_text(2)))
            cache = model.state_cache
            held = sum(entry_bytes(key, e.sequence.nbytes, e.hidden.nbytes) for key, e in cache._entries.items())
            assert held == cache.nbytes <= budget and len(cache) == 1 + min(i + 1, 3)
        # Least recently used goes first: the last three states are kept, the first ones are computed again; the
        # preamble, used by every request, stays.
        assert _cached(model.decide(_request("Request 7. " + long_state_text(2)))) > prompt.preamble
        assert _cached(model.decide(_request("Request 0. " + long_state_text(2)))) == prompt.preamble


def test_an_entry_larger_than_the_budget_is_not_stored(ws):
    with clef_gguf.load(ws.gguf("untied_f32", "f32"), max_prompt_tokens=N_CTX, state_cache=64 << 10) as model:
        request = _request(long_state_text(4))
        prompt = model.encode(request)
        reused = [_cached(model.decide(request)) for _ in range(2)]
        assert reused[0] == reused[1] < prompt.state_prefix  # the preamble's entry fits, the state's does not
        assert prefix_key(prompt.tokens[: prompt.state_prefix]) not in model.state_cache._entries


def test_the_lru_evicts_in_order_of_use_and_counts_bytes():
    def entry(tokens: int) -> Entry:
        return Entry(np.zeros(1000, dtype=np.uint8), np.zeros((tokens, 4), dtype=np.float32))

    keys = [prefix_key([i] * 10) for i in range(4)]  # 40 bytes each
    size = entry_bytes(keys[0], 1000, 10 * 16)
    cache = StateCache(3 * size)
    for key in keys[:3]:
        assert cache.put(key, entry(10))
    assert cache.get(keys[0]) is not None  # used: the least recently used is now keys[1]
    assert cache.put(keys[3], entry(10))
    assert [cache.get(k) is not None for k in keys] == [True, False, True, True] and cache.nbytes == 3 * size
    assert not cache.put(prefix_key([9]), entry(1000)) and len(cache) == 3  # larger than the budget: refused
    assert cache.put(keys[3], entry(10)) and cache.nbytes == 3 * size  # replacing an entry counts it once


# --- The command ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("option", "reused"), [((), True), (("--state-cache", "0"), False), (("--state-cache", "64MiB"), True)])
@pytest.mark.slow
def test_serve_state_cache_sets_the_budget(option, reused):
    request = _request(long_state_text(4))
    with served(DEMO_MODEL, "--ctx", "4096", *option) as (url, _):
        first, second = (httpx.post(f"{url}/v1/systemone", json=request, timeout=120) for _ in range(2))
    # Only the template's preamble (kept since the load's probe) the first time; the state the second.
    assert (_cached(first.json()) > 0) == reused and ("hit" in first.headers["server-timing"]) == reused
    assert (_cached(second.json()) > _cached(first.json())) == reused and ("hit" in second.headers["server-timing"]) == reused
    assert second.json()["answers"] == first.json()["answers"]

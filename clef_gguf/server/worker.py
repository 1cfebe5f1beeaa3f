"""Decide on one dedicated thread, behind a bounded admission count.

ClefModel.decide is CPU-bound and serialized by the model's lock (one llama.cpp context):
running it on a worker thread keeps the event loop answering (health, errors, new
connections), and one thread makes the order plain: requests are answered first come,
first served, each exactly as a direct decide() would. Admission is bounded, so a burst
gets a prompt 503 with Retry-After (which typesafe-sdk honours) instead of an unbounded
queue and unbounded memory.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .problems import ApiError


class Prompt(Protocol):
    @property
    def tokens(self) -> list[int]: ...


class Encoder(Protocol):
    """What the app and its intake use of a ClefModel: a runtime.encoder.PromptEncoder is one too."""

    name: str
    path: Path
    ubatch: int  # tokens per physical batch of the prefill
    image_limits: object | None  # None: no vision tower loaded, requests with images are refused

    @property
    def max_prompt_tokens(self) -> int: ...

    def encode(self, request: dict[str, Any]) -> Prompt: ...  # validate and tokenize, no compute; thread-safe

    def close(self) -> None: ...


@runtime_checkable
class Model(Encoder, Protocol):
    """What the server uses of a ClefModel that decides in this process."""

    def decide(self, request: Prompt) -> dict[str, Any]: ...  # on a prompt encode returned


@dataclass(frozen=True)
class Decision:
    body: bytes  # the response JSON, UTF-8
    queued_s: float
    decide_s: float
    finished: float  # perf_counter() when decide returned, to time the hand-back to the event loop
    cached_tokens: int = 0  # prompt tokens whose backbone state the state cache gave


def render(response: dict[str, Any]) -> bytes:
    # allow_nan=False: a NaN can never reach a client as the invalid token NaN.
    return json.dumps(response, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def overloaded(pending: int) -> ApiError:
    return ApiError(503, "overloaded_error", f"{pending} requests are already waiting; retry shortly", {"Retry-After": "1"})


class Decider(Protocol):
    """How the app has prompts decided: DecideWorker here, or server/ray_serve.py's replicas."""

    @property
    def pending(self) -> int: ...  # admitted and not yet answered

    async def decide(self, request: Prompt) -> Decision: ...  # raises ApiError 503 when max_pending are admitted

    async def close(self) -> None: ...


class DecideWorker:
    def __init__(self, model: Model, max_pending: int) -> None:
        self.model = model
        self.max_pending = max_pending
        self.pending = 0  # admitted and not yet answered; touched on the event loop only
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-decide")

    def _run(self, request: Prompt, submitted: float) -> Decision:
        started = time.perf_counter()
        response = self.model.decide(request)
        body = render(response)
        finished = time.perf_counter()
        cached = response.get("usage", {}).get("input_tokens_details", {}).get("cached_tokens", 0)
        return Decision(body, started - submitted, finished - started, finished, cached)

    async def decide(self, request: Prompt) -> Decision:
        if self.pending >= self.max_pending:
            raise overloaded(self.pending)
        self.pending += 1
        try:
            # A cancelled wait (client gone, drain timeout) cancels the job if it has not started.
            future = self._executor.submit(self._run, request, time.perf_counter())
            return await asyncio.wrap_future(future)
        finally:
            self.pending -= 1

    async def close(self) -> None:
        """Wait for the running decide (the model must not be closed under it); drop queued ones."""
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)

"""Decide on one dedicated thread, in batches of the requests waiting, behind a bounded admission count.

ClefModel.decide_batch is CPU-bound and serialized on the model's compute thread (one llama.cpp context):
running it on a worker thread keeps the event loop answering (health, errors, new connections).
The thread takes the requests waiting when it is free, first come first served: the oldest, and
the next ones in order while the model can decide them together (ClefModel.batchable), which it
does in one backbone prefill. There is no batching window: an idle server decides a request at
once, and a busy one batches what arrived during the previous batch. Admission is bounded, so a
burst gets a prompt 503 with Retry-After (which typesafe-sdk honours) instead of an unbounded
queue and unbounded memory.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .problems import ApiError, overloaded


class Prompt(Protocol):
    """What the server reads of an encoded prompt (runtime.prompt.EncodedPrompt): for its metrics and log line."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def images(self) -> Sequence[object]: ...

    @property
    def state_prefix(self) -> int: ...  # tokens up to and including the state

    @property
    def preamble(self) -> int: ...  # tokens before the request's own


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

    def batchable(self, prompts: Sequence[Prompt]) -> bool: ...  # whether decide_batch takes them together

    def decide_batch(self, prompts: Sequence[Prompt]) -> list[dict[str, Any] | Exception]: ...  # one each, in order


@dataclass(frozen=True)
class Decision:
    body: bytes  # the response JSON, UTF-8
    queued_s: float
    decide_s: float
    finished: float  # perf_counter() when decide returned, to time the hand-back to the event loop
    cached_tokens: int = 0  # prompt tokens whose backbone state the state cache gave
    batch: int = 1  # requests decided together with this one, itself included


def render(response: dict[str, Any]) -> bytes:
    # allow_nan=False: a NaN can never reach a client as the invalid token NaN.
    return json.dumps(response, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _rendered(answer: dict[str, Any] | Exception) -> bytes | Exception:
    if isinstance(answer, Exception):
        return answer
    try:
        return render(answer)
    except (TypeError, ValueError) as e:
        return e


def queue_full(pending: int) -> ApiError:
    return overloaded(f"{pending} requests are already waiting; retry shortly")


class Decider(Protocol):
    """How the app has prompts decided: DecideWorker here, or server/ray_serve.py's replicas."""

    @property
    def pending(self) -> int: ...  # admitted and not yet answered

    async def decide(self, request: Prompt) -> Decision: ...  # raises ApiError 503 when max_pending are admitted

    async def close(self) -> None: ...


@dataclass(eq=False)
class _Job:
    prompt: Prompt
    submitted: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Decision] = field(init=False)

    def __post_init__(self) -> None:
        self.future = self.loop.create_future()

    def settle(self, decision: Decision | None, error: BaseException | None = None) -> None:
        """From the worker thread: hand the outcome to the waiting coroutine (gone if it was cancelled)."""

        def done() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(decision)  # type: ignore[arg-type]

        self.loop.call_soon_threadsafe(done)


class DecideWorker:
    def __init__(self, model: Model, max_pending: int) -> None:
        self.model = model
        self.max_pending = max_pending
        self.pending = 0  # admitted and not yet answered; touched on the event loop only
        self._queue: deque[_Job] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="clef-decide", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                batch = [self._queue.popleft()]
                while self._queue and self.model.batchable([*(j.prompt for j in batch), self._queue[0].prompt]):
                    batch.append(self._queue.popleft())
            try:
                self._run(batch)
            except Exception as e:  # the batch's error (a llama.cpp failure) is each of its requests'; the thread goes on
                for job in batch:
                    job.settle(None, e)

    def _run(self, batch: list[_Job]) -> None:
        started = time.perf_counter()
        answers = self.model.decide_batch([job.prompt for job in batch])  # (its own error: _loop gives it to all)
        bodies = [_rendered(a) for a in answers]  # (an error here is its request's, never the thread's end)
        finished = time.perf_counter()
        for job, answer, body in zip(batch, answers, bodies, strict=True):
            if isinstance(body, Exception):
                job.settle(None, body)
                continue
            assert isinstance(answer, dict)
            cached = answer.get("usage", {}).get("input_tokens_details", {}).get("cached_tokens", 0)
            job.settle(Decision(body, started - job.submitted, finished - started, finished, cached, len(batch)))

    async def decide(self, request: Prompt) -> Decision:
        if self.pending >= self.max_pending:
            raise queue_full(self.pending)
        self.pending += 1
        job = _Job(request, time.perf_counter(), asyncio.get_running_loop())
        try:
            with self._ready:
                self._queue.append(job)
                self._ready.notify()
            return await job.future
        except asyncio.CancelledError:  # client gone, drain timeout: the job is dropped if it has not started
            with self._ready:
                if job in self._queue:
                    self._queue.remove(job)
            raise
        finally:
            self.pending -= 1

    async def close(self) -> None:
        """Wait for the running batch (the model must not be closed under it); drop the queued requests."""
        with self._ready:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._ready.notify()
        for job in dropped:
            job.future.cancel()
        await asyncio.to_thread(self._thread.join)

"""Decide on the model's compute thread, in batches of the requests waiting, behind a bounded admission count.

ClefModel.answer_batch is CPU-bound and runs on the model's compute thread (one llama.cpp context): handing it
there keeps the event loop answering (health, errors, new connections). A request is queued, and a drain is
submitted straight to the compute thread if none is running; the drain decides what waits, first come first
served, in the batches runtime/batching.py takes (the oldest, and the next ones in order while the model can
decide them together, in one backbone prefill), until nothing waits. There is no batching window: an idle server
decides a request at once, and a busy one batches what arrived during the previous batch. Admission is bounded,
so a burst gets a prompt 503 with Retry-After (which typesafe-sdk honours) instead of an unbounded queue and
unbounded memory.

ComputeScheduler is the app's Scheduler for a model in this process (runtime/protocols.py's Model); on Ray Serve,
server/ray_serve.py's ReplicaScheduler hands each prompt to a replica, which decides on a ComputeScheduler of its own.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..runtime.answers import Answer
from ..runtime.batching import each, take
from ..runtime.protocols import Model, Prompt, Steps
from .decision import Decision
from .problems import ApiError, overloaded


def render(response: dict[str, Any]) -> bytes:
    # allow_nan=False: a NaN can never reach a client as the invalid token NaN.
    return json.dumps(response, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _rendered(answer: Answer | Exception) -> bytes | Exception:
    if isinstance(answer, Exception):
        return answer
    try:
        return render(answer.body)
    except (TypeError, ValueError) as e:
        return e


def queue_full(pending: int) -> ApiError:
    return overloaded(f"{pending} requests are already waiting; retry shortly")


@dataclass(eq=False)
class _Job:
    prompt: Prompt
    submitted: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Decision] = field(init=False)

    def __post_init__(self) -> None:
        self.future = self.loop.create_future()

    def settle(self, decision: Decision | None, error: BaseException | None = None) -> None:
        """From the compute thread: hand the outcome to the waiting coroutine (gone if it was cancelled)."""

        def done() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(decision)  # type: ignore[arg-type]

        self.loop.call_soon_threadsafe(done)


def _model_of(job: _Job) -> str:
    return job.prompt.identity  # (a batch is one model's)


class ComputeScheduler:
    """The Scheduler of a model in this process: its decisions batched on the model's compute thread."""

    def __init__(self, model: Model, max_queue: int) -> None:
        self.model = model
        self.max_queue = max_queue
        self.pending = 0  # admitted and not yet answered; touched on the event loop only
        self._queue: deque[_Job] = deque()
        self._lock = threading.Lock()  # guards _queue, _drain and _closed
        self._drain: Future[None] | None = None  # the drain submitted to the compute thread, while there is one
        self._closed = False
        self._last: object = None  # the model of the batch decided last (take: another model's waiting request goes first)

    def _fits(self, batch: list[_Job], job: _Job) -> bool:
        return self.model.batchable([*(j.prompt for j in batch), job.prompt])

    def _ready(self, job: _Job) -> bool:
        return self.model.batchable([job.prompt])  # (beside the prompt decided in steps)

    def _drain_queue(self) -> None:
        """On the model's compute thread: decide what waits, batch by batch, until nothing does.

        Fairness: after a batch of one model, the oldest request of another model waiting goes next (batching.take):
        a cold adapter's request waits about one batch of a hot one, not all that waits for it. A prompt longer than
        a ubatch (Model.stepped) is decided in steps of a ubatch, and between two of its steps the oldest batch
        waiting that fits beside it is decided; other long prompts wait
        for its end. A small request behind a long one waits about a ubatch of its prefill, not all of it."""
        stepping: tuple[_Job, Steps, float] | None = None  # the long prompt decided in steps now, and its start
        try:
            while True:
                with self._lock:  # (emptiness and the drain's end in one step: a request queued after it submits a new one)
                    if stepping is None and (not self._queue or self._closed):
                        self._drain = None
                        return
                    ready = None if stepping is None else self._ready
                    batch = [] if self._closed else take(self._queue, self._fits, _model_of, ready, self._last)
                    self._last = batch[0].prompt.identity if batch else self._last
                if stepping is None and len(batch) == 1 and self.model.stepped(batch[0].prompt):
                    stepping = self._begin(batch[0])
                elif batch:
                    self._run(batch)
                if stepping is not None and self._step(*stepping):
                    stepping = None
        finally:
            if stepping is not None:  # (the drain failed: its sequence is given back all the same)
                stepping[1].finish()

    def _begin(self, job: _Job) -> tuple[_Job, Steps, float] | None:
        started = time.perf_counter()
        try:
            return job, self.model.begin(job.prompt), started
        except Exception as e:  # (a prompt begin refuses: its error alone)
            job.settle(None, e)
            return None

    def _step(self, job: _Job, steps: Steps, started: float) -> bool:
        """One step of the long prompt: True once it is answered."""
        try:
            answer = steps.step()
        except Exception as e:
            steps.finish()
            answer = e
        if answer is not None:
            self._run([job], [answer], started)
        return answer is not None

    def _run(self, batch: list[_Job], answers: list[Answer | Exception] | None = None, started: float = 0.0) -> None:
        """Decide a batch (or hand back the answers given, of a batch begun at `started`); a failure is its batch's."""
        try:
            self._settle(batch, answers, started)
        except Exception as e:  # a failure handing answers back is its batch's; the drain goes on
            for job in batch:
                job.settle(None, e)

    def _settle(self, batch: list[_Job], answers: list[Answer | Exception] | None, started: float) -> None:
        if answers is None:
            started = time.perf_counter()
            answers = each(self.model.answer_batch, [job.prompt for job in batch])
        bodies = [_rendered(a) for a in answers]  # (an error here is its request's alone)
        finished = time.perf_counter()
        leads = True  # (the batch is counted once, with its first decision: metrics.py)
        for job, answer, body in zip(batch, answers, bodies, strict=True):
            if isinstance(body, Exception):
                job.settle(None, body)
                continue
            assert isinstance(answer, Answer)
            queued, cached = started - job.submitted, answer.cached_tokens
            job.settle(Decision(body, queued, finished - started, finished, cached, len(batch), leads))
            leads = False

    async def decide(self, request: Prompt) -> Decision:
        if self.pending >= self.max_queue:
            raise queue_full(self.pending)
        self.pending += 1
        job = _Job(request, time.perf_counter(), asyncio.get_running_loop())
        try:
            with self._lock:
                if self._closed:
                    raise overloaded("the server is stopping")
                self._queue.append(job)
                if self._drain is None:
                    self._drain = self.model.submit(self._drain_queue)
            return await job.future
        except asyncio.CancelledError:  # client gone, drain timeout: the job is dropped if it has not started
            with self._lock:
                if job in self._queue:
                    self._queue.remove(job)
            raise
        finally:
            self.pending -= 1

    async def close(self) -> None:
        """Wait for the running batch (the model must not be closed under it); drop the queued requests."""
        with self._lock:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            drain = self._drain
        for job in dropped:
            job.future.cancel()
        if drain is not None:
            await asyncio.wrap_future(drain)

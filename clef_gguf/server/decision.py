"""A decision as the app sees it: the `Decision` (its response's bytes, its timings, its cached tokens) and the
`Scheduler` that makes it (server/worker.py's ComputeScheduler in this process, server/ray_serve.py's ReplicaScheduler
on Ray). Apart from the worker, so that what reads decisions (metrics.py, observe.py) imports neither the worker nor
the error table's renderings (problems.py) that the worker answers a full queue with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..runtime.protocols import Prompt

if TYPE_CHECKING:  # (adapter_metrics imports none of the server's modules; the annotation alone names it)
    from .adapter_metrics import Snapshot


@dataclass(frozen=True)
class Decision:
    body: bytes  # the response JSON, UTF-8
    queued_s: float
    decide_s: float
    finished: float  # perf_counter() when decide returned, to time the hand-back to the event loop
    cached_tokens: int = 0  # prompt tokens whose backbone state the state cache gave
    batch: int = 1  # requests decided together with this one, itself included
    leads: bool = True  # the first of its batch's decisions handed back: the one that counts the batch (metrics.py)
    # On Ray: the replica that decided it and its per-adapter counts, when they changed since it last sent them.
    adapters: tuple[str, Snapshot] | None = None


class Scheduler(Protocol):
    """How the app has prompts decided: server/worker.py's ComputeScheduler, or server/ray_serve.py's ReplicaScheduler."""

    @property
    def pending(self) -> int: ...  # admitted and not yet answered

    async def decide(self, request: Prompt) -> Decision: ...  # raises ApiError 503 when max_queue are admitted

    async def close(self) -> None: ...

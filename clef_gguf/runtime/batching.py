"""Which prompts are decided together, and what a batch's failure means for them.

One scheduler for the two places that decide many prompts: the server's DecideWorker (requests as they wait)
and decide_many (a dataset's window). Both take the oldest item and then the next ones in order while the model
can decide them together (ClefModel.batchable: one backbone prefill), and both give a batch's own exception
(a llama.cpp failure) to each of its prompts, the others going on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def take(waiting: deque[T], fits: Callable[[list[T], T], bool]) -> list[T]:
    """Pop the oldest of `waiting` (not empty), then the next ones in order while fits(batch, next)."""
    batch = [waiting.popleft()]
    while waiting and fits(batch, waiting[0]):
        batch.append(waiting.popleft())
    return batch


def each(decide: Callable[[Sequence[T]], Sequence[R | Exception]], batch: Sequence[T]) -> list[R | Exception]:
    """decide(batch): one outcome per item, in order; the batch's own exception is each item's outcome."""
    try:
        return list(decide(batch))
    except Exception as e:
        return [e] * len(batch)

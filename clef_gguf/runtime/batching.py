"""Which prompts are decided together, and what a batch's failure means for them.

One scheduler for the two places that decide many prompts: the server's ComputeScheduler (requests as they wait)
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


def take(
    waiting: deque[T],
    fits: Callable[[list[T], T], bool],
    model: Callable[[T], object] | None = None,
    ready: Callable[[T], bool] | None = None,
    last: object = None,
) -> list[T]:
    """Pop the oldest of `waiting` (not empty), then the next ones in order while fits(batch, next).

    With `model` (an item's model: the base or one of its adapters), items of other models are passed over and
    stay waiting in their order: a batch is one model's (the context applies one adapter at a time), and the oldest
    request's model goes first, so that no model starves while the batches follow their models, not their arrival.
    With `last` (the model of the batch decided before), the oldest item of another model goes first when one
    waits: a model with many clients does not hold the context batch after batch while another's request waits
    behind all of its own, which would wait as long as they do. With `ready`, the items it refuses now (the
    server's long prompts while one is decided in steps) are passed over the same way, the oldest ready one going
    first; none ready: an empty batch."""

    def passed_first(item: T) -> bool:
        return (ready is not None and not ready(item)) or (model is not None and last is not None and model(item) == last)

    passed: list[T] = []
    while waiting and passed_first(waiting[0]):
        passed.append(waiting.popleft())
    if not waiting and last is not None:  # nothing of another model is ready: the last model's oldest ready item goes
        waiting.extendleft(reversed(passed))
        return take(waiting, fits, model, ready)
    batch = [waiting.popleft()] if waiting else []
    while waiting and batch:
        if (model is not None and model(waiting[0]) != model(batch[0])) or (ready is not None and not ready(waiting[0])):
            passed.append(waiting.popleft())
            continue
        if not fits(batch, waiting[0]):
            break
        batch.append(waiting.popleft())
    waiting.extendleft(reversed(passed))
    return batch


def each(decide: Callable[[Sequence[T]], Sequence[R | Exception]], batch: Sequence[T]) -> list[R | Exception]:
    """decide(batch): one outcome per item, in order; the batch's own exception is each item's outcome."""
    try:
        return list(decide(batch))
    except Exception as e:
        return [e] * len(batch)

"""Deciding many requests: `model.decide_many(requests)`, one answer per request, in order.

The model decides them in batches (ClefModel.answer_batch, the server's own answer path: the prompts that are
`batchable`, prefilled in the same llama_decode calls), and its state cache serves every request after the first
about a state. With `sort_by_state` the requests of each window are decided grouped by state, so that a state
repeated far apart is still in the cache; the answers still come in input order.

A request that cannot be decided gets the error object the server answers it with ({"status", "detail"}:
runtime/failures.py, by the error table of errors.py), and the others go on.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..errors import PromptTooLongError, RequestError
from .answers import Scores
from .batching import each, take
from .failures import error_object, problem_of
from .prompt import EncodedPrompt
from .protocols import DecidingModel
from .reader import parse_json, read_image
from .state_cache import prefix_key, split_at_prefix

# Requests read ahead and reordered by state with sort_by_state: enough for a dataset's repeated states to meet,
# few enough that their encoded prompts (images included) stay small and an interrupted run loses little.
SORT_WINDOW = 256
Tag = TypeVar("Tag")  # what a request carries through decide_outcomes back to its outcome: a file's record, say


@dataclass(frozen=True)
class Outcome:
    """A request's answer (the response body) or its error object, with what the progress counts."""

    response: dict[str, Any] | None
    error: dict[str, Any] | None
    request: Any  # the parsed request (None: not JSON)
    tokens: int = 0
    state_hit: bool = False  # its state's backbone state came from the state cache
    scores: Scores | None = None  # the response's probabilities, unrounded
    reason: str | None = None  # the error in one line

    @classmethod
    def failed(cls, error: Exception, request: Any) -> Outcome:
        """A request that could not be decided: the server's error object for it, and that error in one line."""
        problem = problem_of(error, request)
        return cls(None, error_object(problem), request, reason=problem.text())

    def answer(self) -> dict[str, Any]:
        """What decide_many yields: the response body, or {"error": the error object}."""
        return self.response if self.response is not None else {"error": self.error}


def request_sha256(raw: bytes) -> str:
    """The digest an answer line carries of its request line (its bytes, without the line ending)."""
    return hashlib.sha256(raw).hexdigest()


def _is_path(image: Any) -> bool:
    # A data URL, bare base64 (whose alphabet has no "."), a remote URL (refused by images.py): not a path.
    return isinstance(image, str) and "." in image and not image.startswith("data:") and "://" not in image


def with_image_files(request: Any, base: Path, anywhere: bool = False) -> Any:
    """The request with each image given as a file path (relative to `base`) read as the CLI's --image files are
    (runtime/reader.read_image: a regular file, at most 4 MiB). Raises RequestError naming the image.

    A path must stay inside `base` (symbolic links resolved) unless `anywhere`: a dataset from elsewhere cannot read
    the machine's other files, nor tell by its errors which of them exist (the refusal comes before any look)."""
    images = request.get("images") if isinstance(request, dict) else None
    if not isinstance(images, list) or not any(_is_path(image) for image in images):
        return request
    read = []
    inside = base.resolve()
    for i, image in enumerate(images):
        if not _is_path(image):
            read.append(image)
            continue
        path = base / image
        if not anywhere and not path.resolve().is_relative_to(inside):
            raise RequestError(
                "an image path must stay inside the JSON Lines file's folder (--allow-image-paths-anywhere lifts this)",
                f"images.{i}",
            )
        try:
            read.append(read_image(path))
        except RequestError as e:
            raise RequestError(e.reason, f"images.{i}") from None
    return {**request, "images": read}


def _state_key(prompt: EncodedPrompt) -> bytes:
    """What requests about one state share: the tokens up to the end of the state, and the images before it."""
    return prefix_key(
        prompt.tokens[: prompt.state_prefix],
        [p.image.digest for p in prompt.images if p.start < prompt.state_prefix],
        prompt.identity,
    )


def _cached_state(prompt: EncodedPrompt) -> bool:
    """Whether the model's state cache keeps this prompt's state (state_cache.cuts cuts it there)."""
    return split_at_prefix(prompt.state_prefix, len(prompt.tokens))


class _Window:
    """Requests read and encoded, waiting for their batch; outcomes kept until they can be given in order, each with
    its request's tag."""

    def __init__(self, model: DecidingModel, items: list[tuple[Any, Any]], base: Path | None, anywhere: bool = False) -> None:
        self.model = model
        self.tags = [tag for tag, _ in items]
        self.outcomes: list[Outcome | None] = [None] * len(items)
        self.prompts: dict[int, EncodedPrompt] = {}
        self.parsed: list[Any] = [None] * len(items)
        for i, (_, request) in enumerate(items):
            if isinstance(request, Outcome):  # answered before it came (a line over the limit): given in its place
                self.outcomes[i] = request
                continue
            try:
                # Parsed first: a request whose images cannot be read keeps its own id in its error line.
                self.parsed[i] = value = parse_json(request) if isinstance(request, bytes) else request
                if base is not None:
                    value = with_image_files(value, base, anywhere)
                prompt = model.encode(value)
                if len(prompt.tokens) > model.max_prompt_tokens:  # refused before any compute, as the server does
                    raise PromptTooLongError(len(prompt.tokens), model.max_prompt_tokens)
                self.prompts[i] = prompt
            except RequestError as e:
                self.outcomes[i] = Outcome.failed(e, self.parsed[i])

    def order(self, by_state: bool) -> list[int]:
        todo = sorted(self.prompts)
        if not by_state:
            return todo
        first: dict[bytes, int] = {}  # each state's groups in the order the state first appears
        for i in todo:
            first.setdefault(_state_key(self.prompts[i]), i)
        return sorted(todo, key=lambda i: first[_state_key(self.prompts[i])])

    def batches(self, order: list[int]) -> Iterator[list[int]]:
        """The requests in `order`, in batches the model decides together (runtime/batching.py)."""
        waiting = deque(order)
        while waiting:
            yield take(waiting, self._fits, lambda i: self.prompts[i].identity)

    def _fits(self, batch: list[int], i: int) -> bool:
        """Whether request i joins the batch: never two about one state the cache does not hold yet, which would
        both prefill it, where apart the second one restores it."""
        prompt = self.prompts[i]
        if _cached_state(prompt):
            key = _state_key(prompt)
            if key not in self.model.state_cache and any(key == _state_key(self.prompts[j]) for j in batch):
                return False
        return self.model.batchable([*(self.prompts[j] for j in batch), prompt])

    def decide(self, batch: list[int]) -> None:
        prompts = [self.prompts.pop(i) for i in batch]
        answers = each(self.model.answer_batch, prompts)
        for i, prompt, answer in zip(batch, prompts, answers, strict=True):
            if isinstance(answer, Exception):
                self.outcomes[i] = Outcome.failed(answer, self.parsed[i])
                continue
            hit = _cached_state(prompt) and answer.cached_tokens >= prompt.state_prefix
            self.outcomes[i] = Outcome(answer.body, None, self.parsed[i], len(prompt.tokens), hit, answer.scores)


def _windows(items: Iterable[tuple[Any, Any]], size: int) -> Iterator[list[tuple[Any, Any]]]:
    """The items in windows of `size` requests to decide (an Outcome given in a request's place counts in none).
    When the source raises, the items taken before are still a window, and the exception comes after it: every
    request taken is answered before the source's error passes on."""
    window: list[tuple[Any, Any]] = []
    undecided = 0
    try:
        for item in items:
            window.append(item)
            undecided += not isinstance(item[1], Outcome)
            if undecided == size:
                yield window
                window, undecided = [], 0
    except Exception:
        if window:
            yield window
        raise
    if window:
        yield window


def _decided(window: _Window, sort_by_state: bool) -> Iterator[tuple[Any, Outcome]]:
    given = 0
    for batch in window.batches(window.order(sort_by_state)):
        window.decide(batch)
        while given < len(window.outcomes) and window.outcomes[given] is not None:
            yield window.tags[given], window.outcomes[given]  # type: ignore[misc]
            given += 1
    yield from zip(window.tags[given:], window.outcomes[given:], strict=True)  # type: ignore[misc]  # (errors after the last batch)


def decide_outcomes(
    model: DecidingModel,
    items: Iterable[tuple[Tag, Any]],
    *,
    sort_by_state: bool = False,
    base: Path | None = None,
    anywhere: bool = False,
) -> Iterator[tuple[Tag, Outcome]]:
    """For each (tag, request) item, in order, its tag and its request's Outcome; see decide_many. The tag (a file's
    record, a labelled record) comes back untouched with its outcome. A request given as an Outcome was answered before
    it came (a line over the limit, unread): it comes back in its place and counts in no window. Each is given as
    soon as it and those before it are decided (with sort_by_state: its window's).

    The next window is read, parsed and tokenized on a thread of its own while this one is decided, as the
    server's intake threads do (ClefModel.encode is thread-safe and computes nothing): the compute thread
    does not wait for the template and the tokenizer between batches."""
    windows = _windows(items, SORT_WINDOW if sort_by_state else model.parallel)

    def read_next() -> _Window | None:
        items_now = next(windows, None)
        return None if items_now is None else _Window(model, items_now, base, anywhere)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-read") as reader:
        upcoming = reader.submit(read_next)
        while (window := upcoming.result()) is not None:
            upcoming = reader.submit(read_next)
            yield from _decided(window, sort_by_state)


def decide_many(
    model: DecidingModel, requests: Iterable[Any], *, sort_by_state: bool = False, base: Path | None = None
) -> Iterator[dict[str, Any]]:
    """Decide requests (request bodies, or JSON texts as bytes, read as strictly as the server reads a body):
    for each, in order, its response body or {"error": {"status", "detail"}}, the error the server answers it
    with. `base`: a folder that image file paths in the requests' `images` are relative to (None: no paths)."""
    for _, outcome in decide_outcomes(model, ((None, request) for request in requests), sort_by_state=sort_by_state, base=base):
        yield outcome.answer()

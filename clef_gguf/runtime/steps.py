"""A long prompt prefilled a ubatch at a time, so that small requests are decided between its steps.

The server's compute thread is one (ClefModel.compute): a prompt of thousands of tokens would hold it for its
whole prefill, and a small request behind it would wait that long. ClefModel.begin(prompt) (Decider.begin) reserves the
context's last sequence for it; each step() decodes one ubatch of it there (runtime/prefill.py's Run: the same
ubatches, cuts and saved states as deciding it alone), and between two steps the server decides the batches
waiting on the other sequences (server/worker.py), never clearing the reserved one. The last step runs its
model's head and gives the answer (Decider.answers, as a batch's).

Each step applies its own prompt's adapter (Decider.activate): a batch of another model between two steps
switches the context's LoRA twice, which makes llama.cpp reserve its graphs again on the next decode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ..errors import ComputeError
from .answers import Answer
from .prefill import Run
from .prompt import EncodedPrompt

if TYPE_CHECKING:
    from .decider import Decider

# A decode that writes a non-finite value makes the next clear wipe the whole memory (Backbone.clear), the
# reserved sequence with it: the prompt is prefilled again from its start (or its cached cut), once.
RESTARTS = 1
T = TypeVar("T")


class PromptSteps:
    """One prompt's decision in steps (ClefModel.begin): step() until it returns the answer (or the prompt's error)."""

    def __init__(self, decider: Decider, prompt: EncodedPrompt, call: Callable[[Callable[[], T]], T]) -> None:
        self.decider, self.prompt, self._call = decider, prompt, call  # call: fn() on the compute thread, the model open
        self.seq = decider.backbone.parallel - 1  # the batches between its steps take the sequences before it
        self.run: Run | None = None
        self.restarts = 0
        self.done = False

    def step(self) -> Answer | Exception | None:
        """Decode the next ubatch: None while some are left, then the answer (or the prompt's exception)."""
        if self.done:
            raise ComputeError("this prompt's steps are over: its answer was given")
        try:
            answer = self._call(self._step)
        except Exception as e:  # a llama.cpp failure in a step (or the model closed): this prompt's alone
            answer = e
        if answer is not None:
            self.finish()
        return answer

    def _step(self) -> Answer | Exception | None:
        head = self.decider.activate(self.prompt)  # its LoRA applied again after a batch of another model
        if self.run is not None and self.run.cleared:
            if self.restarts >= RESTARTS:
                raise ComputeError("the context's memory was reset during this prompt's prefill, twice (non-finite values)")
            self.restarts, self.run = self.restarts + 1, None
        if self.run is None:  # nothing else is decoding when it starts: every sequence is cleared
            self.run = self.decider.prefill.start([self.prompt], [self.seq])
        if not self.run.step():
            return None
        [answer] = self.decider.answers(head, [self.prompt], self.run.out)
        return answer

    def finish(self) -> None:
        """Give the reserved sequence back; the answer is not computed if it was not."""
        if not self.done:
            self.done = True
            self.decider.end_steps(self)

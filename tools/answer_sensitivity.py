"""How far answers move when a request's question ids are renamed, questions are added, or reordered.

    python tools/answer_sensitivity.py            # the test fixtures (tiny random Clef releases)
    python tools/answer_sensitivity.py --model clef-flash-q8_0.gguf

A Clef prompt holds every question's id, its instructions and its options, in request order,
and the joint schema head decides all fields together: the same question can get a different
answer when its id, its neighbours or their order change. The server sends requests to the model
as they come (as the reference does) and this script measures the effect, for each variant of
each request, over the questions the variant shares with the original:

- max |dp|: the largest change of any option probability (noul: of p(true));
- flips: choice or score-mode answers that changed, out of those compared;
- max |dscore|: the largest change of a score's expected value.

The fixtures have random weights: their figures show that the effect exists and its order of
magnitude on these models, not how a trained Clef behaves. Run it on a real file for that.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import clef_gguf  # noqa: E402
from clef_gguf.testing.request_suite import long_state_request, many_questions_request, mixed_request, ten_level_score_request  # noqa: E402

Request = dict[str, Any]
EXTRA = {"type": "noul", "instructions": "Is the text written in the passive voice?"}


def _questions(request: Request, questions: dict[str, Any]) -> Request:
    return {**request, "questions": questions}


# Each variant returns the new request and, per original id, the id that question has in it.
Variant = Callable[[Request], tuple[Request, dict[str, str]]]


def renamed(request: Request) -> tuple[Request, dict[str, str]]:
    ids = {qid: f"field_{i}" for i, qid in enumerate(request["questions"])}
    return _questions(request, {ids[qid]: q for qid, q in request["questions"].items()}), ids


def reversed_order(request: Request) -> tuple[Request, dict[str, str]]:
    return _questions(request, dict(reversed(request["questions"].items()))), {qid: qid for qid in request["questions"]}


def shuffled(request: Request) -> tuple[Request, dict[str, str]]:
    items = list(request["questions"].items())
    random.Random(0).shuffle(items)
    return _questions(request, dict(items)), {qid: qid for qid in request["questions"]}


def added_last(request: Request) -> tuple[Request, dict[str, str]]:
    return _questions(request, {**request["questions"], "zz_extra": EXTRA}), {qid: qid for qid in request["questions"]}


def added_first(request: Request) -> tuple[Request, dict[str, str]]:
    return _questions(request, {"aa_extra": EXTRA, **request["questions"]}), {qid: qid for qid in request["questions"]}


VARIANTS: dict[str, Variant] = {
    "ids renamed (field_i)": renamed,
    "order reversed": reversed_order,
    "order shuffled": shuffled,
    "a question added last": added_last,
    "a question added first": added_first,
}


@dataclass
class Movement:
    max_dp: float = 0.0
    max_dscore: float = 0.0
    flips: int = 0
    compared: int = 0  # choice and score answers

    def add(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        if before["type"] == "noul":
            self.max_dp = max(self.max_dp, abs(before["noul"] - after["noul"]))
            return
        p, q = before["probabilities"], after["probabilities"]
        self.max_dp = max(self.max_dp, *(abs(p[k] - q[k]) for k in p))
        self.compared += 1
        if before["type"] == "choice":
            self.flips += before["choice"] != after["choice"]
        else:
            self.max_dscore = max(self.max_dscore, abs(before["score"] - after["score"]))
            self.flips += max(p, key=p.__getitem__) != max(q, key=q.__getitem__)

    def merge(self, other: Movement) -> None:
        self.max_dp = max(self.max_dp, other.max_dp)
        self.max_dscore = max(self.max_dscore, other.max_dscore)
        self.flips += other.flips
        self.compared += other.compared


def alone(model: clef_gguf.ClefModel, request: Request, base: dict[str, Any]) -> Movement:
    """Each question asked on its own, against its answer in the joint request."""
    movement = Movement()
    for qid, question in request["questions"].items():
        movement.add(base["answers"][qid], model.decide(_questions(request, {qid: question}))["answers"][qid])
    return movement


def measure(model: clef_gguf.ClefModel, requests: dict[str, Request]) -> dict[str, Movement]:
    totals = {name: Movement() for name in [*VARIANTS, "each question alone"]}
    for request in requests.values():
        base = model.decide(request)
        for name, variant in VARIANTS.items():
            changed, ids = variant(request)
            answers = model.decide(changed)["answers"]
            movement = Movement()
            for qid in request["questions"]:
                movement.add(base["answers"][qid], answers[ids[qid]])
            totals[name].merge(movement)
        if len(request["questions"]) <= 8:
            totals["each question alone"].merge(alone(model, request, base))
    return totals


def fixture_models(root: Path) -> dict[str, Path]:
    from clef_gguf.testing.release_builder import ReleaseSpec, build_release

    specs = {"untied_f32": ReleaseSpec(seed=0), "tied_bf16": ReleaseSpec(seed=1, tied=True, dtype="bfloat16")}
    return {name: clef_gguf.convert(build_release(root / name, s), root / f"{name}.gguf", "f32") for name, s in specs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, action="append", help="a Clef GGUF (repeatable; default: the test fixtures)")
    args = parser.parse_args()
    requests = {
        "mixed": mixed_request(),
        "ten_level_score": ten_level_score_request(),
        "long_state": long_state_request(),
        "many_questions": many_questions_request(24),
    }
    with tempfile.TemporaryDirectory() as tmp:
        models = {path.stem: path for path in args.model} if args.model else fixture_models(Path(tmp))
        print("| model | variant | max abs dp | max abs dscore | choice/score flips |")
        print("| --- | --- | ---: | ---: | ---: |")
        for name, path in models.items():
            with clef_gguf.load(path, max_prompt_tokens=8192) as model:
                for variant, m in measure(model, requests).items():
                    print(f"| {name} | {variant} | {m.max_dp:.4f} | {m.max_dscore:.4f} | {m.flips}/{m.compared} |", flush=True)


if __name__ == "__main__":
    main()

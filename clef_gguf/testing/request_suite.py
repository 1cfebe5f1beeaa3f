"""Deterministic SystemOne request bodies for parity tests.

Named request_suite, not requests, so that tests/ on sys.path never shadows the
``requests`` library that huggingface_hub and others import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..quality.labelled import BadLine, read_labelled

MODEL = "jev-latest"
LABELLED = Path(__file__).resolve().parents[2] / "examples" / "labelled.jsonl"  # the checkout's: for its tests
Request = dict[str, Any]


def _request(state: Any, questions: dict[str, Any]) -> Request:
    return {"model": MODEL, "state": state, "questions": questions}


def mixed_request() -> Request:
    """Every question type and every shape of instructions and criteria, unicode ids."""
    questions = {
        "is_spam": {"type": "noul", "instructions": "Is this message unsolicited spam?"},
        "état": {
            "type": "noul",
            "instructions": {"ask": "Le client est-il satisfait ?", "lang": "fr"},
            # One-sided criteria: "false" keeps the reference's default description.
            "criteria": {"true": "The customer says they are happy."},
        },
        "category": {
            "type": "choice",
            "instructions": ["Pick the department", "that should handle this."],
            "criteria": {
                "billing": "Payments, invoices and refunds.",
                "technical": "Bugs, outages and errors.",
                "sales": "Pricing and new purchases.",
            },
        },
        "是否": {
            "type": "choice",
            "instructions": None,  # falls back to the question id
            "criteria": {
                "🙂": None,
                "neutral": {"tone": "flat", "weight": 0.5},
                "négatif": ["angry", "upset", 3],
            },
        },
        "severity": {
            "type": "score",
            "instructions": "How severe is the reported problem?",
            "criteria": ["none", "minor", "moderate", "major", "critical"],
        },
    }
    state = {
        "channel": "email",
        "message": "Bonjour, my invoice #4821 was charged twice — café order. 请尽快处理 🙏",
        "customer": {"name": "Zoë", "tier": "gold", "orders": [17, 42]},
        "flagged": False,
    }
    return _request(state, questions)


def many_questions_request(count: int = 64) -> Request:
    """Many questions of all three types in one request."""
    questions: dict[str, Any] = {}
    for index in range(count):
        kind = ("noul", "choice", "score")[index % 3]
        question: dict[str, Any] = {"type": kind, "instructions": f"Question {index}: judge item {index}."}
        if kind == "choice":
            question["criteria"] = {f"opt_{index}_{letter}": f"Option {letter}" for letter in "abcd"[: 2 + index % 3]}
        elif kind == "score":
            question["criteria"] = [f"level {level}" for level in range(3 + index % 4)]
        questions[f"q{index:02d}"] = question
    state = {"items": [{"id": index, "text": f"item number {index}"} for index in range(16)]}
    return _request(state, questions)


def wide_choice_request(options: int = 255) -> Request:
    """One choice with many options."""
    # Unpadded ids: the reference sorts them as strings (option_0, option_1,
    # option_10, option_100, ...), which a numeric sort would get wrong.
    # Mostly null descriptions keep the prompt at a few thousand tokens.
    criteria = {f"option_{index}": f"kind {index % 17}" if index % 8 == 0 else None for index in range(options)}
    question = {"type": "choice", "instructions": "Which label fits the ticket?", "criteria": criteria}
    return _request("Ticket: the printer on floor 3 prints blank pages.", {"label": question})


def ten_level_score_request() -> Request:
    levels = [f"{level}/9: " + ("very " * (level % 3)) + "strong" for level in range(10)]
    question = {"type": "score", "instructions": "Rate the urgency.", "criteria": levels}
    return _request({"text": "Server down since 3 am, customers cannot pay."}, {"urgency": question})


_LONG_STATE_PARTS = (
    "Paragraph {index}: the customer wrote again about order {order} and asked for a refund.",
    " Le café était froid, la crème brûlée aussi; cafe\u0301 and e\u0301tat are NOT NFC here.",
    " 这是第{index}段，客户要求退款。日本語も少し。한국어도 조금.",
    " Emoji row: 🙂🚀👍🏽 ❤️ — totals: {order}.{index} EUR, {index}% done.\n",
)


def long_state_text(paragraphs: int = 18) -> str:
    """A long mixed-unicode text (about 3,000 tokens with the tiny tokenizer)."""
    text = ""
    for index in range(paragraphs):
        order = 10_000 + 37 * index
        text += "".join(part.format(index=index, order=order) for part in _LONG_STATE_PARTS)
    return text


def long_state_request(paragraphs: int = 18) -> Request:
    questions = {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "language": {
            "type": "choice",
            "instructions": "Main language of the state.",
            "criteria": {"en": "English", "fr": "French", "zh": "Chinese"},
        },
        "anger": {"type": "score", "instructions": "How angry?", "criteria": ["calm", "annoyed", "furious"]},
    }
    return _request(long_state_text(paragraphs), questions)


# Option counts at every edge of llama.cpp's temperature buckets (2 | 3..5 | 6..10 | 11..: format/temperatures.py).
BUCKET_EDGES = (2, 3, 5, 6, 10, 11, 255)


def temperature_buckets_request() -> Request:
    """A choice question at each bucket edge, a noul, and scores of 3 and 7 levels: every temperature lookup."""
    questions: dict[str, Any] = {
        f"c{n}": {"type": "choice", "criteria": {f"o{i:03d}": None for i in range(n)}} for n in BUCKET_EDGES
    }
    questions |= {"yes": {"type": "noul"}, "s3": {"type": "score", "criteria": ["a", "b", "c"]}}
    questions["s7"] = {"type": "score", "criteria": [str(i) for i in range(7)]}
    return _request({"ticket": "The parcel is late again."}, questions)


def all_requests() -> dict[str, Request]:
    """The whole suite by name, for parametrized tests."""
    return {
        "mixed": mixed_request(),
        "many_questions": many_questions_request(),
        "wide_choice": wide_choice_request(),
        "ten_level_score": ten_level_score_request(),
        "long_state": long_state_request(),
    }


def labelled_requests(n: int) -> list[Request]:
    """The first n requests of examples/labelled.jsonl (of its lines that parse)."""
    with open(LABELLED, "rb") as file:
        return [r.request for r in read_labelled(file) if not isinstance(r, BadLine)][:n]


def flat_probabilities(response: dict[str, Any]) -> list[float]:
    """A SystemOne response's probabilities in one list, question after question (a noul's: its p(true))."""
    out = []
    for answer in response["answers"].values():
        out += [answer["noul"]] if "noul" in answer else list(answer["probabilities"].values())
    return out


def response_probabilities(response: dict[str, Any]) -> dict[str, dict[str, float]]:
    """A SystemOne response's probabilities per question: option -> p (a noul's as true and false)."""
    out = {}
    for qid, answer in response["answers"].items():
        out[qid] = {"true": answer["noul"], "false": 1 - answer["noul"]} if answer["type"] == "noul" else answer["probabilities"]
    return out


def largest_difference(ours: dict[str, dict[str, float]], theirs: dict[str, dict[str, float]]) -> float:
    """max |p - p'| over every option of two answers to the same questions (asserted: the same questions and options)."""
    assert ours.keys() == theirs.keys()
    for qid in ours:
        assert ours[qid].keys() == theirs[qid].keys(), qid
    return max(abs(p - theirs[qid][option]) for qid, options in ours.items() for option, p in options.items())


def within(ours: Any, theirs: Any, tolerance: float) -> bool:
    """Two JSON values alike but for numbers, which may differ by `tolerance` (answers decided in another batch)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(within(ours[k], theirs[k], tolerance) for k in ours)
    if isinstance(ours, list) and isinstance(theirs, list):
        return len(ours) == len(theirs) and all(within(a, b, tolerance) for a, b in zip(ours, theirs, strict=True))
    numbers = (int, float)
    if isinstance(ours, numbers) and isinstance(theirs, numbers) and not isinstance(ours, bool):
        return abs(ours - theirs) <= tolerance
    return ours == theirs

"""clef-finetune's labelled JSON Lines: one System One request per line, with `labels` and an optional `id`.

The conventions are clef-finetune 0.1.0's (its data.py), so that one file serves `clef-finetune train`/`eval` and
`clef-gguf eval`/`compare`/`calibrate`:
- noul: true / false, or the strings "true" / "false";
- choice: an option id, a key of `criteria`;
- score: an integer level 0..n-1 (an index into `criteria`), or its digit string.
A choice label matches its option in Unicode NFC too. A question without a label is still decided (it is part of
the prompt) but counts in no metric. A bad line is reported as `line N (id): what`, clef-finetune's form, and the
others go on.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from ..errors import RequestJsonError
from ..runtime.reader import Record, over_limit, parse_json, read_records
from ..settings import MAX_LINE_BYTES

QUESTION_TYPES = ("noul", "choice", "score")
MAX_DUPLICATE_LINES = 20


@dataclass(frozen=True)
class Labelled:
    """A record: its line, its id (its own, else the line number), the request, and each label as an option id."""

    line: int
    id: Any
    request: dict[str, Any]
    labels: dict[str, str]


@dataclass(frozen=True)
class BadLine:
    line: int
    id: Any
    errors: tuple[str, ...]

    def messages(self) -> list[str]:
        shown = "?" if self.id is None else self.id
        return [f"line {self.line} ({shown}): {e}" for e in self.errors]


def normalize_label(question: dict[str, Any], label: Any) -> str:
    """A raw label as an option id; ValueError saying why it is not one."""
    qtype = question["type"]
    if qtype == "noul":
        if isinstance(label, bool):
            return "true" if label else "false"
        if isinstance(label, str) and label.lower() in ("true", "false"):
            return label.lower()
        raise ValueError(f"noul label must be true/false, got {label!r}")
    if qtype == "choice":
        if not isinstance(label, str):
            raise ValueError(f"choice label must be a string option id, got {label!r}")
        return _choice_option(label, [str(k) for k in question["criteria"]])
    if isinstance(label, int) and not isinstance(label, bool):
        level = label
    elif isinstance(label, str) and label.strip().isdigit():
        level = int(label)
    else:
        raise ValueError(f"score label must be an integer level, got {label!r}")
    n = len(question["criteria"])
    if not 0 <= level < n:
        raise ValueError(f"score label {level} outside 0..{n - 1}")
    return str(level)


def _choice_option(label: str, options: list[str]) -> str:
    """The option `label` names: itself, or the one option that is the same text in Unicode NFC (the model reads
    prompts in NFC, so "cafe\u0301" and "caf\u00e9" are one option to it; an editor may have written either)."""
    if label in options:
        return label
    same = [o for o in options if unicodedata.normalize("NFC", o) == unicodedata.normalize("NFC", label)]
    if len(same) == 1:
        return same[0]
    if same:
        raise ValueError(f"choice label {label!r} is, in Unicode NFC, each of the options {same}: make them differ")
    raise ValueError(f"choice label {label!r} not in options {sorted(options)}")


def _question_errors(qid: str, question: Any) -> list[str]:
    if not isinstance(question, dict):
        return [f"{qid}: question must be an object"]
    qtype, criteria = question.get("type"), question.get("criteria")
    if qtype not in QUESTION_TYPES:
        return [f"{qid}: type must be one of {QUESTION_TYPES}, got {qtype!r}"]
    if qtype == "choice" and (not isinstance(criteria, dict) or len(criteria) < 2):
        return [f"{qid}: choice criteria must be an object with >=2 options"]
    if qtype == "score" and (not isinstance(criteria, list) or len(criteria) < 2):
        return [f"{qid}: score criteria must be a list with >=2 levels"]
    if qtype == "noul" and criteria is not None and (not isinstance(criteria, dict) or set(criteria) - {"true", "false"}):
        return [f"{qid}: noul criteria may only override 'true'/'false' descriptions"]
    return []


def check_record(record: Any, require_labels: bool) -> tuple[dict[str, str], list[str]]:
    """The record's labels as option ids, and what is wrong with it (clef-finetune's validate_record's checks)."""
    if not isinstance(record, dict):
        return {}, ["record must be a JSON object"]
    errors = [] if "state" in record else ["missing 'state'"]
    questions = record.get("questions")
    if not isinstance(questions, dict) or not questions:
        return {}, [*errors, "'questions' must be a non-empty object"]
    bad_questions = {qid for qid, q in questions.items() if _question_errors(qid, q)}
    for qid in bad_questions:
        errors += _question_errors(qid, questions[qid])
    labels = record.get("labels")
    if labels is None:
        return {}, [*errors, "missing 'labels'"] if require_labels else errors
    if not isinstance(labels, dict):
        return {}, [*errors, "'labels' must be an object"]
    if require_labels and not labels:
        errors.append("'labels' is empty")
    targets = {}
    for qid, label in labels.items():
        if qid not in questions:
            errors.append(f"label for unknown question {qid!r}")
        elif qid not in bad_questions:
            try:
                targets[qid] = normalize_label(questions[qid], label)
            except ValueError as e:
                errors.append(f"{qid}: {e}")
    return targets, errors


def read_labelled(
    file: IO[bytes], *, require_labels: bool = True, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[Labelled | BadLine]:
    """Each non-blank line of the file as a Labelled record, or the BadLine that says what is wrong with it.

    The lines are read as `decide` reads them (runtime/dataset_file.read_records: a byte order mark on line 1
    skipped, a line over max_line_bytes refused unread) and parsed as strictly (runtime/reader.parse_json)."""
    return labelled_records(read_records(file, max_line_bytes), require_labels=require_labels, max_line_bytes=max_line_bytes)


def labelled_records(
    records: Iterable[Record], *, require_labels: bool = True, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[Labelled | BadLine]:
    """read_labelled of records already read (a Ray worker's part of the file: quality/scoring_ray.py)."""
    for line in records:
        if line.over:
            yield BadLine(line.line, None, (over_limit(line, max_line_bytes),))
            continue
        try:
            record = parse_json(line.raw)
        except RequestJsonError as e:
            reason = f"invalid JSON: {str(e).removeprefix('JSON decode error: ')}" if e.kind == "json_invalid" else str(e)
            yield BadLine(line.line, None, (reason,))
            continue
        own = record.get("id") if isinstance(record, dict) else None
        shown = own if isinstance(own, (str, int)) and not isinstance(own, bool) else line.line
        labels, errors = check_record(record, require_labels)
        if errors:
            yield BadLine(line.line, shown, tuple(errors))
        else:
            yield Labelled(line.line, shown, record, labels)


def duplicates(records: Iterable[Labelled]) -> dict[str, Any]:
    """Records that share their own id: how many ids are repeated, how many of those label one question two ways,
    and a line for a person about each (the first MAX_DUPLICATE_LINES of them). A repeated record counts twice in
    every metric; contradictory labels cap the accuracy any model can reach, and a temperature fitted on them
    learns the disagreement."""
    lines_of: dict[Any, list[Labelled]] = {}
    for r in records:
        own = r.request.get("id")
        if own is not None and not isinstance(own, (dict, list)):
            lines_of.setdefault(own, []).append(r)
    repeated = {k: v for k, v in lines_of.items() if len(v) > 1}
    warnings, contradictory = [], 0
    for own, same in repeated.items():
        at = ", ".join(str(r.line) for r in same)
        labels = [(qid, label) for r in same for qid, label in r.labels.items()]
        clash = sorted({qid for qid, label in labels if any(o.labels.get(qid, label) != label for o in same)})
        contradictory += bool(clash)
        what = f"with contradictory labels for {', '.join(clash)}" if clash else "(same labels: counted twice)"
        warnings.append(f"id {own!r} is on lines {at} {what}")
    return {"duplicate_ids": len(repeated), "contradictory_ids": contradictory, "warnings": warnings[:MAX_DUPLICATE_LINES]}

"""`clef-gguf decide MODEL requests.jsonl -o answers.jsonl`: a JSON Lines file of requests decided into a JSON Lines
file of answers, one line per request line, in order, that survives being stopped at any point.

An answer line is the response body with three fields of its own in front (the response's fields are
model, answers and usage, so they never meet):
  id              the request's own "id" when it has one, else its line number;
  line            the request's line number in the input (1-based; blank lines are no request and get no answer);
  request_sha256  the SHA-256 of the request line's bytes (without its line ending);
and, for a request that could not be decided, `error` in place of the response: {"status", "detail"}, the
status and body the server answers it with (runtime/problems.py).

Nothing lost: each line is written whole and flushed as soon as it and the ones before it are decided, and the
file is fsynced every FSYNC_EVERY lines and at the end. --resume continues a file: its lines must be the
answers to the input's first requests, line number and digest alike (else AnswersFileError); a last line that
is not a whole answer (a torn write, a power cut's zeros) is cut off and decided again.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..errors import AnswersFileError, RequestError
from .dataset import Outcome, decide_outcomes, request_sha256

if TYPE_CHECKING:
    from .model import ClefModel

FSYNC_EVERY = 64
LINE_FIELDS = ("id", "line", "request_sha256")


@dataclass(frozen=True)
class Record:
    line: int  # 1-based
    raw: bytes  # without the line ending


@dataclass
class Summary:
    records: int = 0  # requests in the input (decided now, or answered before: skipped)
    skipped: int = 0  # answered by an earlier run (--resume)
    answered: int = 0  # answer lines in OUT that are responses (the earlier run's included)
    errors: int = 0  # and that are errors
    tokens: int = 0
    cache_hits: int = 0  # answered requests whose state the state cache gave
    seconds: float = 0.0
    out: str = "-"
    started: float = field(default_factory=time.perf_counter, repr=False)

    def as_dict(self) -> dict[str, Any]:
        decided = self.records - self.skipped
        rate = decided / self.seconds if self.seconds else 0.0
        return {
            "records": self.records,
            "skipped": self.skipped,
            "answered": self.answered,
            "errors": self.errors,
            "tokens": self.tokens,
            "cache_hits": self.cache_hits,
            "seconds": round(self.seconds, 3),
            "records_per_s": round(rate, 2),
            "tokens_per_s": round(self.tokens / self.seconds if self.seconds else 0.0, 1),
            "out": self.out,
        }


Progress = Callable[[Summary, int | None], None]  # (the counts so far, the records in all when known)


def read_records(file: IO[bytes]) -> Iterator[Record]:
    for number, line in enumerate(file, 1):
        raw = line.rstrip(b"\n").removesuffix(b"\r")
        if raw.strip():
            yield Record(number, raw)


def answer_line(record: Record, outcome: Outcome) -> bytes:
    request = outcome.request
    own = request.get("id") if isinstance(request, dict) else None
    head = {"id": own if own is not None else record.line, "line": record.line, "request_sha256": request_sha256(record.raw)}
    body = {**head, **outcome.answer()}
    try:
        text = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except UnicodeEncodeError:  # an id holding a lone surrogate: still valid JSON, in ASCII escapes
        text = json.dumps(body, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8") + b"\n"


def _whole_answer(line: bytes) -> tuple[int, str, bool] | None:
    """(line, request_sha256, whether it is an error) of a whole answer line, or None."""
    if not line.endswith(b"\n"):
        return None
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("line"), int) or not isinstance(value.get("request_sha256"), str):
        return None
    return value["line"], value["request_sha256"], "error" in value


def answered_lines(out: Path) -> list[tuple[int, str, bool]]:
    """The answers in `out` as (line, request_sha256, is an error), a torn tail cut off the file (and fsynced)."""
    try:
        data = out.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise AnswersFileError(f"cannot read {out}: {e.strerror or e}") from None
    answers: list[tuple[int, str, bool]] = []
    end = 0
    lines = data.splitlines(keepends=True)
    for n, line in enumerate(lines):
        whole = _whole_answer(line)
        if whole is None:
            if any(_whole_answer(later) for later in lines[n + 1 :]):
                raise AnswersFileError(f"{out}: line {n + 1} is not an answer line, and answers follow it: not a torn end")
            break
        answers.append(whole)
        end += len(line)
    if end < len(data):  # the last write did not finish (or a power cut left zeros): cut, and decide it again
        with open(out, "r+b") as file:
            file.truncate(end)
            os.fsync(file.fileno())
    return answers


def _count(path: Path) -> int | None:
    try:
        with open(path, "rb") as file:
            return sum(1 for line in file if line.strip())
    except OSError:
        return None


def _fsync(file: IO[bytes]) -> None:
    with suppress(OSError):  # a pipe or a terminal: nothing to sync
        os.fsync(file.fileno())


def _open_output(out: str, source: str, *, resume: bool, force: bool) -> tuple[IO[bytes], list[tuple[int, str, bool]], bool]:
    """The answers file, positioned after its whole answers; those answers; and whether it is to be closed."""
    if out == "-":
        if resume:
            raise AnswersFileError("--resume continues an answers file: give it with -o")
        return sys.stdout.buffer, [], False
    path = Path(out)
    if source != "-" and path.exists() and Path(source).exists() and path.samefile(source):
        raise AnswersFileError(f"{out} is the input: write the answers to another file")
    done = answered_lines(path) if resume else []
    if not resume and not force and path.exists() and path.stat().st_size > 0:
        raise AnswersFileError(f"{out} exists: --resume continues it, --force overwrites it")
    try:
        return open(path, "ab" if resume else "wb"), done, True
    except OSError as e:
        raise AnswersFileError(f"cannot write {out}: {e.strerror or e}") from None


def decide_file(
    model: ClefModel,
    source: str,
    out: str,
    *,
    resume: bool = False,
    force: bool = False,
    sort_by_state: bool = False,
    progress: Progress | None = None,
) -> Summary:
    """Decide the JSON Lines requests of `source` ("-": stdin) into the answers file `out` ("-": stdout).

    Image paths in a request's `images` are relative to the input's folder (stdin: the working directory)."""
    summary = Summary(out=out)
    with ExitStack() as stack:
        try:
            file = sys.stdin.buffer if source == "-" else stack.enter_context(open(source, "rb"))
        except OSError as e:
            raise RequestError(f"cannot read the requests: {e.strerror or e}") from None
        total = None if source == "-" else _count(Path(source))
        output, done, owned = _open_output(out, source, resume=resume, force=force)
        if owned:
            stack.callback(output.close)
        stack.callback(_fsync, output)  # at the end, and on the way out of an interrupted run
        records = read_records(file)
        for number, (line, digest, failed) in enumerate(done, 1):
            record = next(records, None)
            if record is None or (record.line, request_sha256(record.raw)) != (line, digest):
                raise AnswersFileError(f"{out}: answer {number} (line {line}) is not the answer to this input's request {number}")
            summary.errors += failed
            summary.answered += not failed
        summary.records = summary.skipped = len(done)
        pending: list[Record] = []

        def raw_requests() -> Iterator[bytes]:
            for record in records:
                pending.append(record)
                yield record.raw

        base = Path.cwd() if source == "-" else Path(source).resolve().parent
        if progress:
            progress(summary, total)
        for outcome in decide_outcomes(model, raw_requests(), sort_by_state=sort_by_state, base=base):
            output.write(answer_line(pending.pop(0), outcome))
            output.flush()
            summary.records += 1
            if outcome.error is None:
                summary.answered += 1
                summary.tokens += outcome.tokens
                summary.cache_hits += outcome.state_hit
            else:
                summary.errors += 1
            if (summary.records - summary.skipped) % FSYNC_EVERY == 0:
                _fsync(output)
            summary.seconds = time.perf_counter() - summary.started
            if progress:
                progress(summary, total)
    summary.seconds = time.perf_counter() - summary.started
    return summary

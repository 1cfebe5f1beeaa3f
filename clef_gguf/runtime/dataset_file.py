"""`clef-gguf decide MODEL requests.jsonl -o answers.jsonl`: a JSON Lines file of requests decided into a JSON Lines
file of answers, one line per request line, in order, that survives being stopped at any point.

An answer line is the response body with four fields of its own in front (the response's fields are
model, answers and usage, so they never meet):
  id              the request's own "id" when it has one, else its line number (also when the id cannot be written
                  in JSON, 1e400 say: then id_error says so);
  line            the request's line number in the input (1-based; blank lines are no request and get no answer);
  request_sha256  the SHA-256 of the request line's bytes (without its line ending);
  model_sha256    the model file's identity (GGUFFile.identity: its header, head and sampled weights), which --resume
                  checks: answers from two models (a base and its fine-tune too) never share a file;
and, for a request that could not be decided, `error` in place of the response: {"status", "detail"}, the
status and body the server answers it with (runtime/failures.py).

Nothing lost: each line is written whole and flushed as soon as it and the ones before it are decided, and the
file is fsynced every FSYNC_EVERY lines and at the end. --resume continues a file: its lines must be the
answers to the input's first requests, line number and digest alike, by the same model (else AnswersFileError);
a last line that is not a whole answer (a torn write, a full disk, a power cut's zeros) is cut off and decided
again. One run writes a file at a time (an exclusive lock on it); a write that fails is an OutputError (exit 9).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import AnswersFileError, OutputError, RequestError, RequestTooLargeError
from ..outputs import check_in_place
from ..settings import MAX_LINE_BYTES, FileOptions
from .dataset import Outcome, decide_outcomes
from .file_lock import lock_exclusive
from .protocols import DecidingModel, FileModel
from .reader import Record, count_records, over_limit, read_records

FSYNC_EVERY = 64
Tally = tuple[bool, int, bool]  # what an answer line counts in the summary: (an error, its tokens, a state cache hit)


def tally(outcome: Outcome) -> Tally:
    return outcome.error is not None, outcome.tokens, outcome.state_hit
LINE_FIELDS = ("id", "line", "request_sha256", "model_sha256")  # (and id_error, when the id could not be written)


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
    workers: int | None = None  # on Ray (dataset_ray.py): the actors deciding; not in as_dict, the local mode's
    started: float = field(default_factory=time.perf_counter, repr=False)

    def count(self, outcome: Outcome) -> None:
        self.add(tally(outcome))

    def add(self, counted: Tally) -> None:
        failed, tokens, hit = counted
        self.records += 1
        if not failed:
            self.answered += 1
            self.tokens += tokens
            self.cache_hits += hit
        else:
            self.errors += 1

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


def _over_limit_outcome(record: Record, max_line_bytes: int) -> Outcome:
    """The server's answer to a body over its limit (413), for a line over the limit."""
    return Outcome.failed(RequestTooLargeError(over_limit(record, max_line_bytes)), None)


def _writable_id(own: Any) -> bool:
    try:
        json.dumps(own, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return False
    return True


def answer_line(record: Record, outcome: Outcome, model: str = "") -> bytes:
    """The answer line; `model` is the identity of the model that decided it (ClefModel.identity)."""
    request = outcome.request
    own = request.get("id") if isinstance(request, dict) else None
    writable = _writable_id(own)  # 1e400 parses as inf, which JSON cannot hold: the line number stands in, and says so
    head: dict[str, Any] = {"id": own if own is not None and writable else record.line}
    if not writable:
        head["id_error"] = "the request's id is not a finite JSON value: its line number stands in"
    head |= {"line": record.line, "request_sha256": record.sha256, **({"model_sha256": model} if model else {})}
    body = {**head, **outcome.answer()}
    try:
        text = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except UnicodeEncodeError:  # an id holding a lone surrogate: still valid JSON, in ASCII escapes
        text = json.dumps(body, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8") + b"\n"


def _whole_answer(line: bytes) -> tuple[int, str, bool, str | None] | None:
    """(line, request_sha256, whether it is an error, model_sha256) of a whole answer line, or None."""
    if not line.endswith(b"\n"):
        return None
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("line"), int) or not isinstance(value.get("request_sha256"), str):
        return None
    return value["line"], value["request_sha256"], "error" in value, value.get("model_sha256")


def answered_lines(out: Path) -> list[tuple[int, str, bool, str | None]]:
    """The answers in `out` as (line, request_sha256, is an error, model_sha256), a torn tail cut off the file
    (and fsynced)."""
    try:
        data = out.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise AnswersFileError(f"cannot read {out}: {e.strerror or e}") from None
    answers: list[tuple[int, str, bool, str | None]] = []
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


def _close(file: IO[bytes]) -> None:
    with suppress(OSError):  # after a failed write, close tries the flush again: that error is the one already raised
        file.close()


def _fsync(file: IO[bytes]) -> None:
    with suppress(OSError):  # a pipe or a terminal: nothing to sync
        os.fsync(file.fileno())


def _lock(file: IO[bytes], out: str) -> None:
    """One writer per answers file: a second run on it is refused, not interleaved."""
    if not lock_exclusive(file.fileno()):
        file.close()
        raise AnswersFileError(f"{out} is being written by another run (it holds the file's lock)")


def _open_output(
    out: str, source: str, *, resume: bool, force: bool, model: Path | None = None
) -> tuple[IO[bytes], list[tuple[int, str, bool, str | None]], bool]:
    """The answers file, locked and positioned after its whole answers; those answers; and whether it is to be closed.

    Opened (and locked) before the answers are read or the file is emptied, so that a second run changes nothing.
    A stream (outputs.check_in_place: a pipe, /dev/null, a terminal) is written in order, never emptied nor locked."""
    stream = out == "-" or check_in_place(Path(out), [None if source == "-" else source, model])
    if stream and resume:
        raise AnswersFileError(f"--resume continues an answers file; {out} is a stream: give a file with -o")
    if out == "-":
        return sys.stdout.buffer, [], False
    path = Path(out)
    if not resume and not force and path.exists() and path.stat().st_size > 0:
        # An output refused before any work, as calibrate's and convert's: exit 9, not a bad input's 2.
        raise OutputError(f"{out} exists: --resume continues it, --force overwrites it")
    try:
        file = open(path, "ab")  # noqa: SIM115 (returned open, closed by decide_file)
    except OSError as e:
        raise OutputError(f"cannot write {out}: {e.strerror or e}") from None
    if not stream:
        _lock(file, out)
    try:
        done = answered_lines(path) if resume else []
        if not resume and not stream:
            file.truncate(0)
    except OSError as e:
        file.close()
        raise OutputError(f"cannot write {out}: {e.strerror or e}") from None
    except BaseException:
        file.close()
        raise
    return file, done, True


def _skip_answered(
    records: Iterator[Record], done: list[tuple[int, str, bool, str | None]], model: FileModel, out: str, summary: Summary
) -> None:
    """Take the requests OUT already answers off `records`, checking that they are its answers, by this model."""
    for number, (line, digest, failed, by) in enumerate(done, 1):
        if by is not None and by != model.identity:
            raise AnswersFileError(_another_model(out, number, by, model))
        record = next(records, None)
        if record is None or (record.line, record.sha256) != (line, digest):
            raise AnswersFileError(_not_the_answer(out, number, line, record))
        summary.errors += failed
        summary.answered += not failed
    summary.records = summary.skipped = len(done)


def _another_model(out: str, number: int, by: str, model: FileModel) -> str:
    """Why --resume refuses answer `number`, decided by the model whose model_sha256 is `by`."""
    if by == model.header_digest:  # an older clef-gguf's model_sha256: the header alone, which a fine-tune shares
        why = "was written by an older clef-gguf, whose model_sha256 covers the model's header only, not its weights"
        return f"{out}: answer {number} {why}: write the answers to another file, or --force decides the input again"
    theirs = f"model_sha256 {by[:12]}..., this one {model.identity[:12]}...; or by an older clef-gguf"
    return f"{out}: answer {number} was decided by another model ({theirs}): resume with that model, or write to another file"


def _not_the_answer(out: str, number: int, line: int, record: Record | None) -> str:
    """Why --resume cannot continue at answer `number`, and what to do: the input changed under its answers (most
    often a last line still being written when the earlier run read it, then finished)."""
    kept = f"`head -n {number - 1} {out} > kept.jsonl` keeps the {number - 1} answers before it" if number > 1 else ""
    where = "the input ends before it" if record is None else f"the input's line {record.line} is not what was answered"
    return (
        f"{out}: answer {number} (line {line}) is not the answer to this input's request {number}: {where} (a line still "
        f"being written when it was read, or another input); "
        + (f"{kept}: resume into that file, or " if kept else "")
        + "--force decides the input again"
    )


def write_line(output: IO[bytes], out: str, line: bytes, counted: Tally, summary: Summary) -> None:
    """One whole answer line written and flushed, counted; OUT fsynced every FSYNC_EVERY lines."""
    try:
        output.write(line)
        output.flush()
    except OSError as e:  # a full disk, an I/O error: the lines before are whole, --resume mends a torn last one
        raise OutputError(f"cannot write {out}: {e.strerror or e}") from None
    summary.add(counted)
    if (summary.records - summary.skipped) % FSYNC_EVERY == 0:
        _fsync(output)
    summary.seconds = time.perf_counter() - summary.started


def answered_records(
    model: DecidingModel,
    records: Iterator[Record],
    *,
    max_line_bytes: int = MAX_LINE_BYTES,
    sort_by_state: bool = False,
    base: Path | None = None,
    anywhere: bool = False,
) -> Iterator[tuple[Record, Outcome]]:
    """Each record with its outcome, in order: a line over max_line_bytes the server's 413, unread. What decide_file
    writes, and what a Ray worker decides of its part of the file (dataset_ray.py)."""
    requests = ((r, _over_limit_outcome(r, max_line_bytes) if r.over else r.raw) for r in records)
    return decide_outcomes(model, requests, sort_by_state=sort_by_state, base=base, anywhere=anywhere)


def images_base(source: str, total: int | None) -> Path:
    """The folder a dataset's image paths are relative to: the input's (stdin, a pipe: the working directory)."""
    return Path(source).resolve().parent if total is not None else Path.cwd()


@dataclass
class AnswersRun:
    """An answers file opened for a run (answers_file): the input's records after those OUT answers already, OUT
    positioned after them, the summary so far, and the requests in all when known."""

    input: IO[bytes]
    records: Iterator[Record]
    output: IO[bytes]
    summary: Summary
    total: int | None
    next_line: int  # the line number the input is positioned at


@contextmanager
def answers_file(
    model: FileModel, source: str, out: str, *, resume: bool, force: bool, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[AnswersRun]:
    """decide_file's input and OUT, opened, locked and checked (--resume: OUT's answers are the input's first requests'
    by this model), closed and fsynced at the end and on the way out of an interrupted run."""
    summary = Summary(out=out)
    with ExitStack() as stack:
        try:
            file = sys.stdin.buffer if source == "-" else stack.enter_context(open(source, "rb"))
        except OSError as e:
            raise RequestError(f"cannot read the requests: {e.strerror or e}") from None
        total = None if source == "-" else count_records(Path(source))  # (None: not a regular file)
        output, done, owned = _open_output(out, source, resume=resume, force=force, model=getattr(model, "path", None))
        if owned:
            stack.callback(_close, output)
        stack.callback(_fsync, output)  # at the end, and on the way out of an interrupted run
        records = read_records(file, max_line_bytes)
        _skip_answered(records, done, model, out, summary)
        yield AnswersRun(file, records, output, summary, total, done[-1][0] + 1 if done else 1)
    summary.seconds = time.perf_counter() - summary.started


def decide_file(
    model: FileModel, source: str, out: str, options: FileOptions | None = None, progress: Progress | None = None
) -> Summary:
    """Decide the JSON Lines requests of `source` ("-": stdin; a pipe, a FIFO or a device streams as stdin does)
    into the answers file `out` ("-": stdout), as `options` say (default: FileOptions()'s). A line over
    max_line_bytes gets the server's 413 error line unread.

    Image paths in a request's `images` are relative to the input's folder (stdin, a pipe: the working directory)
    and must stay inside it unless `images_anywhere`. Each answer line carries the model's identity
    (model_sha256): --resume with another model is refused."""
    o = options or FileOptions()
    with answers_file(model, source, out, resume=o.resume, force=o.force, max_line_bytes=o.max_line_bytes) as run:
        summary, base = run.summary, images_base(source, run.total)
        if progress:
            progress(summary, run.total)
        grouped = {"sort_by_state": o.sort_by_state, "base": base, "anywhere": o.images_anywhere}
        answered = answered_records(model, run.records, max_line_bytes=o.max_line_bytes, **grouped)
        for record, outcome in answered:
            write_line(run.output, out, answer_line(record, outcome, model.identity), tally(outcome), summary)
            if progress:
                progress(summary, run.total)
    return summary

"""`clef-gguf decide MODEL requests.jsonl -o answers.jsonl`: a JSON Lines file of requests decided into a JSON Lines
file of answers, one line per request line, in order, that survives being stopped at any point.

An answer line is the response body with four fields of its own in front (the response's fields are
model, answers and usage, so they never meet):
  id              the request's own "id" when it has one, else its line number (also when the id cannot be written
                  in JSON, 1e400 say: then id_error says so);
  line            the request's line number in the input (1-based; blank lines are no request and get no answer);
  request_sha256  the SHA-256 of the request line's bytes (without its line ending);
  model_sha256    the SHA-256 of the model file's header (its metadata and tensor infos: GGUFFile.digest), which
                  --resume checks: answers from two models never share a file;
and, for a request that could not be decided, `error` in place of the response: {"status", "detail"}, the
status and body the server answers it with (runtime/problems.py).

Nothing lost: each line is written whole and flushed as soon as it and the ones before it are decided, and the
file is fsynced every FSYNC_EVERY lines and at the end. --resume continues a file: its lines must be the
answers to the input's first requests, line number and digest alike, by the same model (else AnswersFileError);
a last line that is not a whole answer (a torn write, a full disk, a power cut's zeros) is cut off and decided
again. One run writes a file at a time (an exclusive lock on it); a write that fails is an OutputError (exit 9).
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from ..errors import AnswersFileError, OutputError, RequestError
from . import dataset
from .dataset import Outcome, decide_outcomes, request_sha256


class Decider(dataset.Decider, Protocol):
    identity: str  # the model file's header digest (GGUFFile.digest): what model_sha256 records


FSYNC_EVERY = 64
LINE_FIELDS = ("id", "line", "request_sha256", "model_sha256")  # (and id_error, when the id could not be written)


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

    def count(self, outcome: Outcome) -> None:
        self.records += 1
        if outcome.error is None:
            self.answered += 1
            self.tokens += outcome.tokens
            self.cache_hits += outcome.state_hit
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


def read_records(file: IO[bytes]) -> Iterator[Record]:
    try:
        for number, line in enumerate(file, 1):
            raw = line.rstrip(b"\n").removesuffix(b"\r")
            if raw.strip():
                yield Record(number, raw)
    except OSError as e:  # an I/O error, a directory: the requests read before are answered first (decide_outcomes)
        raise RequestError(f"cannot read the requests: {e.strerror or e}") from None


def _writable_id(own: Any) -> bool:
    try:
        json.dumps(own, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return False
    return True


def answer_line(record: Record, outcome: Outcome, model: str = "") -> bytes:
    """The answer line; `model` is the header digest of the model that decided it (ClefModel.identity)."""
    request = outcome.request
    own = request.get("id") if isinstance(request, dict) else None
    writable = _writable_id(own)  # 1e400 parses as inf, which JSON cannot hold: the line number stands in, and says so
    head: dict[str, Any] = {"id": own if own is not None and writable else record.line}
    if not writable:
        head["id_error"] = "the request's id is not a finite JSON value: its line number stands in"
    head |= {"line": record.line, "request_sha256": request_sha256(record.raw), **({"model_sha256": model} if model else {})}
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


def count_records(path: Path) -> int | None:
    """The requests in a regular file, for the progress bar; None for a pipe, a FIFO or a device, which can be read
    once only (counting it would consume the requests)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with open(path, "rb") as file:
            return sum(1 for line in file if line.strip())
    except OSError:
        return None


def _close(file: IO[bytes]) -> None:
    with suppress(OSError):  # after a failed write, close tries the flush again: that error is the one already raised
        file.close()


def _fsync(file: IO[bytes]) -> None:
    with suppress(OSError):  # a pipe or a terminal: nothing to sync
        os.fsync(file.fileno())


def _lock(file: IO[bytes], out: str) -> None:
    """One writer per answers file: a second run on it is refused, not interleaved."""
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.close()
        raise AnswersFileError(f"{out} is being written by another run (it holds the file's lock)") from None
    except OSError:  # a file system without locks (some network ones): nothing to hold
        pass


def _open_output(
    out: str, source: str, *, resume: bool, force: bool
) -> tuple[IO[bytes], list[tuple[int, str, bool, str | None]], bool]:
    """The answers file, locked and positioned after its whole answers; those answers; and whether it is to be closed.

    Opened (and locked) before the answers are read or the file is emptied, so that a second run changes nothing."""
    if out == "-":
        if resume:
            raise AnswersFileError("--resume continues an answers file: give it with -o")
        return sys.stdout.buffer, [], False
    path = Path(out)
    if source != "-" and path.exists() and Path(source).exists() and path.samefile(source):
        raise AnswersFileError(f"{out} is the input: write the answers to another file")
    if not resume and not force and path.exists() and path.stat().st_size > 0:
        raise AnswersFileError(f"{out} exists: --resume continues it, --force overwrites it")
    try:
        file = open(path, "ab")  # noqa: SIM115 (returned open, closed by decide_file)
    except OSError as e:
        raise OutputError(f"cannot write {out}: {e.strerror or e}") from None
    _lock(file, out)
    try:
        done = answered_lines(path) if resume else []
        if not resume and file.seekable():
            file.truncate(0)
    except OSError as e:
        file.close()
        raise OutputError(f"cannot write {out}: {e.strerror or e}") from None
    except BaseException:
        file.close()
        raise
    return file, done, True


def _skip_answered(
    records: Iterator[Record], done: list[tuple[int, str, bool, str | None]], identity: str, out: str, summary: Summary
) -> None:
    """Take the requests OUT already answers off `records`, checking that they are its answers, by this model."""
    for number, (line, digest, failed, by) in enumerate(done, 1):
        if by is not None and by != identity:
            raise AnswersFileError(
                f"{out}: answer {number} was decided by another model (header sha256 {by[:12]}..., this one "
                f"{identity[:12]}...): resume with that model, or write the answers to another file"
            )
        record = next(records, None)
        if record is None or (record.line, request_sha256(record.raw)) != (line, digest):
            raise AnswersFileError(f"{out}: answer {number} (line {line}) is not the answer to this input's request {number}")
        summary.errors += failed
        summary.answered += not failed
    summary.records = summary.skipped = len(done)


def decide_file(
    model: Decider,
    source: str,
    out: str,
    *,
    resume: bool = False,
    force: bool = False,
    sort_by_state: bool = False,
    images_anywhere: bool = False,
    progress: Progress | None = None,
) -> Summary:
    """Decide the JSON Lines requests of `source` ("-": stdin; a pipe, a FIFO or a device streams as stdin does)
    into the answers file `out` ("-": stdout).

    Image paths in a request's `images` are relative to the input's folder (stdin, a pipe: the working directory)
    and must stay inside it unless `images_anywhere`. Each answer line carries the model's header digest
    (model_sha256): --resume with another model is refused."""
    summary = Summary(out=out)
    with ExitStack() as stack:
        try:
            file = sys.stdin.buffer if source == "-" else stack.enter_context(open(source, "rb"))
        except OSError as e:
            raise RequestError(f"cannot read the requests: {e.strerror or e}") from None
        total = None if source == "-" else count_records(Path(source))  # (None: not a regular file)
        output, done, owned = _open_output(out, source, resume=resume, force=force)
        if owned:
            stack.callback(_close, output)
        stack.callback(_fsync, output)  # at the end, and on the way out of an interrupted run
        records = read_records(file)
        _skip_answered(records, done, model.identity, out, summary)
        pending: list[Record] = []

        def raw_requests() -> Iterator[bytes]:
            for record in records:
                pending.append(record)
                yield record.raw

        base = Path(source).resolve().parent if total is not None else Path.cwd()
        if progress:
            progress(summary, total)
        outcomes = decide_outcomes(model, raw_requests(), sort_by_state=sort_by_state, base=base, anywhere=images_anywhere)
        for outcome in outcomes:
            try:
                output.write(answer_line(pending.pop(0), outcome, model.identity))
                output.flush()
            except OSError as e:  # a full disk, an I/O error: the lines before are whole, --resume mends a torn last one
                raise OutputError(f"cannot write {out}: {e.strerror or e}") from None
            summary.count(outcome)
            if (summary.records - summary.skipped) % FSYNC_EVERY == 0:
                _fsync(output)
            summary.seconds = time.perf_counter() - summary.started
            if progress:
                progress(summary, total)
    summary.seconds = time.perf_counter() - summary.started
    return summary

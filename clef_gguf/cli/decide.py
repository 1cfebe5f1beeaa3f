"""`clef-gguf decide` and `clef-gguf demo`: one request answered, its response JSON on stdout; or a JSON Lines
file of requests decided into a JSON Lines file of answers (runtime/dataset_file.py), with a progress bar.

The runtime (and so llama.cpp) is imported when a command runs, not with the module: --help loads neither."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from ..data import DEMO_CONTEXT, DEMO_MODEL, DEMO_REQUEST
from ..errors import ExitCode
from ..settings import FileOptions, LoadOptions, ModelSpec
from .common import on_ray
from .errors import err, fail, run, say, signals_clean_up
from .options import AddressOption, GpuLayers, ModelFlags, OnRayOption, WorkersOption, flag_groups

if TYPE_CHECKING:
    from ..runtime.dataset_file import Summary

JSONL_SUFFIXES = (".jsonl", ".ndjson")


def _decide_one(spec: ModelSpec, request_path: str, images: list[Path], note: str = "") -> None:
    """The one-request mode (and demo's): its answer on stdout; `note` (Rich markup) on stderr once the model loaded,
    so that a llama.cpp that cannot load here is the one line it says."""

    def decided() -> dict[str, Any]:
        from ..runtime.model import ClefModel
        from ..runtime.reader import read_request

        request = read_request(request_path, images)  # before loading: a bad request is refused at once
        with ClefModel(spec) as model:
            if note:
                err.print(note)
            return model.decide(request)

    typer.echo(json.dumps(run(decided), ensure_ascii=False, indent=2))


@contextmanager
def _progress_bar() -> Iterator[Callable[[Summary, int | None], None]]:
    """The dataset's progress on stderr: records, records/s, tokens/s, cache hits, ETA."""
    # Rich's bars, loaded by a JSON Lines run: not by one request's.
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    columns = (
        TextColumn("[bold]decide"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[rates]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err, transient=False, redirect_stdout=False, redirect_stderr=False) as bar:
        task = bar.add_task("decide", total=None, rates="")

        def update(summary: Summary, total: int | None) -> None:
            s = summary.as_dict()
            rates = f"{s['records_per_s']:.1f} rec/s  {s['tokens_per_s']:,.0f} tok/s  {summary.cache_hits} cache hits"
            rates += f"  {summary.errors} errors" if summary.errors else ""
            rates += f"  {summary.workers} workers" if summary.workers else ""
            bar.update(task, completed=summary.records, total=total, rates=rates)

        yield update


def _summary_line(summary: Summary, code: int) -> str:
    s = summary.as_dict()
    done = f"{summary.records} records: {summary.answered} answered, {summary.errors} errors"
    if summary.skipped:
        done += f", {summary.skipped} answered before (--resume)"
    rates = f"{s['records_per_s']} records/s, {s['tokens_per_s']:,} tokens/s, {summary.cache_hits} cache hits"
    outcome = f"exit {code}: every line answered" if code == ExitCode.OK else f"exit {code}: {summary.errors} lines are errors"
    return f"decided {done} in {s['seconds']} s ({rates}) into {summary.out}; {outcome}"


def _decide_jsonl(
    spec: ModelSpec,
    source: str,
    out: str,
    file: FileOptions,
    *,
    json_summary: bool,
    ray: tuple[str | None, int | None] | None,
) -> NoReturn:
    """The JSON Lines mode: the answers into `out`, a progress bar on a terminal, the summary; exits 0 (OK), or 8
    (SOME_ERRORS)."""
    bar = err.is_terminal and not (out == "-" and sys.stdout.isatty())  # (answers on this terminal would tear the bar)

    def decided(progress: Callable[[Summary, int | None], None] | None) -> Summary:
        if ray is not None:  # (the adapter is checked against the model there, once, before any Ray process starts)
            on = on_ray(ray[0])
            return on.decide_file_on_ray(spec, source, out, on.RayData(*ray), file, progress)  # (each actor builds spec)
        from ..runtime.dataset_file import decide_file
        from ..runtime.model import ClefModel

        with ClefModel(spec) as model:
            return decide_file(model, source, out, file, progress)

    def work() -> Summary:
        with signals_clean_up():
            if not bar:
                return decided(None)
            with _progress_bar() as progress:
                return decided(progress)

    # After a signal the answers written are whole lines, fsynced on the way out.
    summary = run(work, stopped="the answers written are kept: --resume continues the run")
    code = ExitCode.SOME_ERRORS if summary.errors else ExitCode.OK
    say(_summary_line(summary, code))
    if json_summary:
        text = json.dumps({**summary.as_dict(), "exit_code": code})
        print(text, file=sys.stderr if out == "-" else sys.stdout)  # never among answers on stdout
    raise typer.Exit(code)


PathsOption = Annotated[
    list[str],
    typer.Argument(
        metavar="[MODEL] REQUEST",
        help="[MODEL.gguf] REQUEST.json or REQUESTS.jsonl (- reads stdin). Without MODEL: the demo model.",
        show_default=False,
    ),
]
ImageOption = Annotated[
    list[Path] | None,
    typer.Option("--image", help="An image file (PNG, JPEG, WebP) for the request's images; repeat for more (up to 4)."),
]
JsonlOption = Annotated[
    bool, typer.Option("--jsonl", help="The requests are JSON Lines whatever the name (e.g. stdin: --jsonl -).")
]
SortByStateOption = Annotated[
    bool,
    typer.Option("--sort-by-state", help="JSON Lines: decide each window of requests grouped by state (answers stay in order)."),
]
JsonSummaryOption = Annotated[
    bool, typer.Option("--json", help="JSON Lines: a JSON summary at the end (on stdout; on stderr when the answers are).")
]
ImagesAnywhereOption = Annotated[
    bool,
    typer.Option(
        "--allow-image-paths-anywhere",
        help="JSON Lines: image paths may leave the JSON Lines file's folder (by default they must stay inside it).",
    ),
]


@flag_groups
def decide(
    paths: PathsOption,
    image: ImageOption = None,
    jsonl: JsonlOption = False,
    out: Annotated[str, typer.Option("--out", "-o", help="JSON Lines: the answers file (- : stdout).")] = "-",
    resume: Annotated[bool, typer.Option("--resume", help="JSON Lines: continue OUT, skipping the requests it answers.")] = False,
    force: Annotated[bool, typer.Option("--force", help="JSON Lines: overwrite OUT if it exists.")] = False,
    sort_by_state: SortByStateOption = False,
    json_summary: JsonSummaryOption = False,
    images_anywhere: ImagesAnywhereOption = False,
    ray: OnRayOption = False,
    workers: WorkersOption = None,
    address: AddressOption = None,
    *,
    load: ModelFlags,
) -> None:
    """Answer a SystemOne request; prints the response JSON on stdout. Images: the request's `images` (data URLs),
    and --image files, with --mmproj.

    JSON Lines (a file named *.jsonl or *.ndjson, or --jsonl): one request per line, decided in batches through the
    state cache; one answer line per request line, in order, into OUT: the response with "id" (the request's, else
    its line number), "line", "request_sha256" (of the line) and "model_sha256" (of the model's header) in front,
    or "error": {"status", "detail"} (the server's error) for a bad request. An image may be a file path inside the
    JSONL file's folder. Exit 0: every line answered; 8: some lines are errors (3 is a release error's code); 9: OUT
    cannot be written; --resume after any stop leaves no gap."""
    if not 1 <= len(paths) <= 2:
        fail("expected [MODEL.gguf] REQUEST.json or REQUESTS.jsonl")
    if "" in paths:
        fail("MODEL and REQUEST are files: an empty path names none")
    model_path, request_path = (Path(paths[0]), paths[1]) if len(paths) == 2 else (DEMO_MODEL, paths[0])
    many = jsonl or request_path.lower().endswith(JSONL_SUFFIXES)  # (nothing to reuse in one request: no state cache)
    spec = load.spec(model_path, LoadOptions.state_cache if many else 0)
    if many:
        if image:
            fail("--image is for one request; in JSON Lines, give image paths in each request's images")
        file = FileOptions(resume, force, sort_by_state, images_anywhere, load.line_limit())
        if workers is not None and not ray:
            fail("--workers is for --ray")
        on = (address, workers) if ray else None
        _decide_jsonl(spec, request_path, out, file, json_summary=json_summary, ray=on)  # exits
    jsonl_only = {"-o": out != "-", "--resume": resume, "--force": force, "--sort-by-state": sort_by_state, "--ray": ray}
    jsonl_only |= {"--json": json_summary, "--allow-image-paths-anywhere": images_anywhere}
    jsonl_only |= {"--max-line-bytes": load.max_line_bytes}
    given = [name for name, on in jsonl_only.items() if on]
    if given:
        fail(f"{given[0]} is for JSON Lines requests (a *.jsonl file, or --jsonl)")
    _decide_one(spec, request_path, image or [])


def demo(n_gpu_layers: GpuLayers = LoadOptions.n_gpu_layers) -> None:
    """Run the bundled tiny demo model on a bundled request. Its weights are random: so are its answers."""
    note = "[yellow]demo model: a tiny Clef with RANDOM weights; the answers show the format, not a judgement.[/]"
    options = LoadOptions(n_gpu_layers=n_gpu_layers, max_prompt_tokens=DEMO_CONTEXT, state_cache=0)
    _decide_one(ModelSpec(DEMO_MODEL, options), str(DEMO_REQUEST), [], note)

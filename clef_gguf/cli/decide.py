"""`clef-gguf decide` and `clef-gguf demo`: one request answered, its response JSON on stdout; or a JSON Lines
file of requests decided into a JSON Lines file of answers (runtime/dataset_file.py), with a progress bar."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from ..data import DEMO_CONTEXT, DEMO_MODEL, DEMO_REQUEST
from ..errors import SettingsError
from ..runtime.dataset_file import Summary, decide_file
from ..runtime.model import load
from ..runtime.reader import read_request
from ..settings import FileOptions, LoadOptions
from .errors import err, fail, run, say, signals_clean_up
from .options import (
    AdapterFile,
    BaseHead,
    GpuLayers,
    MaxLineBytes,
    MaxPrompt,
    Mmproj,
    Parallel,
    Threads,
    Ubatch,
    check_ubatch,
    line_limit,
    state_cache_option,
)

# Some requests of a JSON Lines run got an error line. Not 3, the first pick: that is ReleaseError's code
# (clef_gguf/errors.py uses 1 to 7), and a wrapper script must tell "every line has its answer, some are errors"
# from any error that stopped the run.
SOME_ERRORS = 8
JSONL_SUFFIXES = (".jsonl", ".ndjson")


def _decide_one(model_path: Path, request_path: str, images: list[Path], options: LoadOptions, adapter: Path | None) -> None:
    """The one-request mode (and demo's): its answer on stdout."""

    def decided() -> dict[str, Any]:
        request = read_request(request_path, images)  # before loading: a bad request is refused at once
        with load(model_path, adapter=adapter, **options.kwargs()) as model:
            return model.decide(request)

    typer.echo(json.dumps(run(decided), ensure_ascii=False, indent=2))


@contextmanager
def _progress_bar() -> Iterator[Callable[[Summary, int | None], None]]:
    """The dataset's progress on stderr: records, records/s, tokens/s, cache hits, ETA."""
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
    outcome = "exit 0: every line answered" if code == 0 else f"exit {code}: {summary.errors} lines are errors"
    return f"decided {done} in {s['seconds']} s ({rates}) into {summary.out}; {outcome}"


def on_ray(address: str | None) -> Any:
    """server/ray_dataset.py, imported after ray_local.loopback_only when the cluster is to be started here."""
    from ..server.ray_local import bounded_connect, loopback_only

    if address is None:
        loopback_only()  # the cluster started here listens on 127.0.0.1 only; before ray is imported
    else:
        bounded_connect()  # an address where no cluster answers: refused in seconds, not minutes
    try:
        from ..server import ray_dataset
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in ("ray", "pandas", "pyarrow"):
            raise
        raise SettingsError("--ray needs Ray Data: pip install 'clef-gguf[ray]'") from None
    return ray_dataset


def ray_scorer(address: str | None, workers: int | None) -> Callable[..., Any]:
    """`eval --ray`'s scorer (quality.evaluate's `score`): Ray imported once the run starts (its errors the CLI's)."""

    def score(*args: Any, **kwargs: Any) -> Any:
        return on_ray(address).score_on_ray(address, workers)(*args, **kwargs)

    return score


def _decide_jsonl(
    model_path: Path,
    source: str,
    out: str,
    options: LoadOptions,
    file: FileOptions,
    *,
    adapter: Path | None,
    json_summary: bool,
    ray: tuple[str | None, int | None] | None,
) -> NoReturn:
    """The JSON Lines mode: the answers into `out`, a progress bar on a terminal, the summary; exits 0, or SOME_ERRORS."""
    bar = err.is_terminal and not (out == "-" and sys.stdout.isatty())  # (answers on this terminal would tear the bar)

    def decided(progress: Callable[[Summary, int | None], None] | None) -> Summary:
        if ray is not None:
            if adapter is not None:  # checked against the model as loading checks it: before a cluster starts
                from ..server.launch import check_files

                check_files(model_path, options.mmproj and Path(options.mmproj), options, adapter)
            on = on_ray(ray[0])
            return on.decide_file_on_ray(model_path, source, out, on.RayData(*ray, options, adapter=adapter), file, progress)
        with load(model_path, adapter=adapter, **options.kwargs()) as model:
            return decide_file(model, source, out, file, progress)

    def work() -> Summary:
        with signals_clean_up():
            if not bar:
                return decided(None)
            with _progress_bar() as progress:
                return decided(progress)

    # After a signal the answers written are whole lines, fsynced on the way out.
    summary = run(work, stopped="the answers written are kept: --resume continues the run")
    code = SOME_ERRORS if summary.errors else 0
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
OnRayOption = Annotated[
    bool,
    typer.Option("--ray", help="JSON Lines: decide on a Ray cluster (Ray Data), the same answers in order (docs/dataset.md)."),
]
WorkersOption = Annotated[
    int | None,
    typer.Option(
        "--workers",
        min=1,
        help="With --ray: actors, each loading the model (default: the cluster's CPUs / --threads).",
        show_default=False,
    ),
]
AddressOption = Annotated[
    str | None,
    typer.Option(
        "--address",
        envvar="RAY_ADDRESS",
        help="With --ray: the Ray cluster to join (default: a local one, started and stopped here, on loopback).",
        show_default=False,
    ),
]
ImagesAnywhereOption = Annotated[
    bool,
    typer.Option(
        "--allow-image-paths-anywhere",
        help="JSON Lines: image paths may leave the JSON Lines file's folder (by default they must stay inside it).",
    ),
]


def decide(
    paths: PathsOption,
    n_gpu_layers: GpuLayers = LoadOptions.n_gpu_layers,
    max_prompt_tokens: MaxPrompt = LoadOptions.max_prompt_tokens,
    ubatch: Ubatch = None,
    state_cache: Annotated[int | None, state_cache_option("0 for one request (nothing to reuse), 1GiB for JSON Lines")] = None,
    mmproj: Mmproj = None,
    image: ImageOption = None,
    jsonl: JsonlOption = False,
    out: Annotated[str, typer.Option("--out", "-o", help="JSON Lines: the answers file (- : stdout).")] = "-",
    resume: Annotated[bool, typer.Option("--resume", help="JSON Lines: continue OUT, skipping the requests it answers.")] = False,
    force: Annotated[bool, typer.Option("--force", help="JSON Lines: overwrite OUT if it exists.")] = False,
    sort_by_state: SortByStateOption = False,
    json_summary: JsonSummaryOption = False,
    images_anywhere: ImagesAnywhereOption = False,
    parallel: Parallel = LoadOptions.parallel,
    n_threads: Threads = LoadOptions.n_threads,
    max_line_bytes: MaxLineBytes = None,
    adapter: AdapterFile = None,
    base_head: BaseHead = LoadOptions.base_head,
    ray: OnRayOption = False,
    workers: WorkersOption = None,
    address: AddressOption = None,
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
    model_path, request_path = (Path(paths[0]), paths[1]) if len(paths) == 2 else (DEMO_MODEL, paths[0])
    check_ubatch(ubatch, max_prompt_tokens)
    options = LoadOptions(n_gpu_layers, max_prompt_tokens, ubatch, parallel, n_threads, mmproj=mmproj, base_head=base_head)
    if jsonl or request_path.lower().endswith(JSONL_SUFFIXES):
        if image:
            fail("--image is for one request; in JSON Lines, give image paths in each request's images")
        file = FileOptions(resume, force, sort_by_state, images_anywhere, line_limit(max_line_bytes, max_prompt_tokens, mmproj))
        if workers is not None and not ray:
            fail("--workers is for --ray")
        options = replace(options, state_cache=LoadOptions.state_cache if state_cache is None else state_cache)
        on = (address, workers) if ray else None
        _decide_jsonl(model_path, request_path, out, options, file, adapter=adapter, json_summary=json_summary, ray=on)  # exits
    jsonl_only = {"-o": out != "-", "--resume": resume, "--force": force, "--sort-by-state": sort_by_state, "--ray": ray}
    jsonl_only |= {"--json": json_summary, "--allow-image-paths-anywhere": images_anywhere}
    jsonl_only |= {"--max-line-bytes": max_line_bytes}
    given = [name for name, on in jsonl_only.items() if on]
    if given:
        fail(f"{given[0]} is for JSON Lines requests (a *.jsonl file, or --jsonl)")
    _decide_one(model_path, request_path, image or [], replace(options, state_cache=state_cache or 0), adapter)


def demo(n_gpu_layers: GpuLayers = LoadOptions.n_gpu_layers) -> None:
    """Run the bundled tiny demo model on a bundled request. Its weights are random: so are its answers."""
    err.print("[yellow]demo model: a tiny Clef with RANDOM weights; the answers show the format, not a judgement.[/]")
    options = LoadOptions(n_gpu_layers=n_gpu_layers, max_prompt_tokens=DEMO_CONTEXT, state_cache=0)
    _decide_one(DEMO_MODEL, str(DEMO_REQUEST), [], options, None)

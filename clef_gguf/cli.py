"""The `clef-gguf` command: a thin layer over the Python API.

Errors from the library are typed (errors.py); they are turned into one line on
stderr and an exit code here, never a traceback.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from .conversion.convert import DEFAULT_FILE_TYPE, FILE_TYPES
from .errors import ClefError, SettingsError
from .llama.defaults import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_PARALLEL, DEFAULT_STATE_CACHE, DEFAULT_UBATCH, MAX_PARALLEL
from .llama.log import inside_callback

app = typer.Typer(
    help="Cloudflare's Clef decision models on llama.cpp: convert, validate and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
T = TypeVar("T")

GpuLayers = Annotated[int, typer.Option("--n-gpu-layers", "-ngl", help="Backbone layers to offload to the GPU (-1: all).")]
MaxPrompt = Annotated[
    int,
    typer.Option(
        "--max-prompt-tokens",
        "--ctx",
        min=1,
        help="Largest prompt accepted (the context; default Clef's). Raising it grows the KV cache.",
    ),
]
Mmproj = Annotated[
    Path | None,
    typer.Option(
        "--mmproj",
        help="The vision tower (llama.cpp's mmproj GGUF, which convert writes beside the model): requests may carry up to "
        "4 images. Without it, requests with images are refused.",
        show_default=False,
    ),
]
Ubatch = Annotated[
    int | None,
    typer.Option(
        "--ubatch",
        min=1,
        help="Prefill in ubatches of this many tokens (state carried over): device memory bounded by the ubatch, "
        f"not the prompt. Default: {DEFAULT_UBATCH} (or the context if smaller); --ubatch = --ctx is one batch.",
        show_default=False,
    ),
]
Parallel = Annotated[
    int,
    typer.Option(
        "--parallel",
        "-np",
        min=1,
        max=MAX_PARALLEL,
        help="Requests prefilled together when they wait at once (llama.cpp sequences; llama-server's -np), their tokens "
        "fitting one ubatch. Each takes a recurrent state of its own in the context.",
    ),
]


def _size(value: str | int) -> int:
    if isinstance(value, int):  # the default, which click hands to the parser too
        return value
    from .llama.plan import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _state_cache_option(default: str) -> Any:
    return typer.Option(
        "--state-cache",
        metavar="SIZE",
        parser=_size,
        help="Host memory for the backbone states of recent requests' states (e.g. 512MiB; 0 turns it off): a request "
        f"repeating a state prefills only its schema. Default: {default}.",
        show_default=False,
    )


def _check_ubatch(ubatch: int | None, max_prompt_tokens: int) -> None:
    if ubatch is not None and ubatch > max_prompt_tokens:
        err.print(f"[bold red]error:[/] --ubatch ({ubatch}) cannot exceed --max-prompt-tokens ({max_prompt_tokens})")
        raise typer.Exit(2)


def _line(text: object) -> str:
    """One printable line: messages quote paths, names and values from files, which may hold escapes or newlines."""
    from .check.report import printable

    return printable(str(text), limit=2000)


def _error(message: object) -> None:
    # markup=False: a path holding `[/b]` is text, not Rich markup.
    err.print(f"error: {_line(message)}", markup=False, highlight=False, soft_wrap=True, style="bold red")


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is, so that cleanups run as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_pending: list[int] = []  # a signal that arrived where raising would have been lost


def _raise_pending() -> None:
    """Raise a signal deferred by the handler, once Python runs outside llama.cpp again (progress calls this)."""
    if _pending and not inside_callback():
        raise _Terminated(_pending[0])


@contextmanager
def _signals_clean_up() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like SIGINT (finally blocks remove partial files); later signals wait for that.

    Inside llama.cpp (its quantizer calls back into Python to log) the signal is kept and raised
    at the next progress update out of it: an exception cannot unwind C frames.
    """
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def unwind(signum: int, frame: FrameType | None) -> None:
        for s in signals:  # a second signal must not interrupt the cleanup the first one started
            signal.signal(s, signal.SIG_IGN)
        _pending.append(signum)
        if not inside_callback(frame):
            raise _Terminated(signum)

    previous = {s: signal.signal(s, unwind) for s in signals}
    try:
        yield
    finally:
        _pending.clear()  # a later error, outside this block, is not the signal's
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stopped_by(signum: int) -> NoReturn:
    _error(f"stopped by {signal.Signals(signum).name}; partial output removed")
    raise typer.Exit(128 + signum) from None


def _run(action: Callable[[], T]) -> T:
    """Run a library call; a ClefError becomes one line on stderr and its exit code."""
    try:
        return action()
    except ClefError as e:
        _error(e)
        raise typer.Exit(e.exit_code) from None
    except _Terminated as e:
        _stopped_by(e.signum)
    except Exception:
        # C code between the handler and here can swallow its exception and fail another way (numpy's
        # tofile turned it into a TypeError): once a signal came, what unwinds is that signal.
        if _pending:
            _stopped_by(_pending[0])
        raise
    except KeyboardInterrupt:
        _error("interrupted; partial output removed")
        raise typer.Exit(128 + signal.SIGINT) from None


@contextmanager
def _progress() -> Iterator[Callable[[str, int, int, str], None]]:
    """A progress callback (stage, done, total, item): one bar per stage."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[item]}"),
    )
    with Progress(*columns, console=err, transient=False) as bar:
        tasks: dict[str, TaskID] = {}

        def update(stage: str, done: int, total: int, item: str) -> None:
            _raise_pending()
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total, item="")
            bar.update(tasks[stage], completed=done, total=total, item=item)

        yield update


@app.command()
def convert(
    source: Annotated[str, typer.Argument(help="Release folder, or Hugging Face repo id (owner/name).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output .gguf file.")],
    file_type: Annotated[str, typer.Option("--type", "-t", help=f"Backbone type: {', '.join(FILE_TYPES)}.")] = DEFAULT_FILE_TYPE,
    head_type: Annotated[
        str,
        typer.Option(
            "--head-type",
            help="Head weight type: auto (as llama.cpp's converter: the file type for f32/f16/bf16/q8_0, else f32), "
            "f32, f16, bf16 or q8_0.",
        ),
    ] = "auto",
    imatrix: Annotated[
        Path | None, typer.Option("--imatrix", help="Importance matrix (llama-imatrix GGUF) for llama.cpp's quantizer.")
    ] = None,
    mmproj: Annotated[
        Path | None,
        typer.Option(
            "--mmproj",
            help="Where to write the vision tower (llama.cpp's mmproj GGUF). Default: mmproj-<OUT's stem>.gguf beside OUT.",
            show_default=False,
        ),
    ] = None,
    no_mmproj: Annotated[bool, typer.Option("--no-mmproj", help="Do not convert the vision tower.")] = False,
    mmproj_type: Annotated[
        str,
        typer.Option(
            "--mmproj-type",
            help="Vision tower weight type: auto (the file type for f32/f16/bf16/q8_0, else f16), f32, f16, bf16 or q8_0.",
        ),
    ] = "auto",
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUT (and the mmproj) if they exist.")] = False,
) -> None:
    """Convert a Clef release into one GGUF file (backbone, head, tokenizer, decision metadata), and its vision
    tower into llama.cpp's mmproj file beside it."""
    from .conversion.convert import Converted, convert_files

    if no_mmproj and mmproj is not None:
        err.print("[bold red]error:[/] --mmproj and --no-mmproj exclude each other")
        raise typer.Exit(2)

    def work() -> Converted:
        with _signals_clean_up(), _progress() as progress:
            return convert_files(
                source,
                out,
                file_type,
                head_type=head_type,
                imatrix=imatrix,
                mmproj=False if no_mmproj else (mmproj or True),
                mmproj_type=mmproj_type,
                force=force,
                progress=progress,
            )

    made = _run(work)
    err.print(f"wrote {_line(made.model)}", markup=False, highlight=False, soft_wrap=True)
    if made.mmproj is not None:
        err.print(f"wrote {_line(made.mmproj)} (the vision tower)", markup=False, highlight=False, soft_wrap=True)
    if made.note:
        err.print(f"note: {_line(made.note)}", markup=False, highlight=False, soft_wrap=True)


@app.command()
def graft(
    backbone: Annotated[Path, typer.Argument(help="A backbone-only qwen35 GGUF (any quantization).")],
    source: Annotated[
        str, typer.Argument(help="The release: folder or Hugging Face repo id (only head, config and tokenizer files are read).")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output .gguf file.")],
    head_type: Annotated[str, typer.Option("--head-type", help="Head weight type: auto (f32), f32, f16, bf16 or q8_0.")] = "auto",
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUT if it exists.")] = False,
) -> None:
    """Add a release's head to a backbone-only GGUF, without re-quantizing the backbone."""
    from .conversion.graft import graft as run_graft

    def work() -> Path:
        with _signals_clean_up(), _progress() as progress:
            return run_graft(backbone, source, out, head_type=head_type, force=force, progress=progress)

    err.print(f"wrote {_line(_run(work))}", markup=False, highlight=False, soft_wrap=True)


def _decide(model_path: Path, request_path: str, images: list[Path], **settings: Any) -> dict[str, Any]:
    from .runtime.model import load
    from .runtime.reader import read_request

    request = read_request(request_path, images)  # before loading: a bad request is refused at once
    with load(model_path, **settings) as model:
        return model.decide(request)


@app.command()
def decide(
    paths: Annotated[
        list[str],
        typer.Argument(help="[MODEL.gguf] REQUEST.json (- reads stdin). Without MODEL: the demo model.", show_default=False),
    ],
    n_gpu_layers: GpuLayers = 0,
    max_prompt_tokens: MaxPrompt = DEFAULT_MAX_PROMPT_TOKENS,
    ubatch: Ubatch = None,
    state_cache: Annotated[int, _state_cache_option("0 (one request has nothing to reuse)")] = 0,
    mmproj: Mmproj = None,
    image: Annotated[
        list[Path] | None,
        typer.Option("--image", help="An image file (PNG, JPEG, WebP) for the request's images; repeat for more (up to 4)."),
    ] = None,
) -> None:
    """Answer a SystemOne request; prints the response JSON on stdout. Images: the request's `images` (data URLs),
    and --image files, with --mmproj."""
    from .data import DEMO_MODEL

    if not 1 <= len(paths) <= 2:
        err.print("[bold red]error:[/] expected [MODEL.gguf] REQUEST.json")
        raise typer.Exit(2)
    model_path, request_path = (Path(paths[0]), paths[1]) if len(paths) == 2 else (DEMO_MODEL, paths[0])
    _check_ubatch(ubatch, max_prompt_tokens)
    settings = {
        "n_gpu_layers": n_gpu_layers,
        "max_prompt_tokens": max_prompt_tokens,
        "ubatch": ubatch,
        "state_cache": state_cache,
    }
    answer = _run(lambda: _decide(model_path, request_path, image or [], mmproj=mmproj, **settings))
    typer.echo(json.dumps(answer, ensure_ascii=False, indent=2))


@app.command()
def plan(
    model: Annotated[Path, typer.Argument(help="A Clef GGUF (or a backbone-only qwen35 GGUF).")],
    vram: Annotated[
        str | None, typer.Option("--vram", help="Device memory to fit, e.g. 8GiB: reports the largest prompt that fits.")
    ] = None,
    max_prompt_tokens: Annotated[
        int, typer.Option("--ctx", help="Prompt limit to plan for (load's max_prompt_tokens).")
    ] = DEFAULT_MAX_PROMPT_TOKENS,
    ubatch: Ubatch = None,
    parallel: Parallel = DEFAULT_PARALLEL,
    n_gpu_layers: GpuLayers = -1,
    mmproj: Mmproj = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON on stdout.")] = False,
) -> None:
    """Device and host memory for a model at a prompt limit: weights by type, KV, recurrent state, compute buffer;
    with --mmproj, the vision tower's weights and the compute of its largest image."""
    from rich.markup import escape
    from rich.table import Table

    from .llama.plan import memory_plan, parse_size

    _check_ubatch(ubatch, max_prompt_tokens)
    result = _run(
        lambda: memory_plan(model, max_prompt_tokens, n_gpu_layers, parse_size(vram) if vram else None, ubatch, mmproj, parallel)
    )
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    mib = 1 << 20
    limit = f"prompt limit {max_prompt_tokens} tokens in ubatches of {result.ubatch}"
    title = f"{_line(model.name)}: {limit}, n_gpu_layers {n_gpu_layers}"
    table = Table(title=escape(title))  # the file name is text, not markup
    for column in ("component", "device MiB", "host MiB", "source"):
        table.add_column(column, justify="left" if column in ("component", "source") else "right")
    for line in result.lines:
        table.add_row(line.component, f"{line.device_bytes / mib:.1f}", f"{line.host_bytes / mib:.1f}", line.source)
    table.add_row("[bold]total", f"[bold]{result.device_bytes / mib:.1f}", f"[bold]{result.host_bytes / mib:.1f}", "")
    out = Console()
    out.print(table)
    out.print("weights by type: " + ", ".join(f"{k} {v / mib:.1f} MiB" for k, v in sorted(result.weights_by_type.items())))
    if not result.gpu_backend:
        out.print("[yellow]this llama.cpp build has no GPU backend: the compute buffer was measured on the CPU backend.[/]")
    if vram:
        fits = result.max_prompt_tokens
        fit = f"largest prompt that fits {vram}: {fits} tokens" if fits else f"does not fit {vram} even at 256 tokens"
        out.print(fit, markup=False, highlight=False)


@app.command()
def demo(n_gpu_layers: GpuLayers = 0) -> None:
    """Run the bundled tiny demo model on a bundled request. Its weights are random: so are its answers."""
    from .data import DEMO_CONTEXT, DEMO_MODEL, DEMO_REQUEST

    err.print("[yellow]demo model: a tiny Clef with RANDOM weights; the answers show the format, not a judgement.[/]")
    settings = {"n_gpu_layers": n_gpu_layers, "max_prompt_tokens": DEMO_CONTEXT, "state_cache": 0}
    answer = _run(lambda: _decide(DEMO_MODEL, str(DEMO_REQUEST), [], **settings))
    typer.echo(json.dumps(answer, ensure_ascii=False, indent=2))


def _print_report(report: Any) -> None:
    """The verdict in one line, then what else is wrong and what was read (plain text: no markup in messages)."""
    typer.echo(f"{report.source}: {report.summary}")
    for problem in report.problems:
        if problem.message not in report.summary:
            typer.echo(f"  - {problem.message}")
    for note in report.notes:
        typer.echo(f"  note: {note}")
    if report.header_size is not None:
        read = f"{report.bytes_read} bytes over HTTP" if report.bytes_read is not None else f"a {report.header_size}-byte header"
        deep = " and every tensor (--deep)" if report.deep else ""
        typer.echo(f"  read {read}{deep} of a {report.file_size}-byte file in {report.seconds:.3f} s")


@app.command()
def validate(
    source: Annotated[
        str,
        typer.Argument(
            help="A GGUF file, REPO_ID:FILENAME (or REPO_ID@REVISION:FILENAME) on the Hugging Face Hub, or an http(s) URL.",
            show_default=False,
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    deep: Annotated[
        bool, typer.Option("--deep", help="Also read every tensor: NaN, Inf or all-zero data (local files).")
    ] = False,
    sha256: Annotated[
        str | None, typer.Option("--sha256", metavar="HEX", help="Expected sha256 of the whole file (local files).")
    ] = None,
    mmproj: Annotated[
        str | None,
        typer.Option(
            "--mmproj",
            metavar="MMPROJ",
            help="Also validate this vision tower (mmproj) and whether it belongs to SOURCE.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Is SOURCE a complete Clef decision model, or a vision tower (mmproj) for one? Says so in one line, before
    anything is loaded.

    Reads only the header unless --deep; a remote SOURCE with HTTP range requests, before any download.
    With --mmproj, both files and their pairing (projector, embedding width = the backbone's hidden size).

    Exit codes: 0 complete, 5 corrupt or unreadable, 6 not a decision model (e.g. backbone-only; an mmproj of
    another projector), 7 incomplete or inconsistent (with --mmproj: also a pair that does not belong together).
    """
    from .check.validate import validate as run_validate

    if mmproj is not None:
        from .check.pair import PairReport, validate_pair

        def pair_work() -> PairReport:
            if sha256 is not None:
                raise SettingsError("--sha256 checks one file: validate the model and the mmproj separately")
            return validate_pair(source, mmproj, deep=deep)

        pair = _run(pair_work)
        if as_json:
            typer.echo(json.dumps(pair.to_dict(), indent=2))
        else:
            _print_report(pair.model)
            _print_report(pair.mmproj)
            typer.echo(f"pairing: {_line(pair.summary)}")
        raise typer.Exit(pair.exit_code)
    report = _run(lambda: run_validate(source, deep=deep, sha256=sha256))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print_report(report)
    raise typer.Exit(report.exit_code)


def _api_key(value: str | None) -> str | None:
    """An empty key would turn authentication off unnoticed; a key a client cannot send never matches."""
    if value is None:
        if os.environ.get("CLEF_GGUF_API_KEY") == "":  # click reads an empty variable as unset
            raise typer.BadParameter("CLEF_GGUF_API_KEY is set but empty; unset it to serve without a key")
        return None
    if not value:
        raise typer.BadParameter("the key is empty; omit --api-key (and CLEF_GGUF_API_KEY) to serve without a key")
    from .server.app import check_api_key

    try:
        return check_api_key(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


@app.command()
def serve(
    model: Annotated[Path, typer.Argument(help="The Clef GGUF to serve.", show_default=False)],
    host: Annotated[str, typer.Option(help="Interface to bind; the default keeps the server on this machine.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8000,
    n_gpu_layers: GpuLayers = 0,
    max_prompt_tokens: MaxPrompt = DEFAULT_MAX_PROMPT_TOKENS,
    ubatch: Ubatch = None,
    parallel: Parallel = DEFAULT_PARALLEL,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="CLEF_GGUF_API_KEY",
            callback=_api_key,
            help="Require Authorization: Bearer KEY on /v1 and /accounts (default: none; header ignored)",
        ),
    ] = None,
    max_queue: Annotated[
        int, typer.Option(min=1, help="Requests read at once, and admitted to decide (running + waiting); more get 503.")
    ] = 64,
    drain_timeout: Annotated[float, typer.Option(help="Seconds SIGTERM waits for admitted requests to finish.")] = 60.0,
    n_threads: Annotated[
        int | None,
        typer.Option(
            "--threads",
            help="llama.cpp CPU threads (default: the physical cores this process may use; with --ray, 1 per replica).",
            show_default=False,
        ),
    ] = None,
    header_timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds a connection has to send a request's headers; then 408.")
    ] = 10.0,
    body_timeout: Annotated[float, typer.Option(min=0.1, help="Seconds a request has to send its whole body; then 408.")] = 30.0,
    keep_alive: Annotated[float, typer.Option(min=0.1, help="Seconds an idle connection is kept after an answer.")] = 5.0,
    state_cache: Annotated[int, _state_cache_option(f"{DEFAULT_STATE_CACHE >> 30}GiB")] = DEFAULT_STATE_CACHE,
    mmproj: Mmproj = None,
    on_ray: Annotated[
        bool, typer.Option("--ray", help="Serve on Ray Serve: model replicas behind one endpoint (pip install 'clef-gguf[ray]').")
    ] = False,
    replicas: Annotated[
        int | None, typer.Option(min=1, help="With --ray: model replicas (default 1).", show_default=False)
    ] = None,
    autoscale: Annotated[
        str | None,
        typer.Option(metavar="MIN:MAX", help="With --ray: autoscale between MIN and MAX replicas.", show_default=False),
    ] = None,
    gpus_per_replica: Annotated[float, typer.Option(min=0, help="With --ray: GPUs Ray reserves per replica.")] = 0.0,
    ray_address: Annotated[
        str | None,
        typer.Option(
            envvar="RAY_ADDRESS",
            help="With --ray: the Ray cluster to deploy on (default: a local one, started here, on loopback).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve TypeSafe's System One API (POST /v1/systemone, GET /v1/models, GET /health) and Workers AI's
    (POST /accounts/ID/ai/run/@cf/cloudflare/clef[-flash], also under /client/v4) with this model."""
    from .runtime.images import MAX_IMAGES
    from .runtime.model import load
    from .server import HttpLimits
    from .server import serve as run_server

    _check_ubatch(ubatch, max_prompt_tokens)
    if on_ray:
        ray_options = {"n_threads": n_threads or 1, "gpus": gpus_per_replica, "n_gpu_layers": n_gpu_layers, "ubatch": ubatch}
        ray_options |= {"state_cache": state_cache, "mmproj": None if mmproj is None else str(mmproj.resolve())}
        ray_options |= {"parallel": parallel}
        ray_options |= {"max_prompt_tokens": max_prompt_tokens, "api_key": api_key, "max_queue": max_queue}
        ray_options |= {"body_timeout": body_timeout, "drain_timeout": drain_timeout}
        _serve_on_ray(model, replicas, autoscale, ray_options, host=host, port=port, keep_alive=keep_alive, address=ray_address)
        return
    if replicas is not None or autoscale is not None:
        _error("--replicas and --autoscale need --ray")
        raise typer.Exit(2)
    # Loaded before the port is bound: a file that loading rejects never gets a listening server.
    loaded = _run(
        lambda: load(
            model,
            n_gpu_layers=n_gpu_layers,
            max_prompt_tokens=max_prompt_tokens,
            n_threads=n_threads,
            ubatch=ubatch,
            state_cache=state_cache,
            mmproj=mmproj,
            parallel=parallel,
        )
    )
    url = f"http://{host}:{port}/v1/systemone"
    name = _line(loaded.name)  # general.name comes from the file: no escapes reach the terminal
    images = f", up to {MAX_IMAGES} images" if loaded.vision is not None else ""
    err.print(f"serving {name} on {url} (prompts up to {loaded.max_prompt_tokens} tokens{images})", markup=False, highlight=False)
    limits = HttpLimits(header_timeout_s=header_timeout, body_timeout_s=body_timeout, keep_alive_s=keep_alive)
    run_server(loaded, host=host, port=port, api_key=api_key, max_pending=max_queue, drain_timeout_s=drain_timeout, limits=limits)


def _check_files(model: Path, mmproj: Path | None) -> None:
    """The header checks `serve` runs at load: the model's, and the mmproj's with its pairing."""
    from .check.pair import open_vision
    from .check.validate import open_validated

    validated = open_validated(model)
    try:
        if mmproj is not None:
            open_vision(validated.file.header, mmproj)
    finally:
        validated.close()


def _serve_on_ray(
    model: Path,
    replicas: int | None,
    autoscale: str | None,
    options: dict[str, Any],
    *,
    host: str,
    port: int,
    keep_alive: float,
    address: str | None,
) -> None:
    """`serve --ray`: the same app on Ray Serve (server/ray_serve.py), its decisions on model replicas."""
    if replicas is not None and autoscale is not None:
        _error("--replicas and --autoscale exclude each other")
        raise typer.Exit(2)
    # The header check `serve` runs before binding, here before any Ray process starts: the same refusals and exit codes.
    _run(lambda: _check_files(model, options["mmproj"] and Path(options["mmproj"])))
    if address is None:
        from .server.ray_local import loopback_only

        loopback_only()  # the cluster started here listens on 127.0.0.1 only; before ray is imported
    try:
        from .server import ray_serve
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "ray":
            raise
        _error("serve --ray needs Ray Serve: pip install 'clef-gguf[ray]'")
        raise typer.Exit(2) from None
    from pydantic import ValidationError

    try:
        scaling = {"replicas": replicas or 1} if autoscale is None else {"autoscale": autoscale}
        settings = ray_serve.RaySettings(model=str(model.resolve()), **scaling, **options)
    except ValidationError as e:
        _error("; ".join(error["msg"] for error in e.errors()))
        raise typer.Exit(2) from None
    _run(lambda: ray_serve.run(settings, host=host, port=port, keep_alive_s=keep_alive, address=address))


def main() -> None:
    app()


if __name__ == "__main__":
    main()

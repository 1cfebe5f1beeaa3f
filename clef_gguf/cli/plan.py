"""`clef-gguf plan`: the memory a model needs at a prompt limit, as a table or JSON (llama.cpp measures it: imported
when the command runs, so --help loads none)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ..settings import N_GPU_LAYERS_ENV, LoadOptions
from ..table_checks import parse_size
from .errors import line, run
from .options import Mmproj, Parallel, Threads, Ubatch, check_ubatch, file_path, gpu_layers_default

if TYPE_CHECKING:
    from ..llama.plan import Plan

MIB = 1 << 20
# A plan is for a card: every layer on it unless told otherwise (load's own default is the CPU alone).
PlanGpuLayers = Annotated[
    int | None,
    typer.Option(
        "--n-gpu-layers",
        "-ngl",
        help=f"Backbone layers to plan on the device (-1: all; 0: the CPU alone). Default: ${N_GPU_LAYERS_ENV}, else -1.",
        show_default=False,
        callback=gpu_layers_default(-1),
    ),
]


def plan(
    model: Annotated[Path, typer.Argument(help="A Clef GGUF (or a backbone-only qwen35 GGUF).", parser=file_path)],
    vram: Annotated[
        str | None, typer.Option("--vram", help="Device memory to fit, e.g. 8GiB: reports the largest prompt that fits.")
    ] = None,
    max_prompt_tokens: Annotated[
        int, typer.Option("--ctx", help="Prompt limit to plan for (load's max_prompt_tokens).")
    ] = LoadOptions.max_prompt_tokens,
    ubatch: Ubatch = None,
    parallel: Parallel = LoadOptions.parallel,
    n_gpu_layers: PlanGpuLayers = None,
    mmproj: Mmproj = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON on stdout.")] = False,
    n_threads: Threads = LoadOptions.n_threads,
    adapters: Annotated[
        list[Path] | None,
        typer.Option(
            "--adapter", metavar="FILE", help="An adapter file over MODEL to count, loaded (repeatable).", show_default=False
        ),
    ] = None,
) -> None:
    """Device and host memory for a model at a prompt limit: weights by type, KV, recurrent state, compute buffer;
    with --mmproj, the vision tower's weights and the compute of its largest image; and the CPU threads a load with
    these options would compute on (the default measured now: runtime.md, Threads); with --adapter, each adapter's
    LoRA and head, loaded (a line each, and their total)."""
    check_ubatch(ubatch, max_prompt_tokens)

    def work() -> Plan:  # (a --vram that is no size is the library's SettingsError: exit 2)
        from ..llama.plan import memory_plan  # (here: a llama.cpp that cannot load is run's one line)

        size = parse_size(vram) if vram else None
        return memory_plan(model, max_prompt_tokens, n_gpu_layers, size, ubatch, mmproj, parallel, adapters or ())

    result = run(work)
    from ..llama.threads import default_threads, physical_threads  # (loaded by now)

    threads = n_threads or default_threads()
    if as_json:
        typer.echo(json.dumps({**result.to_dict(), "threads": threads}, indent=2))
    else:
        _print_plan(result, model, vram)
        given = "--threads" if n_threads else f"the default: {physical_threads()} physical cores, less those busy now"
        Console().print(f"CPU threads: {threads} ({given})", markup=False, highlight=False)


def _print_plan(result: Plan, model: Path, vram: str | None) -> None:
    from rich.table import Table  # (loaded for the table alone: --json and the other commands do without it)

    limit = f"prompt limit {result.n_ctx} tokens in ubatches of {result.ubatch}"
    title = f"{line(model.name)}: {limit}, n_gpu_layers {result.n_gpu_layers}"
    table = Table(title=escape(title))  # the file name is text, not markup
    for column in ("component", "device MiB", "host MiB", "source"):
        table.add_column(column, justify="left" if column in ("component", "source") else "right")
    for row in result.lines:
        table.add_row(escape(line(row.component)), f"{row.device_bytes / MIB:.1f}", f"{row.host_bytes / MIB:.1f}", row.source)
    table.add_row("[bold]total", f"[bold]{result.device_bytes / MIB:.1f}", f"[bold]{result.host_bytes / MIB:.1f}", "")
    out = Console()
    out.print(table)
    if result.adapters:
        device = sum(a.line.device_bytes for a in result.adapters) / MIB
        host = sum(a.line.host_bytes for a in result.adapters) / MIB
        total = f"{len(result.adapters)} adapters: {result.adapter_bytes / MIB:.1f} MiB ({device:.1f} device, {host:.1f} host)"
        out.print(total, markup=False, highlight=False)
    out.print("weights by type: " + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in sorted(result.weights_by_type.items())))
    if not result.gpu_backend:
        out.print("[yellow]this llama.cpp build has no GPU backend: the compute buffer was measured on the CPU backend.[/]")
    if vram:
        fits = result.max_prompt_tokens
        fit = f"largest prompt that fits {vram}: {fits} tokens" if fits else f"does not fit {vram} even at 256 tokens"
        out.print(fit, markup=False, highlight=False)

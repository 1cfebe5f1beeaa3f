"""`clef-gguf validate`: is a file (local, on the Hub, or at a URL) a complete Clef model, or a vision tower for one."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from .errors import fail, line, run

if TYPE_CHECKING:
    from ..check.report import PairReport, Report


def _print_report(report: Report) -> None:
    """The verdict in one line, then what else is wrong and what was read (plain text: no markup in messages)."""
    typer.echo(f"{report.source}: {report.summary}")
    for problem in report.problems:
        if problem.message not in report.summary:
            typer.echo(f"  - {problem.message}")
    for note in report.notes:
        typer.echo(f"  note: {note}")
    if report.temperatures:
        shown = ", ".join(f"{name} {value:g}" for name, value in report.temperatures.items())
        typer.echo(f"  softmax temperatures: {shown}")
    if report.header_size is not None:
        read = f"{report.bytes_read} bytes over HTTP" if report.bytes_read is not None else f"a {report.header_size}-byte header"
        deep = " and every tensor (--deep)" if report.deep else ""
        typer.echo(f"  read {read}{deep} of a {report.file_size}-byte file in {report.seconds:.3f} s")


def _show(verdict: Report | PairReport, as_json: bool) -> NoReturn:
    """The verdict as JSON, or in lines: a file's report, or a pair's two reports and the pairing; exits with its code."""
    from ..check.report import Report  # (loaded by the check that made the verdict)

    if as_json:
        typer.echo(json.dumps(verdict.to_dict(), indent=2))
    elif isinstance(verdict, Report):
        _print_report(verdict)
    else:
        for report in (verdict.first, verdict.second):
            _print_report(report)
        typer.echo(f"pairing: {line(verdict.summary)}")
    raise typer.Exit(verdict.exit_code)


AdapterOption = Annotated[
    str | None,
    typer.Option(
        "--adapter",
        metavar="FILE",
        help="Also validate this adapter file and whether it was trained over SOURCE (both local files).",
        show_default=False,
    ),
]


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
    adapter: AdapterOption = None,
) -> None:
    """Is SOURCE a complete Clef decision model, or a vision tower (mmproj) for one? Says so in one line, before
    anything is loaded.

    Reads only the header unless --deep; a remote SOURCE with HTTP range requests, before any download.
    With --mmproj, both files and their pairing (projector, embedding width = the backbone's hidden size).

    Exit codes: 0 complete, 5 corrupt or unreadable, 6 not a decision model (e.g. backbone-only; an mmproj of
    another projector), 7 incomplete or inconsistent (with --mmproj or --adapter: also a pair that does not belong
    together, e.g. an adapter trained over another base).
    """
    if adapter is not None and (mmproj is not None or sha256 is not None):
        fail("--adapter checks a base and an adapter: validate --mmproj and --sha256 separately")
    if mmproj is not None and sha256 is not None:
        fail("--sha256 checks one file: validate the model and the mmproj separately")

    def verdict() -> Report | PairReport:
        # The checks (gguf-py, numpy, the format's tables) load when validate runs, not with every command; inside
        # run(), so that a signal while they load is run's one line.
        from ..check.adapter_pair import validate_adapter_pair
        from ..check.pair import validate_pair
        from ..check.validate import validate as validate_file

        if adapter is not None:
            return validate_adapter_pair(source, adapter, deep=deep)
        if mmproj is None:
            return validate_file(source, deep=deep, sha256=sha256)
        return validate_pair(source, mmproj, deep=deep)

    _show(run(verdict), as_json)

"""The `clef-gguf` command's Typer app: its commands and the --version option."""

from __future__ import annotations

from typing import Annotated

import typer

from . import convert, decide, plan, quality, serve, validate

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(show: bool) -> None:
    if show:
        from .. import __version__

        typer.echo(f"clef-gguf {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Cloudflare's Clef decision models on llama.cpp: convert, validate and run them."""


for command in (convert.convert, convert.graft, decide.decide, plan.plan, decide.demo, validate.validate, serve.serve):
    app.command()(command)
app.command("eval")(quality.eval_)
app.command()(quality.compare)
app.command()(quality.calibrate)

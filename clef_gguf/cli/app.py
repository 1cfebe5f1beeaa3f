"""The `clef-gguf` command's Typer app: its commands and the --version option."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from typer.core import TyperArgument, TyperCommand, TyperOption

from . import convert, decide, plan, quality, serve, validate
from .errors import one_line


class _Command(TyperCommand):
    """Help as click writes it: a required argument MODEL and an optional one [MODEL] in the usage line, and no type
    after a flag (typer 0.2x writes {MODEL} and <bool>). An argument without a metavar is named by its upper-cased
    parameter name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
                param.metavar = ""  # (an empty type column)
            elif isinstance(param, TyperArgument) and param.metavar is None and param.name:
                param.metavar = param.name.upper() + ("..." if param.nargs != 1 else "")

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None and option.metavar is None:
            option.metavar = ""
        return option

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar or ""
                pieces.append(name if param.required else f"[{name}]")
        return pieces


app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts print as written: Rich markup would eat `[ray]` of pip install 'clef-gguf[ray]'
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
    app.command(cls=_Command)(one_line(command))
app.command("eval", cls=_Command)(one_line(quality.eval_))
app.command(cls=_Command)(one_line(quality.compare))
app.command(cls=_Command)(one_line(quality.calibrate))

"""Options that several commands share, named as llama-server names them where it has them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..llama.plan import parse_size
from ..settings import MAX_PARALLEL, LoadOptions, LogFormat, ServeSettings, help_of
from .errors import fail

GpuLayers = Annotated[
    int,
    typer.Option(
        "--n-gpu-layers",
        "-ngl",
        envvar="CLEF_GGUF_N_GPU_LAYERS",  # as llama-server's LLAMA_ARG_N_GPU_LAYERS: for a fixed command line
        help=help_of(LoadOptions, "n_gpu_layers"),
    ),
]
MaxPrompt = Annotated[
    int,
    typer.Option(
        "--max-prompt-tokens",
        "--ctx",
        min=1,
        help=help_of(LoadOptions, "max_prompt_tokens"),
    ),
]
Mmproj = Annotated[
    Path | None,
    typer.Option(
        "--mmproj",
        help=help_of(LoadOptions, "mmproj"),
        show_default=False,
    ),
]
Ubatch = Annotated[
    int | None,
    typer.Option(
        "--ubatch",
        min=1,
        help=help_of(LoadOptions, "ubatch"),
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
        help=help_of(LoadOptions, "parallel"),
    ),
]


def _size(value: str | int) -> int:
    if isinstance(value, int):  # the default, which click hands to the parser too
        return value
    try:
        return parse_size(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def state_cache_option(default: str | None = None) -> Any:
    """--state-cache, whose default LoadOptions' help gives unless the command has its own."""
    text = help_of(LoadOptions, "state_cache")
    return typer.Option(
        "--state-cache",
        metavar="SIZE",
        parser=_size,
        help=text if default is None else text.rsplit(" Default:", 1)[0] + f" Default: {default}.",
        show_default=False,
    )


def check_ubatch(ubatch: int | None, max_prompt_tokens: int) -> None:
    if ubatch is not None and ubatch > max_prompt_tokens:
        fail(f"--ubatch ({ubatch}) cannot exceed --max-prompt-tokens ({max_prompt_tokens})")


LogFormatOption = Annotated[
    LogFormat,
    typer.Option(
        "--log-format",
        help=help_of(ServeSettings, "log_format"),
    ),
]

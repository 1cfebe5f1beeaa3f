"""Options that several commands share, named as llama-server names them where it has them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from ..llama.defaults import DEFAULT_UBATCH, MAX_PARALLEL
from ..llama.plan import parse_size
from .errors import fail

GpuLayers = Annotated[
    int,
    typer.Option(
        "--n-gpu-layers",
        "-ngl",
        envvar="CLEF_GGUF_N_GPU_LAYERS",  # as llama-server's LLAMA_ARG_N_GPU_LAYERS: for a fixed command line
        help="Backbone layers to offload to the GPU (-1: all; 0: the CPU alone).",
    ),
]
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
    try:
        return parse_size(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def state_cache_option(default: str) -> Any:
    return typer.Option(
        "--state-cache",
        metavar="SIZE",
        parser=_size,
        help="Host memory for the backbone states of recent requests' states (e.g. 512MiB; 0 turns it off): a request "
        f"repeating a state prefills only its schema. Default: {default}.",
        show_default=False,
    )


def check_ubatch(ubatch: int | None, max_prompt_tokens: int) -> None:
    if ubatch is not None and ubatch > max_prompt_tokens:
        fail(f"--ubatch ({ubatch}) cannot exceed --max-prompt-tokens ({max_prompt_tokens})")


LogFormatOption = Annotated[
    Literal["text", "json"],  # server/observe.py's LOG_FORMATS
    typer.Option(
        "--log-format",
        help="The access log's lines on stderr, one per request: text (key=value) or json (one object per line).",
    ),
]

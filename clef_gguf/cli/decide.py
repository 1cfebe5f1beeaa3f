"""`clef-gguf decide` and `clef-gguf demo`: one request answered, its response JSON on stdout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from ..data import DEMO_CONTEXT, DEMO_MODEL, DEMO_REQUEST
from ..llama.defaults import DEFAULT_MAX_PROMPT_TOKENS
from ..runtime.model import load
from ..runtime.reader import read_request
from .errors import err, fail, run
from .options import GpuLayers, MaxPrompt, Mmproj, Ubatch, check_ubatch, state_cache_option


def _decide(model_path: Path, request_path: str, images: list[Path], **settings: Any) -> dict[str, Any]:
    request = read_request(request_path, images)  # before loading: a bad request is refused at once
    with load(model_path, **settings) as model:
        return model.decide(request)


def decide(
    paths: Annotated[
        list[str],
        typer.Argument(help="[MODEL.gguf] REQUEST.json (- reads stdin). Without MODEL: the demo model.", show_default=False),
    ],
    n_gpu_layers: GpuLayers = 0,
    max_prompt_tokens: MaxPrompt = DEFAULT_MAX_PROMPT_TOKENS,
    ubatch: Ubatch = None,
    state_cache: Annotated[int, state_cache_option("0 (one request has nothing to reuse)")] = 0,
    mmproj: Mmproj = None,
    image: Annotated[
        list[Path] | None,
        typer.Option("--image", help="An image file (PNG, JPEG, WebP) for the request's images; repeat for more (up to 4)."),
    ] = None,
) -> None:
    """Answer a SystemOne request; prints the response JSON on stdout. Images: the request's `images` (data URLs),
    and --image files, with --mmproj."""
    if not 1 <= len(paths) <= 2:
        fail("expected [MODEL.gguf] REQUEST.json")
    model_path, request_path = (Path(paths[0]), paths[1]) if len(paths) == 2 else (DEMO_MODEL, paths[0])
    check_ubatch(ubatch, max_prompt_tokens)
    settings = {
        "n_gpu_layers": n_gpu_layers,
        "max_prompt_tokens": max_prompt_tokens,
        "ubatch": ubatch,
        "state_cache": state_cache,
    }
    answer = run(lambda: _decide(model_path, request_path, image or [], mmproj=mmproj, **settings))
    typer.echo(json.dumps(answer, ensure_ascii=False, indent=2))


def demo(n_gpu_layers: GpuLayers = 0) -> None:
    """Run the bundled tiny demo model on a bundled request. Its weights are random: so are its answers."""
    err.print("[yellow]demo model: a tiny Clef with RANDOM weights; the answers show the format, not a judgement.[/]")
    settings = {"n_gpu_layers": n_gpu_layers, "max_prompt_tokens": DEMO_CONTEXT, "state_cache": 0}
    answer = run(lambda: _decide(DEMO_MODEL, str(DEMO_REQUEST), [], **settings))
    typer.echo(json.dumps(answer, ensure_ascii=False, indent=2))

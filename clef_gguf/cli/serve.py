"""`clef-gguf serve`: its options parsed, then served by server/launch.py (uvicorn, or Ray Serve with --ray)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from ..llama.defaults import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_PARALLEL, DEFAULT_STATE_CACHE
from .errors import fail, run
from .options import GpuLayers, LogFormatOption, MaxPrompt, Mmproj, Parallel, Ubatch, check_ubatch, state_cache_option


def _api_key(value: str | None) -> str | None:
    """An empty key would turn authentication off unnoticed; a key a client cannot send never matches."""
    if value is None:
        if os.environ.get("CLEF_GGUF_API_KEY") == "":  # click reads an empty variable as unset
            raise typer.BadParameter("CLEF_GGUF_API_KEY is set but empty; unset it to serve without a key")
        return None
    if not value:
        raise typer.BadParameter("the key is empty; omit --api-key (and CLEF_GGUF_API_KEY) to serve without a key")
    from ..server.app import check_api_key

    try:
        return check_api_key(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        envvar="CLEF_GGUF_API_KEY",
        callback=_api_key,
        help="Require Authorization: Bearer KEY on /v1 and /accounts (default: none; header ignored)",
    ),
]
MaxQueueOption = Annotated[
    int, typer.Option(min=1, help="Requests read at once, and admitted to decide (running + waiting); more get 503.")
]
NThreadsOption = Annotated[
    int | None,
    typer.Option(
        "--threads",
        help="llama.cpp CPU threads (default: the physical cores this process may use; with --ray, 1 per replica).",
        show_default=False,
    ),
]
HeaderTimeoutOption = Annotated[
    float, typer.Option(min=0.1, help="Seconds a connection has to send a request's headers; then 408.")
]
MinBodyRateOption = Annotated[
    float,
    typer.Option(min=0, help="Bytes/s a body must average once --body-grace has passed, or 408 (Kestrel's rule; 0: none)."),
]
OnRayOption = Annotated[
    bool, typer.Option("--ray", help="Serve on Ray Serve: model replicas behind one endpoint (pip install 'clef-gguf[ray]').")
]
ReplicasOption = Annotated[int | None, typer.Option(min=1, help="With --ray: model replicas (default 1).", show_default=False)]
AutoscaleOption = Annotated[
    str | None,
    typer.Option(metavar="MIN:MAX", help="With --ray: autoscale between MIN and MAX replicas.", show_default=False),
]
RayAddressOption = Annotated[
    str | None,
    typer.Option(
        envvar="RAY_ADDRESS",
        help="With --ray: the Ray cluster to deploy on (default: a local one, started here, on loopback).",
        show_default=False,
    ),
]


def serve(
    model: Annotated[Path, typer.Argument(help="The Clef GGUF to serve.", show_default=False)],
    host: Annotated[str, typer.Option(help="Interface to bind; the default keeps the server on this machine.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8000,
    n_gpu_layers: GpuLayers = 0,
    max_prompt_tokens: MaxPrompt = DEFAULT_MAX_PROMPT_TOKENS,
    ubatch: Ubatch = None,
    parallel: Parallel = DEFAULT_PARALLEL,
    api_key: ApiKeyOption = None,
    max_queue: MaxQueueOption = 64,
    drain_timeout: Annotated[float, typer.Option(help="Seconds SIGTERM waits for admitted requests to finish.")] = 60.0,
    n_threads: NThreadsOption = None,
    header_timeout: HeaderTimeoutOption = 10.0,
    body_timeout: Annotated[float, typer.Option(min=0.1, help="Seconds a request has to send its whole body; then 408.")] = 30.0,
    min_body_rate: MinBodyRateOption = 240.0,
    body_grace: Annotated[float, typer.Option(min=0, help="Seconds before --min-body-rate applies to a body.")] = 5.0,
    keep_alive: Annotated[float, typer.Option(min=0.1, help="Seconds an idle connection is kept after an answer.")] = 5.0,
    log_format: LogFormatOption = "text",
    state_cache: Annotated[int, state_cache_option(f"{DEFAULT_STATE_CACHE >> 30}GiB")] = DEFAULT_STATE_CACHE,
    mmproj: Mmproj = None,
    on_ray: OnRayOption = False,
    replicas: ReplicasOption = None,
    autoscale: AutoscaleOption = None,
    gpus_per_replica: Annotated[float, typer.Option(min=0, help="With --ray: GPUs Ray reserves per replica.")] = 0.0,
    ray_address: RayAddressOption = None,
) -> None:
    """Serve TypeSafe's System One API (POST /v1/systemone, GET /v1/models, GET /health) and Workers AI's
    (POST /accounts/ID/ai/run/@cf/cloudflare/clef[-flash], also under /client/v4) with this model."""
    from ..server import HttpLimits
    from ..server.launch import Endpoint, RayScale, serve_file, serve_on_ray

    check_ubatch(ubatch, max_prompt_tokens)
    limits = HttpLimits(
        header_timeout_s=header_timeout,
        body_timeout_s=body_timeout,
        min_body_rate=min_body_rate,
        body_grace_s=body_grace,
        keep_alive_s=keep_alive,
    )
    endpoint = Endpoint(host, port, api_key, max_queue, drain_timeout, limits, log_format)
    options = {"n_gpu_layers": n_gpu_layers, "max_prompt_tokens": max_prompt_tokens, "n_threads": n_threads, "ubatch": ubatch}
    options |= {"parallel": parallel, "state_cache": state_cache, "mmproj": mmproj}
    if on_ray:
        if replicas is not None and autoscale is not None:
            fail("--replicas and --autoscale exclude each other")
        scale = RayScale(replicas=replicas, autoscale=autoscale, gpus=gpus_per_replica, address=ray_address)
        run(lambda: serve_on_ray(model, endpoint, scale, **options))
    elif replicas is not None or autoscale is not None:
        fail("--replicas and --autoscale need --ray")
    else:
        run(lambda: serve_file(model, endpoint, **options))

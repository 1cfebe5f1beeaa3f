"""`clef-gguf serve`: its options parsed, then served by server/launch.py (uvicorn, or Ray Serve with --ray)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from ..settings import API_KEY_ENV, HttpLimits, RayScale, ServeSettings, body_limit, bounds_of, help_of
from .errors import fail, run, serve_until_stopped
from .options import LogFormatOption, ServedFlags, file_path, flag_groups, size_flag


def _api_key(value: str | None) -> str | None:
    """An empty key would turn authentication off unnoticed; a key a client cannot send never matches."""
    if value is None:
        if os.environ.get(API_KEY_ENV) == "":  # click reads an empty variable as unset
            raise typer.BadParameter(f"{API_KEY_ENV} is set but empty; unset it to serve without a key")
        return None
    if not value:
        raise typer.BadParameter(f"the key is empty; omit --api-key (and {API_KEY_ENV}) to serve without a key")
    from ..server.app import check_api_key

    try:
        return check_api_key(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


# Each option's help and bounds are its setting's (settings.py), as a Ray config's `args` are held to them.
def _serve(name: str, **option: object) -> typer.models.OptionInfo:
    return typer.Option(help=help_of(ServeSettings, name), **bounds_of(ServeSettings, name), **option)  # type: ignore[arg-type]


def _http(name: str) -> typer.models.OptionInfo:
    return typer.Option(help=help_of(HttpLimits, name), **bounds_of(HttpLimits, name))  # type: ignore[arg-type]


def _ray(name: str, **option: object) -> typer.models.OptionInfo:
    return typer.Option(help=help_of(RayScale, name), show_default=False, **bounds_of(RayScale, name), **option)  # type: ignore[arg-type]


MaxBodyBuffer = Annotated[
    int,
    typer.Option(
        "--max-body-buffer", metavar="SIZE", parser=size_flag, help=help_of(HttpLimits, "max_body_buffer"), show_default=False
    ),
]
ApiKeyOption = Annotated[str | None, _serve("api_key", envvar=API_KEY_ENV, callback=_api_key)]
ServeOnRayOption = Annotated[
    bool, typer.Option("--ray", help="Serve on Ray Serve: model replicas behind one endpoint (pip install 'clef-gguf[ray]').")
]
AllowedHosts = Annotated[
    list[str] | None,
    typer.Option("--allowed-host", metavar="NAME", help=help_of(ServeSettings, "allowed_hosts"), show_default=False),
]
AllowedOrigins = Annotated[
    list[str] | None,
    typer.Option("--allowed-origin", metavar="ORIGIN", help=help_of(ServeSettings, "allowed_origins"), show_default=False),
]
D, H = ServeSettings, HttpLimits  # (the defaults below)


def _http_limits(max_prompt_tokens: int, images: bool, limits: HttpLimits) -> HttpLimits:
    """`limits`, unless its body buffer is under the body limit (no largest body could be read): refused before the
    model loads."""
    if limits.max_body_buffer < (cap := body_limit(max_prompt_tokens, images)):
        fail(f"--max-body-buffer ({limits.max_body_buffer} bytes) is under the body limit ({cap} bytes): raise it or lower --ctx")
    return limits


@flag_groups
def serve(
    model: Annotated[Path, typer.Argument(help="The Clef GGUF to serve.", show_default=False, parser=file_path)],
    host: Annotated[str, _serve("host")] = D.host,
    port: Annotated[int, _serve("port")] = D.port,
    api_key: ApiKeyOption = D.api_key,
    max_queue: Annotated[int, _serve("max_queue")] = D.max_queue,
    drain_timeout: Annotated[float, _serve("drain_timeout")] = D.drain_timeout,
    header_timeout: Annotated[float, _http("header_timeout")] = H.header_timeout,
    body_timeout: Annotated[float, _http("body_timeout")] = H.body_timeout,
    min_body_rate: Annotated[float, _http("min_body_rate")] = H.min_body_rate,
    body_grace: Annotated[float, _http("body_grace")] = H.body_grace,
    keep_alive: Annotated[float, _http("keep_alive")] = H.keep_alive,
    max_body_buffer: MaxBodyBuffer = H.max_body_buffer,
    max_body_readers: Annotated[int, _http("max_body_readers")] = H.max_body_readers,
    log_format: LogFormatOption = D.log_format,
    ui: Annotated[bool, _serve("ui")] = D.ui,
    allowed_host: AllowedHosts = None,
    allowed_origin: AllowedOrigins = None,
    metrics_adapter_cap: Annotated[int, _serve("metrics_adapter_cap")] = D.metrics_adapter_cap,
    on_ray: ServeOnRayOption = False,
    replicas: Annotated[int | None, _ray("replicas")] = RayScale.replicas,
    autoscale: Annotated[str | None, _ray("autoscale", metavar="MIN:MAX")] = RayScale.autoscale,
    gpus_per_replica: Annotated[float, _ray("gpus")] = RayScale.gpus,
    ray_address: Annotated[str | None, _ray("address", envvar="RAY_ADDRESS")] = RayScale.address,
    *,
    load: ServedFlags,
) -> None:
    """Serve TypeSafe's System One API (POST /v1/systemone, GET /v1/models, GET /health) and Workers AI's
    (POST /accounts/ID/ai/run/@cf/cloudflare/clef[-flash], also under /client/v4) with this model."""
    from ..server.launch import serve_file, serve_on_ray

    spec = load.spec(model)  # (an --ubatch over --ctx refused first)
    http = {"header_timeout": header_timeout, "body_timeout": body_timeout, "min_body_rate": min_body_rate}
    http |= {"body_grace": body_grace, "keep_alive": keep_alive, "max_body_buffer": max_body_buffer}
    images = load.mmproj is not None
    limits = _http_limits(load.max_prompt_tokens, images, HttpLimits(**http, max_body_readers=max_body_readers))
    served = (host, port, api_key, max_queue, drain_timeout, limits, log_format, ui)
    names = (tuple(allowed_host or ()), tuple(allowed_origin or ()))
    settings = run(lambda: ServeSettings(*served, *names, metrics_adapter_cap), signals=False)  # (a name refused: exit 2)
    if on_ray:
        if replicas is not None and autoscale is not None:
            fail("--replicas and --autoscale exclude each other")
        scale = RayScale(replicas=replicas, autoscale=autoscale, gpus=gpus_per_replica, address=ray_address)
        serve_until_stopped(lambda: serve_on_ray(spec, settings, scale))
    elif replicas is not None or autoscale is not None:
        fail("--replicas and --autoscale need --ray")
    else:
        serve_until_stopped(lambda: serve_file(spec, settings))

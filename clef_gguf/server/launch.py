"""`clef-gguf serve`, from its settings: one model loaded and served on uvicorn (run.py), or the same app on
Ray Serve (ray_serve.py), its decisions made by model replicas.

Either way the file is checked before anything listens: the plain server loads it before binding its port,
and --ray runs the header checks loading runs before any Ray process starts, so that a file loading would
refuse gets the same message and exit code, and never a listening server.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..check.pair import open_vision
from ..check.report import printable
from ..check.validate import open_validated
from ..errors import SettingsError
from ..runtime.images import MAX_IMAGES
from ..runtime.model import load
from .app import DEFAULT_MAX_PENDING
from .observe import LogFormat
from .protocol import HttpLimits
from .run import DEFAULT_DRAIN_TIMEOUT_S, serve


@dataclass(frozen=True)
class Endpoint:
    """Where and how requests are taken, whichever serves them."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_PENDING  # bodies read at once, and decisions admitted
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    limits: HttpLimits = field(default_factory=HttpLimits)  # (on Ray, its proxy's own, but for the body and keep-alive)
    log_format: LogFormat = "text"  # of the access log lines


@dataclass(frozen=True)
class RayScale:
    """How many replicas, on which cluster: `serve --ray`'s own options."""

    replicas: int | None = None  # default 1
    autoscale: str | None = None  # "MIN:MAX"; when given, replicas is not
    gpus: float = 0.0  # reserved per replica
    address: str | None = None  # None: a local cluster, started here, on loopback


def serve_file(model: Path, endpoint: Endpoint, **load_options: Any) -> None:
    """Load `model` with load()'s options, say where it is served on stderr, and serve it until SIGTERM or SIGINT."""
    loaded = load(model, **load_options)
    url = f"http://{endpoint.host}:{endpoint.port}/v1/systemone"
    name = printable(loaded.name)  # general.name comes from the file: no escapes reach the terminal
    images = f", up to {MAX_IMAGES} images" if loaded.vision is not None else ""
    print(f"serving {name} on {url} (prompts up to {loaded.max_prompt_tokens} tokens{images})", file=sys.stderr, flush=True)
    serve(
        loaded,
        host=endpoint.host,
        port=endpoint.port,
        api_key=endpoint.api_key,
        max_pending=endpoint.max_queue,
        drain_timeout_s=endpoint.drain_timeout_s,
        limits=endpoint.limits,
        log_format=endpoint.log_format,
    )


def check_files(model: Path, mmproj: Path | None) -> None:
    """The header checks loading runs: the model's, and the mmproj's with its pairing."""
    validated = open_validated(model)
    try:
        if mmproj is not None:
            open_vision(validated.file.header, mmproj)
    finally:
        validated.close()


def serve_on_ray(model: Path, endpoint: Endpoint, scale: RayScale, **load_options: Any) -> None:
    """`model` on Ray Serve (the ingress over model replicas, each loaded with load()'s options), until SIGTERM
    or SIGINT. Without Ray Serve installed, or with settings RaySettings refuses, a SettingsError."""
    mmproj = load_options.get("mmproj")
    check_files(model, mmproj and Path(mmproj))
    if scale.address is None:
        from .ray_local import loopback_only

        loopback_only()  # the cluster started here listens on 127.0.0.1 only; before ray is imported
    try:
        from . import ray_cluster, ray_serve
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "ray":
            raise
        raise SettingsError("serve --ray needs Ray Serve: pip install 'clef-gguf[ray]'") from None
    from pydantic import ValidationError

    scaling: dict[str, Any] = {"replicas": scale.replicas or 1} if scale.autoscale is None else {"autoscale": scale.autoscale}
    # Paths as every node sees them; llama.cpp's threads default to 1 per replica (Ray reserves a CPU for each).
    placed = {**load_options, "mmproj": mmproj and str(Path(mmproj).resolve()), "n_threads": load_options.get("n_threads") or 1}
    served = {"api_key": endpoint.api_key, "max_queue": endpoint.max_queue, "drain_timeout": endpoint.drain_timeout_s}
    served |= {"log_format": endpoint.log_format}
    try:
        settings = ray_serve.RaySettings(
            model=str(model.resolve()),
            gpus=scale.gpus,
            body_timeout=endpoint.limits.body_timeout_s,
            **scaling,
            **placed,
            **served,
        )
    except ValidationError as e:
        raise SettingsError("; ".join(error["msg"] for error in e.errors())) from None
    ray_cluster.run(
        settings, host=endpoint.host, port=endpoint.port, keep_alive_s=endpoint.limits.keep_alive_s, address=scale.address
    )

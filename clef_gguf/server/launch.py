"""`clef-gguf serve`, from its settings: one model loaded and served on uvicorn (run.py), or the same app on
Ray Serve (ray_serve.py), its decisions made by model replicas.

Either way the file is checked before anything listens: the plain server loads it before binding its port,
and --ray runs the header checks loading runs before any Ray process starts, so that a file loading would
refuse gets the same message and exit code, and never a listening server.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path

from ..check.pair import open_vision
from ..check.report import printable
from ..check.validate import open_validated
from ..errors import SettingsError
from ..runtime.catalog import Catalog
from ..runtime.images import MAX_IMAGES
from ..runtime.model import load
from ..settings import LoadOptions, RayScale, ServeSettings
from .run import serve


def serve_file(model: Path, settings: ServeSettings, options: LoadOptions) -> None:
    """Load `model` with `options`, say where it is served on stderr, and serve it until SIGTERM or SIGINT."""
    loaded = load(model, **options.kwargs())
    url = f"http://{settings.host}:{settings.port}/v1/systemone"
    name = printable(loaded.name)  # general.name comes from the file: no escapes reach the terminal
    images = f", up to {MAX_IMAGES} images" if loaded.vision is not None else ""
    print(f"serving {name} on {url} (prompts up to {loaded.max_prompt_tokens} tokens{images})", file=sys.stderr, flush=True)
    serve(loaded, settings)


def check_files(model: Path, mmproj: Path | None, options: LoadOptions | None = None, adapter: Path | None = None) -> None:
    """The header checks loading runs: the model's, the mmproj's with its pairing, and the named adapters' (or the
    one `adapter` that answers everything: decide's) with theirs (each adapter file validated against the model, as
    Catalog does at load)."""
    validated = open_validated(model)
    try:
        if mmproj is not None:
            open_vision(validated.file.header, mmproj)
        if options is not None and (options.adapters or options.adapter_dir is not None or adapter is not None):
            many = {"adapters": options.adapters, "adapter_dir": options.adapter_dir, "base_head": options.base_head}
            many = {"adapter": adapter, "base_head": options.base_head} if adapter is not None else many
            Catalog(validated.file, validated.description, validated.file.identity(), **many).close()
    finally:
        validated.close()


def _placed(model: Path, options: LoadOptions) -> tuple[str, LoadOptions]:
    """The paths as every node sees them (absolute): the model's, the vision tower's and the adapters'."""
    adapters = options.adapters and {name: str(Path(path).resolve()) for name, path in options.adapters.items()}
    folder = options.adapter_dir and str(Path(options.adapter_dir).resolve())
    mmproj = options.mmproj and str(Path(options.mmproj).resolve())
    return str(model.resolve()), replace(options, mmproj=mmproj, adapters=adapters or None, adapter_dir=folder)


def serve_on_ray(model: Path, settings: ServeSettings, options: LoadOptions, scale: RayScale) -> None:
    """`model` on Ray Serve (the ingress over model replicas, each loaded with `options`), until SIGTERM
    or SIGINT. Without Ray Serve installed, or with settings that cannot work there, a SettingsError."""
    mmproj = options.mmproj
    check_files(model, mmproj and Path(mmproj), options)
    from .ray_local import bounded_connect, loopback_only

    if scale.address is None:
        loopback_only()  # the cluster started here listens on 127.0.0.1 only; before ray is imported
    else:
        bounded_connect()  # an address where no cluster answers: refused in seconds, not minutes
    try:
        from . import ray_cluster, ray_serve
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "ray":
            raise
        raise SettingsError("serve --ray needs Ray Serve: pip install 'clef-gguf[ray]'") from None
    path, placed = _placed(model, options)
    # Through the checks a config file's `args` get (the autoscale range among them).
    checked = ray_serve.validated(asdict(ray_serve.RaySettings(path, settings, placed, scale)))
    ray_cluster.run(checked)

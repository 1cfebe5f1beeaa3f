"""`clef-gguf serve`, from its settings: one model loaded and served on uvicorn (run.py), or the same app on
Ray Serve (ray_serve.py), its decisions made by model replicas.

Either way the file is checked before anything listens: the plain server loads it before binding its port,
and --ray runs the header checks loading runs (runtime/encoder.check_spec) before any Ray process starts, so that a
file loading would refuse gets the same message and exit code, and never a listening server.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

from ..errors import SettingsError, printable
from ..runtime.encoder import check_spec
from ..runtime.images import MAX_IMAGES
from ..runtime.model import ClefModel
from ..settings import ModelSpec, RayScale, ServeSettings
from .adapter_metrics import AdapterCounts, local_view
from .run import listen, serve, url_host


def serve_file(spec: ModelSpec, settings: ServeSettings) -> int | None:
    """Load the model `spec` declares, say where it is served on stderr, and serve it until SIGTERM, SIGINT or SIGHUP;
    the signal that stopped it, once drained."""
    counts = AdapterCounts(settings.metrics_adapter_cap)  # (the per-adapter series: the decider and the sources tell it)
    loaded = ClefModel(spec, counts, counts)
    try:
        sock = listen(settings)  # before the line saying it serves: an address in use is said instead, exit 2
    except BaseException:
        loaded.close()
        raise
    url = f"http://{url_host(settings.host)}:{settings.port}/v1/systemone"
    name = printable(loaded.name)  # general.name comes from the file: no escapes reach the terminal
    images = f", up to {MAX_IMAGES} images" if loaded.vision is not None else ""
    print(f"serving {name} on {url} (prompts up to {loaded.max_prompt_tokens} tokens{images})", file=sys.stderr, flush=True)
    return serve(loaded, settings, local_view(counts, loaded.resident_adapters), sock)


def serve_on_ray(spec: ModelSpec, settings: ServeSettings, scale: RayScale) -> int | None:
    """The model `spec` declares on Ray Serve (the ingress over model replicas, each loading it), until SIGTERM,
    SIGINT or SIGHUP; the signal, once drained. Without Ray Serve installed, or with settings that cannot work there,
    a SettingsError."""
    check_spec(spec)
    from ..runtime.ray_local import bounded_connect, loopback_only

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
    placed = spec.placed()  # the paths as every node sees them
    # Through the checks a config file's `args` get (the autoscale range among them).
    arguments = ray_serve.RaySettings(str(placed.path), settings, placed.options, placed.adapter_set, scale)
    checked = ray_serve.validated(asdict(arguments))
    return ray_cluster.run(checked)

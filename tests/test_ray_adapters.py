"""`clef-gguf serve --ray` with adapters (runtime/adapters.py): every replica is loaded with the same fine-tunes, and
the ingress resolves a request's model name to the identity the replicas give it (runtime/catalog.py).

The application itself on the session's Ray cluster (two replicas answering each model by its name as a ClefModel
loaded with the same adapters answers in the test's process, a named adapter and one of a folder) is
tests/test_adapter_refusals.py's, whose deployment also holds the folder of bad files its refusals are checked with:
one application start for both.
"""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra: pip install 'clef-gguf[ray]' (tools/test.sh does)")

from clef_gguf.errors import SettingsError  # noqa: E402
from clef_gguf.server.ray_serve import build_app, settings_from_args  # noqa: E402
from clef_gguf.settings import AdapterSet, LoadOptions, ModelSpec  # noqa: E402


def test_every_replica_is_bound_with_the_adapter_settings():
    """What each ClefReplica builds its model from (its deployment's arguments, the same for every replica: one
    ModelSpec, the adapters in its AdapterSet), and the ingress's encoder the same spec; a config's adapters sit in
    their own table, `adapter_set` (under `load` they are refused, saying where they belong)."""
    expected = {"adapters": {"a": "/a.adapter.gguf"}, "adapter_dir": "/tunes", "max_adapters": 3, "adapter_memory": 1 << 30}
    settings = settings_from_args({"model": "/m.gguf", "scale": {"replicas": 2}, "adapter_set": expected})
    ingress = build_app(settings)._bound_deployment
    replicas = ingress.init_args[0]._bound_deployment
    assert replicas.num_replicas == 2
    [spec] = replicas.init_args
    assert ingress.init_args[1] == spec == ModelSpec("/m.gguf", LoadOptions(n_threads=1), AdapterSet(**expected))
    pickle.loads(pickle.dumps(spec))  # (what Ray hands each replica)
    with pytest.raises(SettingsError, match=r"load\.adapter_dir: not a setting here; it is adapter_set\.adapter_dir"):
        settings_from_args({"model": "/m.gguf", "load": {"adapter_dir": "/tunes"}})


@pytest.mark.slow
def test_serve_on_ray_refuses_a_bad_adapter_before_ray_starts(ws):
    """The named adapters are checked against the model as loading checks them, before any Ray process starts."""
    import os
    import subprocess
    import sys

    from live_server import free_port

    base = ws.gguf("untied_f32", "f32")
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(base), "--ray", "--port", str(free_port())]
    run = subprocess.run(
        [*command, "--adapter", f"x={base}"], capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": ""}
    )
    assert run.returncode == 6 and "is not an adapter file" in run.stderr, run.stderr  # (a model given as the adapter)
    assert "Traceback" not in run.stderr and "Ray" not in run.stderr

"""A model is declared once: one frozen ModelSpec (settings.py) that the API, the CLI and a
Ray config all build, and a model of two parts: the encoder (vocabulary, template and a catalog that needs no
llama.cpp) and the decider. A request's model name is resolved once, into the prompt, and nothing looks it up again."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from cli_helpers import run_cli
from peft_adapters import peft_adapter
from server_helpers import start

from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST
from clef_gguf.errors import SettingsError
from clef_gguf.runtime.catalog import Catalog
from clef_gguf.runtime.model import ClefModel, load, open_encoder
from clef_gguf.server import create_app
from clef_gguf.settings import N_GPU_LAYERS_ENV, AdapterSet, LoadOptions, ModelSpec
from clef_gguf.testing.request_suite import labelled_requests

CONTEXT = 2048
REQUEST = labelled_requests(1)[0]


def test_the_spec_is_frozen_picklable_and_checked_once():
    spec = ModelSpec.of(DEMO_MODEL, max_prompt_tokens=CONTEXT, parallel=2, adapters={"a": Path("a.adapter.gguf")}, max_adapters=3)
    assert spec == ModelSpec(
        DEMO_MODEL, LoadOptions(max_prompt_tokens=CONTEXT, parallel=2), AdapterSet({"a": Path("a.adapter.gguf")}, max_adapters=3)
    )
    assert pickle.loads(pickle.dumps(spec)) == spec  # (how it reaches Ray's replicas and actors)
    for target, name in ((spec, "path"), (spec.options, "parallel"), (spec.adapter_set, "max_adapters")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(target, name, 1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'adapter_folder'"):
        ModelSpec.of(DEMO_MODEL, adapter_folder="tunes")  # a mistyped keyword, as a function refuses it
    with pytest.raises(SettingsError, match="excludes adapters"):
        AdapterSet(adapters={"a": "a.adapter.gguf"}, adapter="b.adapter.gguf")
    with pytest.raises(SettingsError, match="max_adapters must be >= 1"):
        ModelSpec.of(DEMO_MODEL, max_adapters=0)
    placed = ModelSpec.of("demo.gguf", adapter_dir="tunes", mmproj="mm.gguf").placed()
    assert all(Path(p).is_absolute() for p in (placed.path, placed.adapter_set.adapter_dir, placed.options.mmproj))


@pytest.fixture
def built(monkeypatch):
    """The specs ClefModel is built from in this test, the real model built from each."""
    specs: list[ModelSpec] = []
    real = ClefModel.__init__

    def recording(self, spec, *observers):
        specs.append(spec)
        real(self, spec, *observers)

    monkeypatch.setattr(ClefModel, "__init__", recording)
    return specs


def test_cli_flags_api_keywords_and_a_ray_config_give_one_spec(built, tmp_path):
    # decide: the load flags and the pinned adapter (the model given as an adapter: refused, once the spec is built).
    flags = ["--ctx", str(CONTEXT), "--parallel", "2", "--ubatch", "512", "--threads", "1", "--state-cache", "1MiB"]
    assert run_cli("decide", DEMO_MODEL, DEMO_REQUEST, *flags).returncode == 0
    loading = {"max_prompt_tokens": CONTEXT, "parallel": 2, "ubatch": 512, "n_threads": 1, "state_cache": 1 << 20}
    assert run_cli("decide", DEMO_MODEL, DEMO_REQUEST, *flags, "--adapter", DEMO_MODEL, "--base-head").returncode == 6
    # serve: the adapter set (a named file that is a model, not an adapter: refused at load, before any port is bound).
    folder = tmp_path / "tunes"
    folder.mkdir()
    named = shutil.copyfile(DEMO_MODEL, tmp_path / "a.adapter.gguf")
    tunes = ["--adapter", f"a={named}", "--adapter-dir", folder, "--max-adapters", "3", "--adapter-memory", "1GiB"]
    assert run_cli("serve", DEMO_MODEL, *flags, *tunes, "--base-head").returncode == 6
    adapter_set = {"adapters": {"a": named}, "adapter_dir": folder, "max_adapters": 3, "adapter_memory": 1 << 30}
    assert built == [
        ModelSpec.of(DEMO_MODEL, **loading),
        ModelSpec.of(DEMO_MODEL, **loading, adapter=DEMO_MODEL, base_head=True),
        ModelSpec.of(DEMO_MODEL, **loading, **adapter_set, base_head=True),
    ]
    ray_serve = pytest.importorskip("clef_gguf.server.ray_serve")  # (Ray Serve's settings: no cluster is started)
    args = {"model": str(DEMO_MODEL), "load": loading, "adapter_set": {**adapter_set, "base_head": True}}
    assert ray_serve.settings_from_args(args).spec() == ModelSpec.of(str(DEMO_MODEL), **loading, **adapter_set, base_head=True)


def test_the_catalog_and_the_encoder_need_no_llama_cpp():
    """With llama_cpp unimportable, the catalog resolves a request's name over the demo model's validated file, and the
    encoder module imports: the catalog is built without llama.cpp, as docs/internals.md says."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["llama_cpp"] = None  # import llama_cpp raises ImportError
        from clef_gguf.check.validate import open_validated
        from clef_gguf.runtime import adapter_files, encoder
        from clef_gguf.runtime.catalog import Catalog
        from clef_gguf.runtime.prompt import parse_request
        from clef_gguf.settings import AdapterSet
        validated = open_validated({str(DEMO_MODEL)!r})
        catalog = Catalog(validated.file, validated.description, validated.file.identity(), AdapterSet())
        request = parse_request({{"model": "jev-latest", "state": "s", "questions": {{"q": {{"type": "noul"}}}}}})
        ref = catalog.resolve(request.named)
        assert ref.entry is catalog.base and ref.name == validated.description.name, ref
        catalog.close()
        validated.close()
        loaded = sorted(m for m in sys.modules if m.startswith(("clef_gguf.llama", "llama_cpp")) and sys.modules[m])
        print("llama modules:", loaded)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "llama modules: []"


@pytest.fixture(scope="module")
def tuned(ws, tmp_path_factory):
    """The untied f32 fixture loaded with a named adapter (a) and a folder's (b), and its file."""
    root = tmp_path_factory.mktemp("spec")
    release, base = ws.release("untied_f32"), ws.gguf("untied_f32", "f32")
    folder = root / "tunes"
    folder.mkdir()
    named = peft_adapter(release, root, "a")
    peft_adapter(release, folder, "b", seed=1)
    with load(base, max_prompt_tokens=CONTEXT, adapters={"a": named}, adapter_dir=folder, state_cache=0) as model:
        yield model


@pytest.fixture
def lookups(monkeypatch):
    """How often a catalog resolves a name (Catalog.resolve) and looks an identity up (Catalog.of), counted."""
    counts = {"resolve": 0, "of": 0}
    for name in counts:
        real = getattr(Catalog, name)

        def counted(self, *args, _name=name, _real=real):
            counts[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(Catalog, name, counted)
    return counts


@pytest.mark.slow
def test_a_name_is_resolved_once_per_request(tuned, lookups):
    """Locally and over HTTP (the scheduler, the state cache, the answer and the metrics' label): one resolution per
    request, and no lookup by identity; a prompt encoded by another catalog (the Ray ingress's) is looked up once."""
    names = [None, "a", "b", "jev-latest"]
    answers = [tuned.decide({**REQUEST, "model": n} if n else REQUEST)["model"] for n in names]
    assert answers == [tuned.name, "a", "b", "jev-latest"]
    assert lookups == {"resolve": 4, "of": 0}
    live = start(create_app(tuned, owns_model=False))
    try:
        with httpx.Client(base_url=live.url, timeout=120) as client:
            for n in names:
                assert client.post("/v1/systemone", json={**REQUEST, "model": n}).status_code == 200
            metrics = client.get("/metrics").text
    finally:
        live.stop()
    assert lookups == {"resolve": 8, "of": 0}
    assert 'clef_prompt_tokens_total{model="a"}' in metrics and 'clef_prompt_tokens_total{model="b"}' in metrics
    encoder = open_encoder(tuned.spec)  # another catalog of the same files: the ingress's
    try:
        prompt = encoder.encode({**REQUEST, "model": "a"})
    finally:
        encoder.close()
    assert lookups == {"resolve": 9, "of": 0}
    assert tuned.decide(prompt) == tuned.decide({**REQUEST, "model": "a"})
    assert lookups == {"resolve": 10, "of": 1}


def test_offload_has_one_default_read_from_the_environment(monkeypatch):
    """n_gpu_layers not given: CLEF_GGUF_N_GPU_LAYERS, else 0, for load() as for every command's -ngl (and for the test
    suite's device set, which sets that one value); given, it is what was given."""
    monkeypatch.delenv(N_GPU_LAYERS_ENV, raising=False)
    assert LoadOptions().n_gpu_layers == 0 and ModelSpec.of(DEMO_MODEL).options.n_gpu_layers == 0
    monkeypatch.setenv(N_GPU_LAYERS_ENV, "-1")
    assert LoadOptions().n_gpu_layers == -1 and ModelSpec.of(DEMO_MODEL).options.n_gpu_layers == -1
    assert LoadOptions(n_gpu_layers=0).n_gpu_layers == 0 and ModelSpec.of(DEMO_MODEL, n_gpu_layers=3).options.n_gpu_layers == 3
    monkeypatch.setenv(N_GPU_LAYERS_ENV, "0")  # plan's own default (-1, a card) gives way to it too
    planned = run_cli("plan", str(DEMO_MODEL), "--json")
    assert planned.returncode == 0 and json.loads(planned.stdout)["n_gpu_layers"] == 0, planned.stderr
    for value in ("all", "-7"):  # (-7 named n_gpu_layers, which the caller never wrote)
        monkeypatch.setenv(N_GPU_LAYERS_ENV, value)
        with pytest.raises(SettingsError, match=f"^{N_GPU_LAYERS_ENV} must be an integer from -1"):
            LoadOptions()
        assert LoadOptions(n_gpu_layers=0).n_gpu_layers == 0  # a value given wins over the variable


def test_serves_adapters_means_what_the_adapter_set_says(ws, tmp_path):
    """A catalog serves adapters (a request may name a fine-tune) exactly when its AdapterSet says so: a pinned
    adapter answers every request, and serves none by name."""
    from clef_gguf.check.validate import open_validated

    adapter = peft_adapter(ws.release("untied_f32"), tmp_path, "a")
    validated = open_validated(ws.gguf("untied_f32", "f32"))
    try:
        sets = (AdapterSet(), AdapterSet(adapter=str(adapter)), AdapterSet({"a": adapter}), AdapterSet(adapter_dir=tmp_path))
        for adapter_set in sets:
            catalog = Catalog(validated.file, validated.description, validated.file.identity(), adapter_set)
            try:
                assert catalog.serves_adapters == adapter_set.serves_adapters, adapter_set
            finally:
                catalog.close()
    finally:
        validated.close()

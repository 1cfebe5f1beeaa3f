"""One answer path (runtime/decider.py's Decider.decide): `decide`, `decide_many`, the JSON Lines mode, the server and
Ray's actors answer a request that names an adapter (Workers AI's `lora`, System One's `model`) with that adapter's
name and its probabilities, those of its merged conversion; an adapter file is validated once per version and
process (on Ray: once on the driver, once per actor); the decider tells its observer of each load and eviction."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli  # the CLI in this process
from peft_adapters import LORA

import clef_gguf
from clef_gguf.conversion.adapter import convert_adapter
from clef_gguf.errors import ExitCode, RequestError
from clef_gguf.runtime import adapter_files
from clef_gguf.runtime.dataset_file import decide_file
from clef_gguf.testing import finetune
from clef_gguf.testing.request_suite import LABELLED, flat_probabilities, labelled_requests

pytestmark = pytest.mark.slow  # PEFT checkpoints and their merged conversions

CONTEXT = 4096
ROUNDED = 1e-4 + 1e-9  # answers are rounded to 4 decimals: float noise may move one by a unit
NAMES = ("tuned", "other")


class Tunes:
    """The base's f32 file, two adapter files over it, and each one's merged f32 conversion."""

    def __init__(self, ws, root: Path) -> None:
        release = ws.release("untied_f32")
        self.base = ws.gguf("untied_f32", "f32")
        self.release, self.adapters, self.merged, self.checkpoints = release, {}, {}, {}
        for seed, name in enumerate(NAMES):
            checkpoint = finetune.peft_checkpoint(release, root / name, LORA, {"prior_logit_scale": 0.5 + seed}, seed=seed)
            self.checkpoints[name] = checkpoint
            self.adapters[name] = convert_adapter(checkpoint, release, root / f"{name}.adapter.gguf", "f32")
            self.merged[name] = clef_gguf.convert(checkpoint, root / f"{name}-merged.gguf", "f32", base=release, mmproj=False)


@pytest.fixture(scope="module")
def tunes(ws, tmp_path_factory) -> Tunes:
    return Tunes(ws, tmp_path_factory.mktemp("answer-path"))


@pytest.fixture(scope="module")
def expected(tunes) -> dict[str, list[list[float]]]:
    """Each adapter's merged conversion's probabilities for the requests, and the base's."""
    found = {}
    for name, path in [*tunes.merged.items(), (None, tunes.base)]:
        with clef_gguf.load(path, max_prompt_tokens=CONTEXT) as alone:
            found[name] = [flat_probabilities(alone.decide(r)) for r in labelled_requests(3)]
    return found


def _named(how: str, name: str, request: dict) -> dict:
    return {**request, how: name}


def _check(answers: list[dict], names: list[str | None], expected: dict) -> None:
    """Each answer is its adapter's: its name (the base's for None), and its merged conversion's probabilities."""
    for i, (answer, name) in enumerate(zip(answers, names, strict=True)):
        assert "error" not in answer, answer
        if name is not None:
            assert answer["model"] == name, (answer["model"], name)
        got, want = flat_probabilities(answer), expected[name][i % 3]
        assert np.abs(np.subtract(got, want)).max() <= ROUNDED, (name, i)


@pytest.mark.parametrize("how", ["lora", "model"])
def test_decide_many_answers_as_the_adapter_a_request_names(tunes, expected, how):
    requests, names = [], []
    for name in (*NAMES, None):
        for request in labelled_requests(3):
            requests.append(_named(how, name, request) if name is not None else request)
            names.append(name)
    with clef_gguf.load(tunes.base, max_prompt_tokens=CONTEXT, adapters=tunes.adapters) as model:
        _check(list(model.decide_many(requests)), names, expected)
        _check([model.decide(r) for r in requests], names, expected)  # the same as one at a time


@pytest.mark.parametrize("how", ["lora", "model"])
def test_the_json_lines_mode_answers_as_the_adapter_a_request_names(tunes, expected, tmp_path, how):
    source, out = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    requests = [_named(how, name, r) for name in NAMES for r in labelled_requests(3)]
    source.write_text("".join(json.dumps(r) + "\n" for r in requests))
    with clef_gguf.load(tunes.base, max_prompt_tokens=CONTEXT, adapters=tunes.adapters) as model:
        decide_file(model, str(source), str(out))
    _check([json.loads(line) for line in out.read_text().splitlines()], [n for n in NAMES for _ in range(3)], expected)


def test_decide_jsonl_with_an_adapter_answers_as_it(tunes, expected, tmp_path):
    """`decide BASE REQUESTS.jsonl --adapter FILE`: every request is the fine-tune's, named as its file."""
    source, out = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    requests = [_named(how, "tuned", r) for how in ("lora", "model") for r in labelled_requests(3)]
    source.write_text("".join(json.dumps(r) + "\n" for r in requests))
    run = run_cli("decide", tunes.base, source, "-o", out, "--ctx", str(CONTEXT), "--adapter", tunes.adapters["tuned"])
    assert run.returncode == 0, run.stderr[-2000:]
    _check([json.loads(line) for line in out.read_text().splitlines()], ["tuned"] * 6, expected)


class Counted:
    """adapter_files.open_adapter (the validation of an adapter file against its base), counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = adapter_files.open_adapter

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(adapter_files, "open_adapter", counted)


def test_an_adapter_is_validated_once_per_version_and_process(tunes, monkeypatch):
    """Read at load, loaded by the probe, evicted and loaded again: validated once (the later reads are checked to be
    the version validated, by its signature and identity)."""
    counted = Counted(monkeypatch)
    adapters = {name: tunes.adapters[name] for name in NAMES}
    with clef_gguf.load(tunes.base, max_prompt_tokens=CONTEXT, adapters=adapters, max_adapters=1) as model:
        assert counted.calls == 2  # each named adapter, read at load
        for _ in range(2):
            for name in NAMES:
                model.decide(_named("model", name, labelled_requests(1)[0]))
        assert counted.calls == 2
    with clef_gguf.load(tunes.base, max_prompt_tokens=CONTEXT, adapter=tunes.adapters["tuned"]) as model:
        model.decide(labelled_requests(1)[0])
        assert counted.calls == 3


def test_decide_ray_validates_the_adapter_once_on_the_driver_and_once_per_actor(tunes, monkeypatch, tmp_path):
    """`decide --ray --adapter`: the driver reads and validates it once before any Ray process (here no cluster answers
    at the address and the run stops right after, unless this process joined one before: then it runs there, the
    actors' validations in their own processes); each actor (the actor's own class, run in this process) once."""
    from clef_gguf.runtime.dataset_ray import DecidePart, _PartActor, actors_for, parts
    from clef_gguf.runtime.reader import read_records
    from clef_gguf.settings import FileOptions, ModelSpec

    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in labelled_requests(3)))
    counted = Counted(monkeypatch)
    nowhere = ("--ray", "--address", "127.0.0.1:9")
    run = run_cli("decide", tunes.base, source, "-o", tmp_path / "out.jsonl", *nowhere, "--adapter", tunes.adapters["tuned"])
    assert counted.calls == 1, (run.returncode, counted.calls, run.stderr[-500:])
    spec = ModelSpec.of(tunes.base, max_prompt_tokens=CONTEXT, adapter=str(tunes.adapters["tuned"]), state_cache=0)
    actors, _ = actors_for(spec, str(source))
    assert counted.calls == 2  # the driver's
    actor = _PartActor(actors=actors, job=DecidePart(FileOptions(), str(tmp_path)))
    with open(source, "rb") as file:
        [part] = parts(file, read_records(file, 1 << 20, 1), 1, 256)
    actor({k: np.array([v]) for k, v in part.items()})
    actor.model.close()
    assert counted.calls == 3  # the actor's: one


class Events:
    """An AdapterObserver that keeps what it is told."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.uses: list[tuple[str, bool]] = []  # each batch's adapter, and whether it was loaded already

    def used(self, name: str, resident: bool) -> None:
        self.uses.append((name, resident))

    def loaded(self, name: str, seconds: float, nbytes: int) -> None:
        assert seconds > 0 and nbytes > 0
        self.seen.append(("loaded", name))

    def evicted(self, name: str, nbytes: int) -> None:
        self.seen.append(("evicted", name))

    def retired(self, name: str, nbytes: int) -> None:
        self.seen.append(("retired", name))


def test_the_decider_tells_its_observer_of_loads_evictions_and_retirements(tunes, tmp_path):
    from clef_gguf.runtime.model import ClefModel
    from clef_gguf.settings import ModelSpec

    folder = tmp_path / "adapters"
    folder.mkdir()
    for name in NAMES:
        (folder / f"{name}.adapter.gguf").write_bytes(tunes.adapters[name].read_bytes())
    events = Events()
    spec = ModelSpec.of(tunes.base, max_prompt_tokens=CONTEXT, adapter_dir=folder, max_adapters=1, state_cache=0)
    request = labelled_requests(1)[0]
    with ClefModel(spec, events) as model:
        model.decide(_named("model", "tuned", request))
        model.decide(_named("model", "other", request))
        assert events.seen == [("loaded", "tuned"), ("evicted", "tuned"), ("loaded", "other")]
        # "other" replaced by another version (its f16 conversion): the loaded one is retired when it makes room
        convert_adapter(tunes.checkpoints["other"], tunes.release, tmp_path / "other.adapter.gguf", "f16")
        (tmp_path / "other.adapter.gguf").replace(folder / "other.adapter.gguf")
        model.decide(_named("model", "other", request))
        assert events.seen[3:] == [("retired", "other"), ("loaded", "other")]
        model.decide(_named("model", "other", request))
        model.decide(request)  # (the base: no adapter used)
    assert events.uses == [("tuned", False), ("other", False), ("other", False), ("other", True)]


def test_an_adapter_that_fails_to_load_evicts_none(tunes, tmp_path):
    """max_adapters 1: an adapter whose load is refused (its file changed after the request named it) leaves the one
    loaded loaded, answering; the LRU makes room only for an adapter read and checked."""
    import shutil

    from clef_gguf.errors import AdapterUnavailableError
    from clef_gguf.runtime.model import ClefModel
    from clef_gguf.settings import ModelSpec

    folder = tmp_path / "adapters"
    folder.mkdir()
    for name in NAMES:
        shutil.copyfile(tunes.adapters[name], folder / f"{name}.adapter.gguf")
    events = Events()
    spec = ModelSpec.of(tunes.base, max_prompt_tokens=CONTEXT, adapter_dir=folder, max_adapters=1, state_cache=0)
    request = labelled_requests(1)[0]
    with ClefModel(spec, events) as model:
        before = model.decide(_named("model", "tuned", request))
        named = model.encode(_named("model", "other", request))
        shutil.copyfile(folder / "tuned.adapter.gguf", folder / "other.adapter.gguf")  # before it is loaded
        with pytest.raises(AdapterUnavailableError, match="changed after this request named it"):
            model.answer_batch([named])
        assert events.seen == [("loaded", "tuned")]
        assert model.decide(_named("model", "tuned", request)) == before


WORKERS_AI = "/accounts/a/ai/run/@cf/cloudflare/clef-flash"


def test_an_answer_names_the_model_that_answered(tunes, expected, tmp_path):
    """A request naming a client's alias in `model` and a fine-tune in `lora` is the fine-tune's, and its answer says
    so (it said the alias) in decide, decide_many, the JSON Lines mode and both serve routes; the base's answer still
    echoes the name the request used. An unknown `lora` is a 422 at `lora` on both routes."""
    from live_server import served

    both = [{**r, "model": "clef-flash", "lora": "tuned"} for r in labelled_requests(3)]
    aliased = [{**r, "model": "clef-flash"} for r in labelled_requests(3)]
    source, out = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in both))
    with clef_gguf.load(tunes.base, max_prompt_tokens=CONTEXT, adapters=tunes.adapters) as model:
        _check([model.decide(r) for r in both], ["tuned"] * 3, expected)
        _check(list(model.decide_many(both)), ["tuned"] * 3, expected)
        assert [a["model"] for a in model.decide_many(aliased)] == ["clef-flash"] * 3
        decide_file(model, str(source), str(out))
    _check([json.loads(line) for line in out.read_text().splitlines()], ["tuned"] * 3, expected)
    import httpx

    pairs = [arg for name in NAMES for arg in ("--adapter", f"{name}={tunes.adapters[name]}")]
    with served(tunes.base, "--ctx", str(CONTEXT), *pairs) as (url, _), httpx.Client(base_url=url, timeout=120) as client:
        _check([client.post("/v1/systemone", json=both[0]).json()], ["tuned"], expected)
        _check([client.post(WORKERS_AI, json=both[0]).json()["result"]], ["tuned"], expected)
        unknown = {**both[0], "lora": "nope"}
        refused = client.post("/v1/systemone", json=unknown)
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "lora"], refused.text
        run = client.post(WORKERS_AI, json=unknown)
        assert run.status_code == 422 and run.json()["errors"][0]["message"].startswith("body.lora: "), run.text


def test_a_lora_is_answered_only_by_the_fine_tune_it_names(tunes, expected, tmp_path):
    """A pinned adapter (--adapter FILE) answers every request under its own name (a `model` alias is no answer's
    name), and refuses a `lora` naming another fine-tune (it answered it, as itself); `decide BASE` on JSON Lines
    without adapters refuses a `lora` naming one (the base answered it) and still echoes any `model`."""
    requests = labelled_requests(3)
    with clef_gguf.load(tunes.base, max_prompt_tokens=CONTEXT, adapter=tunes.adapters["tuned"]) as model:
        _check([model.decide({**r, "model": "clef-flash"}) for r in requests], ["tuned"] * 3, expected)
        _check([model.decide({**requests[0], "lora": "tuned", "model": "x"})], ["tuned"], expected)
        with pytest.raises(RequestError, match="tuned answers every request") as caught:
            model.decide({**requests[0], "lora": "other"})
        assert caught.value.field == "lora"
    source, out = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    source.write_text(json.dumps({**requests[0], "lora": "tuned"}) + "\n" + json.dumps({**requests[0], "model": "mine"}) + "\n")
    run = run_cli("decide", tunes.base, source, "-o", out, "--ctx", str(CONTEXT))
    assert run.returncode == ExitCode.SOME_ERRORS, run.stderr[-2000:]
    refused, answered = (json.loads(line) for line in out.read_text().splitlines())
    assert refused["error"]["detail"][0]["loc"] == ["body", "lora"], refused
    assert answered["model"] == "mine" and flat_probabilities(answered) == pytest.approx(expected[None][0], abs=ROUNDED)


def test_eval_compare_and_calibrate_name_the_adapter_they_ran(tunes, tmp_path):
    """eval --adapter: metrics.json's `checkpoint` (clef-finetune's field for the fine-tune over `model_dir`) is the
    adapter file, and report.md's model line names it (both named the base alone); compare's and calibrate's too."""
    adapter, data = str(tunes.adapters["tuned"]), str(LABELLED)
    ran = run_cli("eval", tunes.base, data, "--adapter", adapter, "-o", tmp_path / "eval", "--ctx", str(CONTEXT))
    assert ran.returncode == 0, ran.stderr[-2000:]
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["model_dir"] == str(tunes.base) and metrics["checkpoint"] == adapter
    assert f"model: `{tunes.base}` with the adapter `{adapter}`" in (tmp_path / "eval" / "report.md").read_text()
    compared = run_cli("compare", tunes.base, tunes.base, data, "--adapter-a", adapter, "--json", "--ctx", str(CONTEXT))
    assert compared.returncode == 0, compared.stderr[-2000:]
    assert json.loads(compared.stdout)["a"] == f"{tunes.base} with the adapter {adapter}"
    out = tmp_path / "calibrated.adapter.gguf"
    fitted = run_cli("calibrate", tunes.base, data, "-o", out, "--adapter", adapter, "--json", "--ctx", str(CONTEXT))
    assert fitted.returncode == 0 and json.loads(fitted.stdout)["adapter"] == adapter, fitted.stderr[-2000:]
